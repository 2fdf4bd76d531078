"""Preemption of the parameter-server and OD-SGD runtimes; heterogeneity in the synchronous ones.

A signalled job (SIGUSR1 to mpiexec, or ``HPCASYNC_INJECT_SIGNAL=RANK:N``: one rank sends itself
SIGUSR1 at its N-th step / accepted push) checkpoints at a consistent point and stops (exit 75);
``--resume auto`` continues. PS runs: the resumed run does exactly the remaining work (every worker
its shard budget) from the saved θ, bitwise (async runs are not reproducible across wall-clock
interleavings: their accuracy is no exact check). OD-SGD: bitwise equal final parameters.
One test goes through the CLI (a real job, signalled from outside); the others run in-process in
the 4-rank pytest world, which spares the job start-ups.
"""
import signal
import subprocess
import sys
import time

import pytest
import torch

from hpcasync.checkpoint import read_checkpoint
from hpcasync.metrics import read_metrics
from hpcasync.rules import make_rule
from tests.mpi_util import (COMM, REPO, SIZE, assert_resumed_from, clean_env, last_summary,
                            mpiexec, run_mpi, wait_for)

MINI = ["--dataset", "fashion-mnist-mini", "--progress", "off"]
W = 3                                         # 4 ranks: PS + 3 workers


def _check_ps_checkpoint(path, algorithm, budget):
    """Exact properties of a PS stop checkpoint; returns its positions."""
    header, state = read_checkpoint(path, expect={"algorithm": algorithm, "world_size": 4})
    ps = state["ps"]
    positions, stats = ps["positions"], ps["stats"]
    assert state["kind"] == "stop" and header["step"] == stats["accepted"]
    assert stats["accepted"] + stats["rejected"] == sum(positions)   # one push per batch
    assert ps["rule"]["version"] == stats["accepted"]
    assert all(0 <= p <= budget for p in positions) and any(p < budget for p in positions)
    assert [bool(f) for f in ps["finished"]] == [p == budget for p in positions]
    rule = make_rule(algorithm, torch.zeros_like(ps["rule"]["theta"]), W, lr=0.05)
    rule.load_state_dict(ps["rule"])                                # rule state round trip
    assert torch.equal(rule.state_dict()["theta"], ps["rule"]["theta"])
    assert rule.version == ps["rule"]["version"]
    return positions


def _check_resumed(path, budget, resumed_from):
    s = last_summary(path)
    assert s["resumed_at_push"] == resumed_from
    assert s["pushes"] + s["rejected_pushes"] == W * budget          # the same total work
    assert s["pushes_per_worker"] == [budget] * W and s["rejected_pushes"] == 0
    assert [w["worker_steps"] for w in s["workers"]] == [budget] * W
    return s


# -- parameter server ------------------------------------------------------------------------------

PS_ARGS = ["train", "--algorithm", "dcasgd-a", *MINI, "--train-limit", "4096", "--test-limit",
           "1000", "--epochs", "3", "--seed", "7", "--push-delay", "10"]
