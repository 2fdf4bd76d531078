"""PS checkpoints from a user's loop, and the workers' communicator (issue 21 items 5 and 7).

Run with 3+ ranks (rank 0 serves, the others are workers; the suite runs it at 4)::

    mpiexec -n 4 python -m mpi4py -m pytest -q tests/mpi/test_ps_user_checkpoint.py

Every rank calls ``hpcasync.save_checkpoint`` as in a synchronous loop (the workers at their
epoch end; the server is inside ``serve()``); a fresh ``ParameterServer`` loads the file: the
server's θ, rule state (bitwise), version and clock are the saved ones, each worker gets its
position, buffers and (shat, shat-root, ensemble) its own model; a resumed run continues the
version, the push count and the warm-up factor.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hpcasync
from hpcasync.errors import ConfigError
from hpcasync.rules import RULES, ps_lr_factor
from tests.mpi_util import COMM, RANK, SIZE

pytestmark = pytest.mark.skipif(SIZE < 3, reason="needs 3+ ranks (1 server + 2+ workers)")

W = SIZE - 1
SPE = 4                     # steps per epoch per worker: an epoch is W * SPE pushes
WARMUP = 2                  # epochs of lr warm-up, for every rule (a factor that moves)
LR = 0.05
#: rules whose version moves only when θ does (a gradient dropped or held for a batch keeps it)
DROPPING = ("rennala", "ringmaster")


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def batch(worker: int, step: int):
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)


def make_opt(algorithm, model):
    return hpcasync.ParameterServer(model, algorithm, lr=LR, comm=COMM, ps_rank=0,
                                    steps_per_epoch=SPE, warmup_epochs=WARMUP)


def train(opt, model, first: int, steps: int):
    for s in range(first, first + steps):
        x, y = batch(opt.worker, s)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step(loss=loss)


def same(a, b, where=""):
    """Bitwise equality of nested state (tensors, numbers, lists, dicts)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b))
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), (where, a, b)


@pytest.mark.parametrize("algorithm", list(RULES))
def test_user_loop_checkpoint_round_trip_and_resume(algorithm, tmp_path):
    directory = COMM.bcast(str(tmp_path / "ck") if RANK == 0 else None, root=0)
    first_steps, more = 5, 2

    # -- run 1: every rank calls save_checkpoint; the workers at their "epoch end" -------------
    model = make_model()
    opt = make_opt(algorithm, model)
    saved: dict = {}
    if opt.is_server:
        opt.serve()
        # the workers finish right after asking, so the final state is the saved one
        saved = {"rule": opt.rule.state_dict(), "version": opt.rule.version,
                 "clock": opt.server.state_dict(), "theta": opt.rule.theta.clone()}
        hpcasync.save_checkpoint(directory, model, opt, epoch=1)    # the label is complete
    else:
        train(opt, model, 0, first_steps)
        assert hpcasync.save_checkpoint(directory, model, opt, epoch=1, note="mine") is None
        saved = {"buffers": opt.flat.buffers.clone(), "local": opt.local_model(),
                 "steps": opt.steps, "lr": opt.lr()}
        opt.finish()
    COMM.Barrier()

    # -- a fresh optimizer loads it -------------------------------------------------------------
    model2 = make_model()
    opt2 = make_opt(algorithm, model2)
    found = hpcasync.load_checkpoint(directory, model2, opt2)
    assert found is not None and found["epoch"] == 1 and found["step"] == 0
    if opt2.is_server:
        same(opt2.rule.state_dict(), saved["rule"], "rule")
        assert opt2.rule.version == saved["version"]
        if algorithm not in DROPPING:                   # one version per push
            assert saved["version"] == W * first_steps
        assert torch.equal(opt2.flat.params.detach().cpu(), saved["theta"])
        accepted = saved["clock"]["stats"]["accepted"]
        assert accepted == W * first_steps
        opt2.serve()
        total = accepted + W * more
        server = opt2.server
        assert server.stats.accepted == total                     # the clock continued
        if algorithm not in DROPPING:
            assert opt2.rule.version == saved["version"] + W * more
        assert server.next_epoch == total // (W * SPE) + 1
        factor = ps_lr_factor(algorithm, W, WARMUP)
        assert opt2.rule.lr == pytest.approx(LR * factor((total - 1) / (W * SPE)), rel=1e-12)
        assert factor((total - 1) / (W * SPE)) != factor((W * more - 1) / (W * SPE))
    else:
        assert found["note"] == "mine"
        assert opt2.steps == saved["steps"] == first_steps
        assert torch.equal(opt2.flat.buffers, saved["buffers"])     # its own BatchNorm stats
        assert opt2.lr() == saved["lr"]
        if opt2.keeps_local:
            assert torch.equal(opt2.local_model(), saved["local"])  # its own model, not θ
        train(opt2, model2, first_steps, more)
        opt2.finish()


