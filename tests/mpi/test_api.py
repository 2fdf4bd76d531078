"""The front door (``import hpcasync``): every family as a torch Optimizer in a user's own loop,
and each hazard of the old API as a property that fails on it.

Runs under ``mpiexec -n 4 python -m mpi4py -m pytest`` (tests that need 4 ranks skip otherwise).
Subprocess tests (a user's script that exits without ``finish()`` / ``serve()``) run on rank 0.
"""
from __future__ import annotations

import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpcasync
from hpcasync.errors import ConfigError
from tests.models import SmallBN
from tests.mpi_util import COMM, RANK, SIZE, digest, identical_everywhere, run_mpi

needs4 = pytest.mark.skipif(SIZE != 4, reason="needs 4 MPI ranks")


@pytest.fixture(scope="module")
def data():
    from hpcasync.data import load_dataset

    train, _ = load_dataset("fashion-mnist-mini")
    return train


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SmallBN()


def batch(data, step: int, rank: int = RANK, bs: int = 16):
    lo = (step * SIZE + rank) * bs
    return data.images[lo: lo + bs], data.labels[lo: lo + bs]


# -- it is a torch Optimizer: schedulers, state dicts ---------------------------------------------

@needs4
@pytest.mark.parametrize("algorithm", ["ssgd", "daso", "odsgd"])
def test_lr_schedulers_drive_the_algorithm(algorithm, data):
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    from hpcasync.topology import Topology

    topo = Topology.build(ranks_per_node=2)
    kw = {"daso": dict(epochs=2, steps_per_epoch=2, warmup_epochs=0, cooldown_epochs=0,
                       topo=topo), "odsgd": dict(warmup_iters=1)}.get(algorithm, {})
    opt = hpcasync.optimizer(algorithm, model, sgd, **kw)
    assert isinstance(opt, torch.optim.Optimizer)
    scheds = [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)]
    for epoch in range(2):
        for s in range(2):
            x, y = batch(data, 2 * epoch + s)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if algorithm == "daso":
            opt.epoch_end(1.0)
        for sch in scheds:
            sch.step()
    assert opt.lr() == pytest.approx(0.025)
    if algorithm == "odsgd":
        assert opt.hp.lr == pytest.approx(0.05)   # read at the last step (after one decay)
        opt.finish()
    else:
        assert sgd.param_groups[0]["lr"] == pytest.approx(0.025)   # one set of groups
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5)
    assert opt.lr() == pytest.approx(0.05)                # initial_lr 0.1 x 0.5
    del lam
    one = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=10)
    assert opt.lr() == pytest.approx(one.get_last_lr()[0])
    assert identical_everywhere(model)
    topo.free()


@needs4
@pytest.mark.parametrize("algorithm", ["ssgd", "daso", "odsgd"])
def test_state_dict_round_trips_and_takes_a_plain_torch_state(algorithm, data):
    from hpcasync.topology import Topology

    topo = Topology.build(ranks_per_node=2)
    model = make_model()
    kw = {"daso": dict(epochs=1, steps_per_epoch=4, warmup_epochs=0, cooldown_epochs=0,
                       topo=topo)}.get(algorithm, {})
    # a plain torch optimizer that trained a step: its momentum and lr must carry over
    ref = make_model()
    plain = torch.optim.SGD(ref.parameters(), lr=0.07, momentum=0.9)
    x, y = batch(data, 0, rank=0)
    F.cross_entropy(ref(x), y).backward()
    plain.step()
    opt = hpcasync.optimizer(algorithm, model, torch.optim.SGD(model.parameters(), lr=0.01,
                                                               momentum=0.9), **kw)
    opt.load_state_dict(plain.state_dict())
    assert opt.lr() == pytest.approx(0.07)
    if algorithm == "odsgd":       # SGD's momentum buffers become the global momentum buffer
        want = torch.cat([plain.state[p]["momentum_buffer"].reshape(-1) for p in ref.parameters()])
        assert torch.equal(opt.worker.glob.buf, want)
    else:
        bufs = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
        assert all(torch.equal(a, plain.state[q]["momentum_buffer"])
                   for a, q in zip(bufs, ref.parameters()))
    sd = opt.state_dict()
    assert sd["hpcasync"]["algorithm"] == algorithm
    if algorithm != "odsgd":
        m2 = make_model()
        again = hpcasync.optimizer(algorithm, m2, torch.optim.SGD(m2.parameters(), lr=0.5), **kw)
        again.load_state_dict(sd)
        assert again.lr() == pytest.approx(0.07)
    back = torch.optim.SGD(make_model().parameters(), lr=1.0)     # ours into a plain torch one
    if algorithm != "odsgd":
        back.load_state_dict(sd)
        assert back.param_groups[0]["lr"] == pytest.approx(0.07)
    with pytest.raises(Exception, match="algorithm"):
        bad = dict(sd, hpcasync={"algorithm": "asgd"})
        opt.load_state_dict(bad)
    if algorithm == "odsgd":
        opt.finish()
    topo.free()