PS_BUDGET = 3 * ((4096 // W) // 32)           # pushes per worker: 3 epochs x 42 batches


@pytest.mark.rank0
@pytest.mark.one_mpi       # MPICH: test_preemption.py's signal from outside, test_ps_signal_on_one_rank
def test_ps_signalled_from_outside_resumes_with_the_same_work_from_the_saved_theta(tmp_path):
    ckpt = tmp_path / "ckpt"
    partial = tmp_path / "a.jsonl.partial"
    cmd = [*mpiexec(4), sys.executable, "-m", "hpcasync.cli",
           *PS_ARGS, "--metrics", str(tmp_path / "a.jsonl"), "--checkpoint-dir", str(ckpt),
           "--checkpoint-every", "50"]
    job = subprocess.Popen(cmd, env=clean_env(), cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        # wait for epoch 1's checkpoint (written just after its epoch record), then signal
        wait_for(lambda: partial.exists() and '"kind": "epoch"' in partial.read_text(), 150,
                  "epoch 1's checkpoint")
        job.send_signal(signal.SIGUSR1)          # mpiexec forwards it to every rank
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 75, err[-3000:]
    records = read_metrics(partial)
    assert records[-1]["event"] == "preempted"
    saved = [r for r in records if r["event"] == "checkpoint"]
    kinds = [r["kind"] for r in saved]
    assert kinds[-1] == "stop" and "epoch" in kinds and "periodic" in kinds
    assert all(r["step"] % 50 == 0 for r in saved if r["kind"] == "periodic")
    stop = max(ckpt.glob("ckpt-*.pt"), key=lambda p: p.name)
    positions = _check_ps_checkpoint(stop, "dcasgd-a", PS_BUDGET)
    assert positions == saved[-1]["positions"]

    dump = tmp_path / "dump"
    resumed = run_mpi(4, [*PS_ARGS, "--metrics", str(tmp_path / "b.jsonl"), "--checkpoint-dir",
                          str(ckpt), "--resume", "auto"], timeout=200,
                      env=clean_env(HPCASYNC_DUMP_BUFFERS=str(dump)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_metrics(tmp_path / "b.jsonl")[1]["event"] == "resume"
    got = _check_resumed(tmp_path / "b.jsonl", PS_BUDGET, sum(positions))
    assert sorted(w["worker_start_step"] for w in got["workers"]) == sorted(positions)
    # the server went on from the stop checkpoint's θ at its version, bitwise (the rule's state
    # is a round trip above); an accuracy beside an uninterrupted run's says less: an async run's
    # push order follows the machine's timing
    assert_resumed_from(dump, read_checkpoint(stop)[1])
    assert got["test_accuracy"] >= 0.3, got         # it went on learning (chance: 0.1)


# -- in-process runs in the 4-rank pytest world (no job start-up): one rank signalled -------------

needs4 = pytest.mark.skipif(SIZE != 4, reason="needs the 4-rank MPI world")
SMALL_BUDGET = 3 * ((2048 // W) // 32)         # PS: pushes per worker (3 epochs x 21 batches)


def _ctx(tmp_path, algorithm, *, options=None, resume=False, checkpoint_every=0, ckpt=True,
         **over):
    """A RunContext like the driver's, checkpointing into rank 0's tmp_path (shared by all;
    ``ckpt=False``: no checkpoint directory)."""
    from hpcasync.checkpoint import CheckpointManager, PreemptionFlag
    from hpcasync.config import TrainConfig

    ckdir = COMM.bcast(str(tmp_path / "ckpt") if COMM.Get_rank() == 0 and ckpt else None, root=0)
    cfg = TrainConfig(algorithm=algorithm, dataset="fashion-mnist-mini", train_limit=2048,
                      test_limit=300, model="mlp", epochs=3, batch_size=32, progress="off",
                      checkpoint_dir=ckdir, resume="auto" if resume else None,
                      checkpoint_every=checkpoint_every, **over)
    cfg.options = {"hetero": "HO", "straggler": None, "compute_time": "fixed",
                   "push_delay": 0.0, "ps_transport": "rma", "ps_momentum": 0.0,
                   **(options or {})}
    return _context(cfg, checkpoints=CheckpointManager(ckdir, keep=50) if ckpt else None,
                    preempt=PreemptionFlag(), checkpoint_every=cfg.checkpoint_every)


def _context(cfg, **extra):
    """A RunContext for ``cfg`` on the pytest world, built as the driver builds it: the data set,
    a seeded model factory, no metrics file, no progress bar; ``extra`` sets the other fields."""
    from hpcasync.data import load_dataset
    from hpcasync.metrics import MetricsWriter
    from hpcasync.models import build_model
    from hpcasync.runtime.context import Progress, RunContext
    from hpcasync.topology import Topology

    train, test = load_dataset(cfg.dataset, train_limit=cfg.train_limit, test_limit=cfg.test_limit)

    def make_model():
        torch.manual_seed(cfg.seed)
        return build_model(cfg.model, train.input_shape, train.num_classes)
    return RunContext(cfg=cfg, topo=Topology.build(COMM), train=train, test=test,
                      make_model=make_model, metrics=MetricsWriter(None, enabled=False),
                      progress=Progress(False), **extra)


def _run(ctx, inject=None):
    """``runtime.run(ctx)``; with ``inject`` ("RANK:N") that rank signals itself (SIGUSR1) at its
    N-th step, and the run must stop (Preempted on every rank). Returns the result or None."""
    import os

    from hpcasync.runtime import runtime_module
    from hpcasync.runtime.context import Preempted

    if inject:
        os.environ["HPCASYNC_INJECT_SIGNAL"] = inject
    try:
        if inject:
            with pytest.raises(Preempted):
                runtime_module(ctx.cfg.algorithm).run(ctx)
            return None
        return runtime_module(ctx.cfg.algorithm).run(ctx)
    finally:
        os.environ.pop("HPCASYNC_INJECT_SIGNAL", None)
        ctx.preempt.restore()


def _latest(ctx):
    path = ctx.checkpoints.checkpoints()[0]
    return path, read_checkpoint(path)


@needs4
@pytest.mark.parametrize("algorithm, inject, options", [
    ("shat", "2:20", {}),                 # one worker (rank 2) is signalled mid-run
    ("asgd", "0:70", {}),                 # only the PS is signalled
    ("dana", "1:63", {"hetero": "HE1"}),  # a worker that has finished its budget (63 steps);
])                                        # resumed: finished workers sit the rest out
def test_ps_signal_on_one_rank(tmp_path, algorithm, inject, options):
    _run(_ctx(tmp_path, algorithm, options=options), inject)
    rank, n = (int(x) for x in inject.split(":"))
    ctx = _ctx(tmp_path, algorithm, options=options, resume=True)
    path, (header, _) = _latest(ctx)
    positions = _check_ps_checkpoint(path, algorithm, SMALL_BUDGET)
    if rank == 0:       # stopped at its n-th accepted push; each worker's next one was applied
        assert header["step"] == n + W and sum(positions) == n + W
    else:
        assert positions[rank - 1] == min(n + 1, SMALL_BUDGET)   # its next push was its last
    result = _run(ctx)
    s = result.summary
    assert s["resumed_at_push"] == sum(positions) and s["pushes"] == W * SMALL_BUDGET
    assert s["pushes_per_worker"] == [SMALL_BUDGET] * W
    assert [w["worker_steps"] for w in s["workers"]] == [SMALL_BUDGET] * W
    assert [w["worker_start_step"] for w in s["workers"]] == positions
    if COMM.Get_rank() == 0:
        assert [r["epoch"] for r in ctx.history] == list(range(header["epoch"], 4))


@needs4
def test_odsgd_preempted_mid_epoch_and_resumed_is_bitwise_equal(tmp_path):
    from hpcasync.train import params_digest

    over = {"seed": 3}
    opts = {"odsgd_warmup_iters": 20}
    want = params_digest(_run(_ctx(tmp_path, "odsgd", options=opts, ckpt=False, **over)).model)
    # rank 2 is signalled after step 25 (a round in flight, after warm-up); the ranks agree at
    # step 30 (every 10 steps), mid-epoch 2; periodic checkpoints every 7 steps complete rounds
    # early before that, which must not change the trajectory either
    ctx = _ctx(tmp_path, "odsgd", options=opts, checkpoint_every=7, **over)
    _run(ctx, "2:25")
    steps = sorted(int(p.name[-11:-3]) for p in ctx.checkpoints.checkpoints())
    assert steps == [7, 14, 16, 21, 28, 30]             # periodic, epoch 1's end, the stop
    path, (header, state) = _latest(ctx)
    assert header["step"] == 30 and (state["epoch"], state["batch"]) == (2, 30 - 16)
    locals_ = [row["local"] for row in state["locals"]]
    assert len(locals_) == 4 and not torch.equal(locals_[0], locals_[1])   # per-rank weights
    assert state["global"]["steps"] == 30 == state["global"]["rounds"]
    got = _run(_ctx(tmp_path, "odsgd", options=opts, resume=True, **over)).model
    assert params_digest(got) == want


# -- heterogeneity in the synchronous runtimes (in-process, any number of ranks) ------------------

def _sync_ctx(algorithm, hetero):
    from hpcasync.config import TrainConfig

    cfg = TrainConfig(algorithm=algorithm, dataset="fashion-mnist-mini", train_limit=512 * SIZE,
                      test_limit=100, model="lenet", epochs=1, batch_size=32, progress="off")
    cfg.options = {"hetero": hetero, "straggler": None, "compute_time": "fixed",
                   "push_delay": 0.0, "odsgd_warmup_iters": 2}
    return _context(cfg)


@pytest.mark.parametrize("algorithm", ["ssgd", "odsgd", "daso"])
def test_straggler_slows_every_rank_of_a_synchronous_run(algorithm):
    from hpcasync.runtime import runtime_module

    run = runtime_module(algorithm).run
    runs = {}
    for hetero in ("HO", "HO", "HE1"):         # the first run pays one-off set-up costs
        ctx = _sync_ctx(algorithm, hetero)
        t0 = time.perf_counter()
        result = run(ctx)
        runs[hetero] = (time.perf_counter() - t0, result.summary, ctx.history[-1])
    _, s_ho, _ = runs["HO"]
    t_he, s_he, rec = runs["HE1"]
    slow = SIZE - 1                                    # HE1: the last rank is 10x slower
    assert s_he["hetero"]["factors"] == {str(slow): 10.0} and s_ho["hetero"]["factors"] == {}
    assert all(x == 0 for i, x in enumerate(s_he["sleep_time_s"]) if i != slow)
    assert s_he["sleep_time_s"][slow] > 0 and s_ho["sleep_time_s"] == [0.0] * SIZE
    assert rec["sleep_time_max_s"] == pytest.approx(s_he["sleep_time_s"][slow], abs=1e-3)
    # everyone waits for the straggler: every rank's run takes at least the straggler's sleep.
    # (No comparison with the HO run's wall time: on a loaded 2-core box that is noise.)
    assert t_he >= s_he["sleep_time_s"][slow]