@pytest.mark.skipif(SIZE != 4, reason="servers 0 and 1, workers 2 and 3")
@pytest.mark.parametrize("algorithm", ["asgd", "smega2", "shat"])
def test_shard_servers_checkpoint_from_a_users_loop_round_trip_and_resume(algorithm, tmp_path):
    """``ps_ranks=2`` in a user's loop: every rank calls ``save_checkpoint``; each shard server
    writes its own file of the label (shard 0's in the directory with every worker's part, shard
    1's in ``shard-1/``); a fresh sharded optimizer loads each server's rule state (its slice of
    θ) bitwise, each worker its position, buffers and (shat) own model, and the clock goes on. A
    one-server optimizer refuses the file in one line on every rank."""
    from hpcasync.checkpoint import CheckpointError

    directory = COMM.bcast(str(tmp_path / "ck") if RANK == 0 else None, root=0)
    workers, first_steps, more = SIZE - 2, 5, 2

    def sharded(model):
        return hpcasync.ParameterServer(model, algorithm, lr=LR, comm=COMM, ps_rank=0,
                                        ps_ranks=2, steps_per_epoch=SPE, warmup_epochs=WARMUP)

    model = make_model()
    opt = sharded(model)
    if opt.is_server:
        opt.serve()
        # (the workers finished right after asking: the state written is the final one)
        saved = {"rule": opt.rule.state_dict(), "theta": opt.rule.theta.clone(),
                 "accepted": opt.server.stats.accepted}
        assert saved["accepted"] == workers * first_steps
    else:
        train(opt, model, 0, first_steps)
        assert hpcasync.save_checkpoint(directory, model, opt, epoch=1, note="mine") is None
        saved = {"buffers": opt.flat.buffers.clone(), "local": opt.local_model(),
                 "steps": opt.steps}
        opt.finish()
    COMM.Barrier()
    if RANK == 0:       # each server wrote its own file of the label, on the workers' requests
        from pathlib import Path

        names = [sorted(p.name for p in d.glob("ckpt-*.pt"))
                 for d in (Path(directory), Path(directory) / "shard-1")]
        assert names == [["ckpt-e0001-s00000000.pt"]] * 2, names

    model2 = make_model()
    opt2 = sharded(model2)
    found = hpcasync.load_checkpoint(directory, model2, opt2)
    assert found is not None and found["epoch"] == 1
    if opt2.is_server:
        same(opt2.rule.state_dict(), saved["rule"], f"shard {opt2.shard}'s rule")
        assert torch.equal(opt2.rule.theta, saved["theta"])
        opt2.serve()
        assert opt2.server.stats.accepted == saved["accepted"] + workers * more
    else:
        assert found["note"] == "mine"
        assert opt2.steps == saved["steps"] == first_steps
        assert torch.equal(opt2.flat.buffers, saved["buffers"])
        if opt2.keeps_local:
            assert torch.equal(opt2.local_model(), saved["local"])
        train(opt2, model2, first_steps, more)
        opt2.finish()
    COMM.Barrier()

    model3 = make_model()       # one server (rank 0), three workers: another cut, one line
    opt3 = make_opt(algorithm, model3)
    with pytest.raises(CheckpointError, match="written by 2 server ranks"):
        hpcasync.load_checkpoint(directory, model3, opt3)
    if opt3.is_server:
        opt3.serve()
    else:
        train(opt3, model3, 0, 1)
        opt3.finish()