# -- zero_grad(set_to_none=True) never silently stops communication ---------------------------

@needs4
@pytest.mark.parametrize("how", ["model", "inner", "wrapper"])
@pytest.mark.parametrize("algorithm", ["ssgd", "daso"])
def test_set_to_none_keeps_replicas_bitwise_equal(algorithm, how, data):
    from hpcasync.topology import Topology

    topo = Topology.build(ranks_per_node=2)

    def train(zero) -> nn.Module:
        model = make_model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        kw = dict(epochs=1, steps_per_epoch=6, warmup_epochs=0, cooldown_epochs=0,
                  topo=topo) if algorithm == "daso" else {}
        opt = hpcasync.optimizer(algorithm, model, sgd, **kw)
        for s in range(6):
            zero(model, sgd, opt)
            x, y = batch(data, s)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if algorithm == "daso":
            opt.epoch_end(1.0)
        return model

    zero = {"model": lambda m, s, o: m.zero_grad(),                 # set_to_none=True (default)
            "inner": lambda m, s, o: s.zero_grad(set_to_none=True),
            "wrapper": lambda m, s, o: o.zero_grad(set_to_none=True)}[how]
    model = train(zero)
    reference = train(lambda m, s, o: o.zero_grad(set_to_none=False))
    assert identical_everywhere(model)
    assert digest(model) == digest(reference)       # the same training, not merely equal replicas
    topo.free()


@needs4
def test_ssgd_averages_batchnorm_buffers_every_step(data):
    model = make_model()
    opt = hpcasync.optimizer("ssgd", model, torch.optim.SGD(model.parameters(), lr=0.05))
    x, y = batch(data, 0)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert identical_everywhere(model)            # buffers included
    assert not torch.equal(model.bn.running_mean, torch.zeros(4))


# -- the parameter server in a user's loop -------------------------------------------------------