def test_uneven_workers_and_an_early_finish_do_not_block_a_checkpoint(tmp_path):
    """Worker 0 trains 2 steps, asks for epoch 1 and finishes; every other worker trains 6, asks
    for epoch 1 then epoch 2. Both labels are written (epoch 2 with worker 0 marked finished);
    resumed, worker 0 has nothing left (finish() without a step must not hang the server), the
    others go on."""
    directory = COMM.bcast(str(tmp_path / "ck") if RANK == 0 else None, root=0)
    model = make_model()
    opt = make_opt("asgd", model)
    if opt.is_server:
        opt.serve()
    else:
        train(opt, model, 0, 2 if opt.worker == 0 else 6)
        hpcasync.save_checkpoint(directory, model, opt, epoch=1)
        if opt.worker >= 1:
            train(opt, model, 6, 2)
            hpcasync.save_checkpoint(directory, model, opt, epoch=2)
        opt.finish()
    COMM.Barrier()
    if RANK == 0:
        from hpcasync.checkpoint import CheckpointManager, load_checkpoint

        files = CheckpointManager(directory).checkpoints()
        assert [f.name for f in files] == ["ckpt-e0002-s00000000.pt", "ckpt-e0001-s00000000.pt"]
        parts = load_checkpoint(files[0])["ps"]["workers"]
        assert parts["0"]["finished"] and parts["0"]["epoch"] == 1 and parts["0"]["steps"] == 2
        for w in range(1, W):
            assert parts[str(w)]["epoch"] == 2 and parts[str(w)]["steps"] == 8
    model2 = make_model()
    opt2 = make_opt("asgd", model2)
    found = hpcasync.load_checkpoint(directory, model2, opt2)
    if opt2.is_server:
        opt2.serve()
        assert opt2.server.stats.accepted == 2 + (W - 1) * (8 + 1)
    elif opt2.worker == 0:
        assert found == {"epoch": 1, "step": 0, "finished": True}
        opt2.finish()
    else:
        assert found == {"epoch": 2, "step": 0}
        train(opt2, model2, 8, 1)
        opt2.finish()


def test_nothing_to_load_is_said_on_the_root_rank(tmp_path, caplog):
    directory = COMM.bcast(str(tmp_path / "none") if RANK == 0 else None, root=0)
    model = make_model()
    opt = make_opt("asgd", model)
    with caplog.at_level(logging.WARNING, logger="hpcasync"):
        assert hpcasync.load_checkpoint(directory, model, opt) is None
    said = [r.getMessage() for r in caplog.records if "no checkpoint in" in r.getMessage()]
    assert len(said) == (1 if RANK == 0 else 0), said          # the root rank (the server) says
    assert all(directory in line for line in said)
    if opt.is_server:
        opt.serve()
    else:
        train(opt, model, 0, 1)
        opt.finish()


def test_workers_average_a_metric_while_the_server_serves():
    """Evaluating inside a PS loop: the workers allreduce through ctx.workers_comm while the
    server is inside serve() (a world allreduce would wait for it forever)."""
    ctx = hpcasync.init("asgd", fail_fast=False)
    assert (ctx.workers_comm is None) == ctx.is_server
    model = make_model()
    opt = make_opt("asgd", model)
    if ctx.is_server:
        opt.serve()
        with pytest.raises(ConfigError, match="parameter server"):
            hpcasync.average_metric(1.0, ctx)
    else:
        assert ctx.workers_comm.Get_size() == W
        train(opt, model, 0, 2)
        mean = hpcasync.average_metric(float(ctx.rank), ctx)
        want = sum(range(1, SIZE)) / W
        assert mean == want
        t = torch.tensor([float(ctx.rank), 2.0 * ctx.rank])
        out = hpcasync.average_metric(t, ctx)
        assert torch.equal(t, torch.tensor([float(ctx.rank), 2.0 * ctx.rank]))   # not in place
        assert torch.allclose(out, torch.tensor([want, 2 * want]))
        train(opt, model, 2, 1)
        opt.finish()
    sync = hpcasync.init("ssgd", fail_fast=False)
    assert sync.workers_comm.Get_size() == SIZE