@needs4
def test_ps_user_loop_buffers_lr_and_final_model(data):
    from hpcasync.ps.optimizer import ParameterServer

    model = make_model(seed=RANK)                  # the server's initial parameters win
    opt = hpcasync.optimizer("asgd", model, torch.optim.SGD(model.parameters(), lr=0.08))
    assert isinstance(opt, ParameterServer) and isinstance(opt, torch.optim.Optimizer)
    assert identical_everywhere(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    if opt.is_server:
        with pytest.raises(ConfigError, match="parameter server"):
            opt.step()
        lrs = []
        opt.serve(on_push=lambda w, tau, loss: lrs.append(opt.rule.lr))
        # each push carried its worker's lr: 3 workers x (2 at 0.08, then 2 at 0.04)
        assert sorted(lrs) == pytest.approx([0.04] * 6 + [0.08] * 6)
        # the server's model holds the mean of the workers' latest buffers
        assert torch.allclose(model.bn.running_mean, opt._buffers.mean(0)[:4])
    else:
        with pytest.raises(ConfigError, match="worker"):
            opt.serve()
        for epoch in range(2):
            for s in range(2):
                x, y = batch(data, 2 * epoch + s)
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step(loss=loss)
            sched.step()
        opt.finish()
    assert identical_everywhere(model)              # every rank ends with the server's θ


@needs4
def test_smega2_warmup_applies_by_default(data):
    model = make_model()
    with pytest.raises(ConfigError, match="steps_per_epoch.*warmup_epochs=0"):
        hpcasync.optimizer("smega2", model, lr=0.1, momentum=0.9)
    opt = hpcasync.optimizer("smega2", model, lr=0.1, momentum=0.9, steps_per_epoch=10)
    if opt.is_server:
        lrs = []
        opt.serve(on_push=lambda w, tau, loss: lrs.append(opt.rule.lr))
        assert lrs[0] == pytest.approx(0.1 / 3)                 # warm-up from lr/N, N = 3
        assert all(a <= b for a, b in zip(lrs, lrs[1:])) and lrs[-1] < 0.1
    else:
        for s in range(3):
            x, y = batch(data, s)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        opt.finish()


@needs4
def test_lcasgd_asks_for_the_loss(data):
    model = make_model()
    opt = hpcasync.optimizer("lcasgd", model, lr=0.05)
    if opt.is_server:
        opt.serve()
    else:
        x, y = batch(data, 0)
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(ConfigError, match=r"step\(loss=loss\)"):
            opt.step()
        opt.finish()


_SCRIPT = """
import os, sys, torch, torch.nn.functional as F, hpcasync
from hpcasync.data import load_dataset
mode = sys.argv[1]
algorithm = {"no-finish-odsgd": "odsgd", "uneven": "ssgd"}.get(mode, "asgd")
ctx = hpcasync.init(algorithm)
train, _ = load_dataset("fashion-mnist-mini")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
opt = hpcasync.optimizer(algorithm, model, torch.optim.SGD(model.parameters(), lr=0.05),
                         **({"warmup_iters": 1} if algorithm == "odsgd" else {}))
if algorithm != "asgd":
    steps = 3 + (ctx.rank == 1 and mode == "uneven")      # rank 1 has one batch more
    for s in range(steps):
        i = (s * ctx.num_shards + ctx.shard_index) * 16
        opt.zero_grad()
        F.cross_entropy(model(train.images[i:i+16]), train.labels[i:i+16]).backward()
        opt.step()
    print("trained", flush=True)
elif ctx.is_server:
    if mode != "no-serve":
        opt.serve()
        print("served", flush=True)
else:
    for s in range(3):
        i = (s * ctx.num_shards + ctx.shard_index) * 16
        opt.zero_grad()
        F.cross_entropy(model(train.images[i:i+16]), train.labels[i:i+16]).backward()
        opt.step()
    # no opt.finish(): the script just ends
"""


@pytest.mark.rank0
# MPICH: no-serve and uneven (the exit barrier's wait, running out or not); no-finish and
# no-finish-odsgd end through the same wait (CI's MPICH pass leaves them out)
@pytest.mark.parametrize("mode", [pytest.param("no-finish", marks=pytest.mark.one_mpi), "no-serve",
                                  pytest.param("no-finish-odsgd", marks=pytest.mark.one_mpi),
                                  "uneven"])
def test_a_forgotten_call_never_hangs(mode, tmp_path):
    """A user's script that forgets a call, or gives one rank a step more, ends: by itself where
    that is safe (a worker's finish at exit), else with one line saying what to do."""
    from tests.mpi_util import clean_env

    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    t0 = time.time()
    # the exit wait: 10 s where the ranks must get through it (they arrive at different times),
    # 3 s where it must run out ("uneven": rank 1 never arrives; 10 s only made the test slower)
    wait = "3" if mode == "uneven" else "10"
    proc = run_mpi(4, ["--", sys.executable, str(script), mode], timeout=120,
                   env=clean_env(HPCASYNC_EXIT_TIMEOUT=wait))
    took = time.time() - t0
    out = proc.stdout + proc.stderr
    if mode == "no-finish":        # the workers finish at exit, the server's serve() returns
        assert proc.returncode == 0, out[-3000:]
        assert "served" in out and "finish() was not called" in out
    elif mode == "no-finish-odsgd":   # the round in flight is completed at exit
        assert proc.returncode == 0, out[-3000:]
        assert "finish() was not called" in out
    elif mode == "no-serve":       # the server ends the job, saying what to do
        assert proc.returncode != 0
        assert "exited without calling opt.serve()" in out, out[-3000:]
        assert took < 60
    else:                          # rank 1 waits in an allreduce the others never join
        assert proc.returncode != 0
        assert "other ranks have not after 3 s" in out and "same number of steps" in out, \
            out[-3000:]
        assert took < 60


# -- checkpoints and metrics from a user's loop --------------------------------------------------

@needs4
@pytest.mark.parametrize("algorithm", ["ssgd", "odsgd"])
def test_checkpoint_resume_from_a_user_loop_is_bitwise(algorithm, data, tmp_path_factory):
    """``save_checkpoint`` at step 3, ``load_checkpoint`` in a new run: each rank ends bitwise
    as the uninterrupted run (OD-SGD: each rank's local weights are its own, gathered into the
    checkpoint and loaded by each rank)."""
    directory = COMM.bcast(str(tmp_path_factory.mktemp("ckpt")) if RANK == 0 else None)
    hyper = {"warmup_iters": 1} if algorithm == "odsgd" else {}

    def run(steps, resume=False):
        model = make_model()
        opt = hpcasync.optimizer(algorithm, model, torch.optim.SGD(model.parameters(), lr=0.05,
                                                                   momentum=0.9), **hyper)
        first = 0
        if resume:
            state = hpcasync.load_checkpoint(directory, model, opt)
            first = state["step"]
        for s in range(first, steps):
            opt.zero_grad()
            x, y = batch(data, s)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if s + 1 == 3 and not resume:
                hpcasync.save_checkpoint(directory, model, opt, epoch=0, step=3, note="three")
        if algorithm == "odsgd":
            opt.finish()
        return model

    whole = run(6)
    run(3)
    resumed = run(6, resume=True)
    assert digest(resumed) == digest(whole)


@needs4
@pytest.mark.timeout(60)        # (without the check: a hang, ended by this)
def test_save_checkpoint_on_rank_0_alone_is_one_line(data, tmp_path_factory, monkeypatch):
    """torch's habit ``if rank == 0: save``, with ``hpcasync.save_checkpoint`` (a collective:
    rank 0 writes, every rank waits for the file): measured before, a 4-rank SSGD loop that did
    so at step 3 ran into its 100 s timeout (rank 0 in the checkpoint's barrier, the others in
    the next step's allreduce). Now rank 0 ends it in one line naming the ranks that did not
    call; a call on every rank afterwards writes as before."""
    from hpcasync.errors import HpcasyncError

    directory = COMM.bcast(str(tmp_path_factory.mktemp("ckpt0")) if RANK == 0 else None)
    monkeypatch.setenv("HPCASYNC_ARRIVAL_TIMEOUT", "1")
    model = make_model()
    opt = hpcasync.optimizer("ssgd", model, torch.optim.SGD(model.parameters(), lr=0.05))
    opt.zero_grad()
    F.cross_entropy(model(batch(data, 0)[0]), batch(data, 0)[1]).backward()
    opt.step()
    if RANK == 0:
        t0 = time.monotonic()
        with pytest.raises(HpcasyncError, match=r"rank\(s\) 1, 2, 3 did not call it within 1 s"):
            hpcasync.save_checkpoint(directory, model, opt, epoch=0, step=1)
        assert time.monotonic() - t0 < 10
    COMM.Barrier()
    path = hpcasync.save_checkpoint(directory, model, opt, epoch=0, step=1)
    assert (path is not None) == (RANK == 0)


@needs4
@pytest.mark.timeout(60)        # (without the check: a hang, ended by this)
def test_average_metric_and_a_comm_load_on_rank_0_alone_are_one_line(data, tmp_path_factory,
                                                                     monkeypatch):
    """``if rank == 0: print(hpcasync.average_metric(loss, ctx))`` in an SSGD loop (measured
    before: 4 ranks hung into a 60 s timeout, rank 0 in the metric's allreduce, the others in the
    next step's) and ``load_checkpoint(..., comm=)`` on rank 0 alone: one line from rank 0 within
    seconds; on every rank but 0, one line from each; called on every rank afterwards, both
    work."""
    from hpcasync.errors import HpcasyncError

    directory = COMM.bcast(str(tmp_path_factory.mktemp("ckpt1")) if RANK == 0 else None)
    monkeypatch.setenv("HPCASYNC_ARRIVAL_TIMEOUT", "1")
    ctx = hpcasync.init("ssgd")
    model = make_model()
    opt = hpcasync.optimizer("ssgd", model, torch.optim.SGD(model.parameters(), lr=0.05))
    for call, what in ((lambda: hpcasync.average_metric(1.0, ctx), "average_metric"),
                       (lambda: hpcasync.load_checkpoint(directory, model, opt, comm=COMM),
                        r"load_checkpoint\(\.\.\., comm=\)")):
        if RANK == 0:
            t0 = time.monotonic()
            with pytest.raises(HpcasyncError, match=rf"hpcasync\.{what} is called on every rank, "
                                                    r"and rank\(s\) 1, 2, 3 did not call it"):
                call()
            assert time.monotonic() - t0 < 10
        COMM.Barrier()
    # the converse (`if rank != 0:`): each caller ends in one line, not in a wait for rank 0
    if RANK != 0:
        t0 = time.monotonic()
        with pytest.raises(HpcasyncError, match=r"hpcasync\.average_metric is called on every "
                                                rf"rank, and rank 0 did not answer rank {RANK}'s"):
            hpcasync.average_metric(1.0, ctx)
        assert time.monotonic() - t0 < 12
    else:                               # (the three calls it never answered: read, for the test)
        from hpcasync.api import _ARRIVAL_TAG
        for r in range(1, SIZE):
            COMM.recv(source=r, tag=_ARRIVAL_TAG)
    COMM.Barrier()
    assert hpcasync.average_metric(float(RANK), ctx) == 1.5
    assert hpcasync.load_checkpoint(directory, model, opt, comm=COMM) is None


@needs4
def test_load_checkpoint_with_a_comm_is_read_by_its_rank_0_alone(data, tmp_path_factory,
                                                                  monkeypatch):
    """``load_checkpoint(..., comm=COMM)``: rank 0 reads the newest file, once, and the others
    receive it (planted: every rank reads -> caught); each rank still loads its own OD-SGD part;
    without ``comm`` every rank reads; a checkpoint of another model is the same one line on
    every rank; an empty directory is None everywhere."""
    import hpcasync.checkpoint as ckpt
    from hpcasync.errors import CheckpointError

    directory = COMM.bcast(str(tmp_path_factory.mktemp("ckpt")) if RANK == 0 else None)
    reads: list = []
    real_read = ckpt.read_checkpoint
    monkeypatch.setattr(ckpt, "read_checkpoint",
                        lambda path, **kw: reads.append(path) or real_read(path, **kw))

    def build():
        model = make_model()
        opt = hpcasync.optimizer("odsgd", model, torch.optim.SGD(model.parameters(), lr=0.05,
                                                                 momentum=0.9), warmup_iters=1)
        return model, opt

    model, opt = build()
    assert hpcasync.load_checkpoint(directory, model, opt, comm=COMM) is None and reads == []
    for s in range(3):
        opt.zero_grad()
        x, y = batch(data, s)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    hpcasync.save_checkpoint(directory, model, opt, epoch=0, step=3)
    mine = digest(model), [t.clone() for t in opt.local_state_dict().values()
                           if isinstance(t, torch.Tensor)]
    assert len(set(COMM.allgather(mine[1][0].numpy().tobytes()))) > 1     # parts of their own
    opt.finish()
    model2, opt2 = build()
    assert hpcasync.load_checkpoint(directory, model2, opt2, comm=COMM)["step"] == 3
    assert COMM.allgather(len(reads)) == [1] + [0] * (SIZE - 1)
    local = [t for t in opt2.local_state_dict().values() if isinstance(t, torch.Tensor)]
    assert digest(model2) == mine[0] and all(torch.equal(a, b) for a, b in zip(local, mine[1]))
    reads.clear()
    assert hpcasync.load_checkpoint(directory, model2, opt2)["step"] == 3      # torch.load's way
    assert COMM.allgather(len(reads)) == [1] * SIZE
    opt2.finish()
    with pytest.raises(CheckpointError) as err:
        hpcasync.load_checkpoint(directory, nn.Linear(2, 2), comm=COMM)
    assert len(set(COMM.allgather(str(err.value)))) == 1 and "model" in str(err.value), \
        str(err.value)


def _persisted(algorithm, data, seed, **kw):
    """A model, ``hpcasync.optimizer(algorithm)``, an ElasticSampler and their State (``steps``)."""
    from hpcasync.data.sharding import ElasticSampler

    model = make_model(seed)
    opt = hpcasync.optimizer(algorithm, model, torch.optim.SGD(model.parameters(), lr=0.05,
                                                               momentum=0.9), **kw)
    sampler = ElasticSampler(data, batch_size=16, rank=RANK, num_replicas=SIZE, seed=1)
    return model, opt, sampler, hpcasync.elastic.State(model=model, optimizer=opt,
                                                       sampler=sampler, epoch=0, steps=0)


def _steps(data, model, opt, sampler, state, commit: bool = True):
    """One step on the sampler's next batch (and a commit)."""
    idx = list(sampler)[:16]
    opt.zero_grad()
    F.cross_entropy(model(data.images[idx]), data.labels[idx]).backward()
    opt.step()
    sampler.record_batch()
    state.steps += 1
    if commit:
        state.commit()


@needs4
def test_an_elastic_states_commits_persist_and_a_new_state_loads_the_newest(data,
                                                                          tmp_path_factory,
                                                                          monkeypatch):
    """``State.persist(DIR, every=2)``: rank 0 writes every 2nd commit (numbered by the commit
    count); a state built afresh (other initial weights) loads the newest on every rank: model,
    optimizer (momentum), sampler position, plain values, and the commit count, so that its next
    checkpoints sort after it; rank 0 alone reads the file (once), the others get it broadcast.
    Bad calls are one-line errors, a commit of another model on every rank."""
    from pathlib import Path

    import hpcasync.checkpoint as ckpt
    from hpcasync.checkpoint import CheckpointError

    reads: list = []
    real_read = ckpt.read_checkpoint
    monkeypatch.setattr(ckpt, "read_checkpoint",
                        lambda path, **kw: reads.append(path) or real_read(path, **kw))

    directory = COMM.bcast(str(tmp_path_factory.mktemp("persist")) if RANK == 0 else None)

    def make(seed):
        return _persisted("ssgd", data, seed)

    model, opt, sampler, state = make(0)
    assert state.persist(directory, every=2) is False           # nothing there yet
    for s in range(5):
        _steps(data, model, opt, sampler, state)
        if s == 3:                                              # the 4th commit: written
            want = (digest(model), [v["momentum_buffer"].clone()
                                    for v in opt.state_dict()["state"].values()],
                    sampler.state_dict())
    COMM.Barrier()
    names = sorted(p.name for p in Path(directory).glob("ckpt-*.pt"))
    assert names == ["ckpt-e0000-s00000002.pt", "ckpt-e0000-s00000004.pt"], names

    model2, opt2, sampler2, state2 = make(1)
    assert digest(model2) != want[0]
    reads.clear()
    assert state2.persist(directory, every=2) is True
    assert COMM.allgather(len(reads)) == [1] + [0] * (SIZE - 1)     # one read, on rank 0
    assert (state2.steps, state2.epoch, digest(model2), sampler2.state_dict()) == \
        (4, 0, want[0], want[2])
    got = [v["momentum_buffer"] for v in opt2.state_dict()["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(got, want[1])) and len(got) == len(want[1])
    state2.commit(), state2.commit()                            # commits 5 and 6: 6 written
    COMM.Barrier()
    newest = hpcasync.checkpoint.latest_checkpoint(directory)
    assert newest.name == "ckpt-e0000-s00000006.pt", newest
    with pytest.raises(ConfigError, match="every must be a whole number"):
        state2.persist(directory, every=0)
    other = hpcasync.elastic.State(model=model2, optimizer=opt2, epoch=0)    # no sampler
    with pytest.raises(ConfigError, match="is not a commit of this state"):
        other.persist(directory)
    linear = torch.nn.Linear(3, 2)
    foreign = hpcasync.elastic.State(model=linear, epoch=0)
    with pytest.raises(CheckpointError, match=r"s00000006.pt: \w+ is '\w+', this run has "):
        foreign.persist(directory)


def test_a_commit_inside_an_accumulation_is_said_once(caplog):
    """SSGD with ``backward_passes_per_step=2``: a commit after the first backward pass (a
    commit holds no gradient: a death would redo that step without it) is one warning line on
    rank 0, once; commits after ``step()`` say nothing."""
    import logging

    from hpcasync.runtime.elastic import TorchState

    TorchState._said_mid_step = False
    model = make_model(0)
    opt = hpcasync.optimizer("ssgd", model, torch.optim.SGD(model.parameters(), lr=0.05),
                             backward_passes_per_step=2)
    state = hpcasync.elastic.State(model=model, optimizer=opt, steps=0)
    said = []
    with caplog.at_level(logging.WARNING, logger="hpcasync"):
        for passes in ([], [1], [1, 2]):    # commit after these passes of each step
            opt.zero_grad()
            for n in (1, 2):
                model(torch.ones(4, 1, 28, 28)).sum().backward()
                if n in passes:
                    state.commit()
            opt.step()
            state.commit()
            said.append(sum("backward passes of a step" in r.getMessage()
                            for r in caplog.records))
    assert said == ([0, 1, 1] if RANK == 0 else [0, 0, 0]), said
    assert opt.passes_pending() == 0
    TorchState._said_mid_step = False


def test_run_syncs_rank0s_state_first_and_restore_is_the_commit_bitwise():
    """``hpcasync.elastic.run`` in this job's world (no death, no ULFM; the deaths:
    reliability/test_loop_elastic.py): ``run`` starts from rank 0's model, optimizer, sampler
    position and values on every rank; ``restore()`` brings the commit back bitwise."""
    import hpcasync

    torch.manual_seed(RANK)                          # every rank a different model
    model = torch.nn.Linear(5, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = hpcasync.elastic.ElasticSampler(384, batch_size=16, rank=COMM.Get_rank(),
                                              num_replicas=COMM.Get_size(), seed=1)
    sampler.set_epoch(RANK)
    state = hpcasync.elastic.State(model=model, optimizer=sgd, sampler=sampler, epoch=RANK,
                                   batch=0)
    seen = []

    @hpcasync.elastic.run
    def train(state):
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        seen.append((COMM.allgather(flat.numpy().tobytes()), COMM.allgather(state.epoch),
                     COMM.allgather(state.sampler.epoch), state.rank, state.size))
        model(torch.ones(2, 5)).sum().backward()
        sgd.step()
        state.sampler.record_batch()
        state.commit()
        committed = [p.detach().clone() for p in model.parameters()]
        momentum = [sgd.state[p]["momentum_buffer"].clone() for p in model.parameters()]
        sgd.step()
        state.sampler.record_batch()
        state.batch = 9
        state.restore()
        assert state.batch == 0 and state.sampler.processed == 16 * COMM.Get_size()
        assert all(torch.equal(p, c) for p, c in zip(model.parameters(), committed))
        assert all(torch.equal(sgd.state[p]["momentum_buffer"], m)
                   for p, m in zip(model.parameters(), momentum))
        return "done"

    assert train(state) == "done"
    params, epochs, sampler_epochs, rank, size = seen[0]
    assert len(set(params)) == 1 and set(epochs) == {0} and set(sampler_epochs) == {0}
    assert (rank, size) == (COMM.Get_rank(), COMM.Get_size())


@needs4
def test_persist_gives_each_rank_its_own_commit_where_its_state_is_its_own(data,
                                                                          tmp_path_factory):
    """Local SGD between two averages (each replica its own): ``persist`` writes every rank's
    commit (rank 0's in DIR, the others' in DIR/rank-R); a fresh state on as many ranks loads
    each rank's own, the first sync keeps it, and two more steps give what the undisturbed
    states gave, bitwise. With one rank's newest own file gone, every rank loads its own of the
    commit before (the later files are removed); with all of one rank's gone, every rank goes
    on from rank 0's."""
    from pathlib import Path

    directory = COMM.bcast(str(tmp_path_factory.mktemp("persist_own")) if RANK == 0 else None)
    own = Path(directory) / (f"rank-{RANK}" if RANK else "")

    def make(seed):
        return _persisted("localsgd", data, seed, period=8, warmup_steps=0)

    def train(model, opt, sampler, state, n, commit):
        for _ in range(n):
            _steps(data, model, opt, sampler, state, commit)

    model, opt, sampler, state = make(0)
    state.persist(directory)
    committed = []
    for _ in range(3):                                          # commits 1-3: replicas differ
        train(model, opt, sampler, state, 1, commit=True)
        committed.append(COMM.allgather(digest(model)))
    assert len(set(committed[-1])) == SIZE
    train(model, opt, sampler, state, 2, commit=False)
    want = digest(model)
    COMM.Barrier()
    assert (own / "ckpt-e0000-s00000003.pt").is_file()

    model2, opt2, sampler2, state2 = make(1)
    assert state2.persist(directory) is True
    state2.sync()                                               # (the elastic loop's first)
    assert digest(model2) == committed[2][RANK] and state2.steps == 3
    train(model2, opt2, sampler2, state2, 2, commit=False)
    assert digest(model2) == want                               # as if never restarted

    COMM.Barrier()
    if RANK == 1:                                               # it died before writing 3
        (own / "ckpt-e0000-s00000003.pt").unlink()
    COMM.Barrier()
    model3, _, _, state3 = make(2)
    assert state3.persist(directory) is True
    state3.sync()
    assert digest(model3) == committed[1][RANK] and state3.steps == 2
    assert not (own / "ckpt-e0000-s00000003.pt").exists()       # the later commit removed

    COMM.Barrier()
    if RANK == 1:
        for f in own.iterdir():
            f.unlink()
    COMM.Barrier()
    model4, _, _, state4 = make(3)
    assert state4.persist(directory) is True
    state4.sync()
    assert digest(model4) == committed[1][0]                    # rank 0's on every rank


@needs4
def test_metrics_stream_from_a_user_loop(tmp_path_factory):
    from hpcasync.metrics import read_metrics

    path = COMM.bcast(str(tmp_path_factory.mktemp("m") / "run.jsonl") if RANK == 0 else None)
    with hpcasync.open_metrics(path) as m:
        m.write("epoch", epoch=1, test_accuracy=0.5, rank=RANK)
    COMM.Barrier()
    if RANK == 0:
        records = read_metrics(path)
        assert [r["rank"] for r in records if r["event"] == "epoch"] == [0]   # rank 0 alone


def test_unknown_algorithm_and_missing_pieces_are_one_line_errors():
    model = make_model()
    with pytest.raises(ConfigError, match="unknown algorithm 'sgdx'"):
        hpcasync.optimizer("sgdx", model)
    with pytest.raises(ConfigError, match="runs your torch optimizer"):
        hpcasync.optimizer("ssgd", model)
    with pytest.raises(ConfigError, match="epochs=... and steps_per_epoch"):
        hpcasync.optimizer("daso", model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="runs its own update"):
        hpcasync.optimizer("asgd", model, torch.optim.Adam(model.parameters()))
    assert len(hpcasync.algorithms()) == 20


@pytest.mark.parametrize("alg", ["ssgd", "daso", "odsgd", "localsgd", "asgd", "smega2"])
def test_a_model_not_in_float32_is_a_one_line_error_not_a_silent_cast(alg):
    """The flat buffer is float32: a float64 (or bfloat16) model is refused on every rank, and
    left as it was, where it would have been trained in float32 and left float32."""
    for dtype in (torch.float64, torch.bfloat16):
        model = make_model().to(dtype)
        kw = ({"epochs": 1, "steps_per_epoch": 2} if alg == "daso" else {})
        with pytest.raises(ConfigError, match=f"parameter .* is {str(dtype)[6:]}.*model.float"):
            if alg in ("asgd", "smega2"):
                hpcasync.optimizer(alg, model, lr=0.1, warmup_epochs=0)
            else:
                hpcasync.optimizer(alg, model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
        assert {p.dtype for p in model.parameters()} == {dtype}


@pytest.mark.parametrize("alg", ["daso", "odsgd", "localsgd", "diloco"])
def test_a_grad_scaler_on_a_family_whose_ranks_step_alone_is_a_one_line_error(alg):
    """GradScaler would skip a step on the rank that saw an inf only: these families refuse it
    on every rank at the first scaler.step (ssgd handles it: test_ssgd_torch_parity.py)."""
    model = make_model()
    kw = {"epochs": 1, "steps_per_epoch": 2} if alg == "daso" else {}
    opt = hpcasync.optimizer(alg, model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    scaler = torch.amp.GradScaler("cpu")
    opt.zero_grad()
    scaler.scale(model(torch.randn(4, 1, 28, 28)).sum()).backward()
    with pytest.raises(ConfigError, match=f"{alg}: torch.amp.GradScaler is not supported"):
        scaler.step(opt)


def _two_groups_run(data, alg, late: bool):
    """Three steps with the model's two parts in two param groups (the second at another lr),
    given at construction or added after it (``late``); returns the flat parameters."""
    model = make_model()
    first = [p for n, p in model.named_parameters() if not n.startswith("fc")]
    second = [p for n, p in model.named_parameters() if n.startswith("fc")]
    groups = [{"params": first}] + ([] if late else [{"params": second, "lr": 0.02}])
    kw = ({"epochs": 1, "steps_per_epoch": 3, "warmup_epochs": 0, "cooldown_epochs": 0}
          if alg == "daso" else {})
    opt = hpcasync.optimizer(alg, model, torch.optim.SGD(groups, lr=0.05, momentum=0.9), **kw)
    if late:
        opt.add_param_group({"params": second, "lr": 0.02})
    for step in range(3):
        x, y = batch(data, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("alg", ["ssgd", "daso", "odsgd"])
def test_a_param_group_added_after_the_optimizer_trains_as_one_given_at_its_start(data, alg):
    """``opt.add_param_group`` of model parameters (fine-tuning: a layer outside the optimizer,
    added later) trains them exactly as a group given at construction; a group of tensors that
    are not the model's is a one-line error on every rank (each rank would train them alone)."""
    late, early = _two_groups_run(data, alg, True), _two_groups_run(data, alg, False)
    assert torch.equal(late, early), (late - early).abs().max()
    model = make_model()
    kw = {"epochs": 1, "steps_per_epoch": 3} if alg == "daso" else {}
    opt = hpcasync.optimizer(alg, model, torch.optim.SGD(model.parameters(), lr=0.05), **kw)
    with pytest.raises(ConfigError, match=f"{alg}: add_param_group got 2 tensor.*not parameters"):
        opt.add_param_group({"params": list(nn.Linear(2, 2).parameters())})


@needs4
def test_a_parameter_server_refuses_a_param_group_added_after_its_set_up():
    model = make_model()
    opt = hpcasync.optimizer("asgd", model, torch.optim.SGD(model.parameters(), lr=0.05))
    with pytest.raises(ConfigError, match="asgd: add_param_group after hpcasync.optimizer"):
        opt.add_param_group({"params": [model.fc.weight]})
    with pytest.raises(ConfigError, match="asgd: add_param_group got 2 tensor"):
        opt.add_param_group({"params": list(nn.Linear(2, 2).parameters())})
    if opt.is_server:
        opt.serve()
    else:
        opt.finish()


@needs4
def test_checkpoint_of_daso_from_a_user_loop(data, tmp_path_factory):
    """DASO's ``comm`` is its own layer: save_checkpoint must find the world communicator."""
    from hpcasync.topology import Topology

    topo = Topology.build(ranks_per_node=2)
    directory = COMM.bcast(str(tmp_path_factory.mktemp("dck")) if RANK == 0 else None)
    model = make_model()
    opt = hpcasync.optimizer("daso", model, torch.optim.SGD(model.parameters(), lr=0.05),
                             epochs=1, steps_per_epoch=2, warmup_epochs=0, cooldown_epochs=0,
                             topo=topo)
    for s in range(2):
        opt.zero_grad()
        x, y = batch(data, s)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.epoch_end(1.0)
    path = hpcasync.save_checkpoint(directory, model, opt, epoch=1)
    assert (path is not None) == (RANK == 0)
    again = make_model()
    opt2 = hpcasync.optimizer("daso", again, torch.optim.SGD(again.parameters(), lr=0.5),
                              epochs=1, steps_per_epoch=2, warmup_epochs=0, cooldown_epochs=0,
                              topo=topo)
    assert hpcasync.load_checkpoint(directory, again, opt2)["epoch"] == 1
    assert digest(again) == digest(model) and opt2.lr() == pytest.approx(0.05)
    topo.free()


@pytest.mark.parametrize("algorithm, kw, line", [
    ("ssgd", {"period": 3}, "ssgd takes no period (its keywords: backward_passes_per_step, "),
    ("localsgd", {"overlap": True}, "localsgd takes no overlap (its keywords: period, "),
    ("daso", {"epochs": 1, "steps_per_epoch": 2, "compress": "bf16"},
     "daso takes no compress (its keywords: epochs, steps_per_epoch, sampler, "),
    ("odsgd", {"period": 2}, "odsgd takes no period (its keywords: lr, momentum, "),
    # the run's length by the names users pass (DASO said its internal total_epochs; OD-SGD
    # and the parameter server took epochs=0)
    ("daso", {"epochs": 0, "steps_per_epoch": 2}, "daso: epochs must be a positive integer, "
                                                  "got 0"),
    ("odsgd", {"epochs": 0, "steps_per_epoch": 2}, "odsgd: epochs must be a positive integer"),
    ("asgd", {"epochs": 1, "steps_per_epoch": 2.5}, "asgd: steps_per_epoch must be a positive "
                                                    "integer, got 2.5"),
])
def test_a_keyword_the_algorithm_does_not_take_is_one_line(algorithm, kw, line):
    """``hpcasync.optimizer(..., unknown=...)``: one line naming the algorithm's keywords (DASO's
    by the names users pass), on every rank, before any collective (DASO and OD-SGD raised
    Python's TypeError naming their internal constructor)."""
    model = make_model()
    with pytest.raises(ConfigError) as err:
        hpcasync.optimizer(algorithm, model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    assert str(err.value).startswith(line), str(err.value)
