"""What a resumed run must not forget (issue 15, carry-overs): the workers that died before the
checkpoint (``failed_workers``, marked ``before_resume``) and the divergence guard's reference
(its window, best mean and first loss), which a fresh guard would rebuild from the resumed, lower
losses only."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

from hpcasync.checkpoint import load_checkpoint
from tests.mpi_util import REPO, clean_env, last_summary, mpiexec, need_ulfm

MINI = ["train", "--dataset", "fashion-mnist-mini", "--train-limit", "2048", "--test-limit",
        "500", "--progress", "off"]


@pytest.mark.rank0
@pytest.mark.one_mpi       # MPICH: a resume's MPI path is test_worker_failure's
def test_a_resumed_ssgd_run_keeps_the_divergence_reference(tmp_path):
    """The checkpoint holds rank 0's guard; resuming with a loss far above the saved best but
    below 3x a fresh guard's first value diverges at once (a fresh guard would not notice)."""
    ck = tmp_path / "ck"
    cmd = [*mpiexec(2), sys.executable, "-m", "hpcasync.cli", *MINI, "--algorithm", "ssgd",
           "--epochs", "1", "--checkpoint-dir", str(ck)]
    out = subprocess.run(cmd, env=clean_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    [path] = sorted(ck.glob("ckpt-e0001-*.pt"))
    state = load_checkpoint(path)
    d = state["divergence"]
    assert d["seen"] == 2048 // 2 // 32 and math.isfinite(d["best"]) and d["best"] < d["first"]
    from hpcasync.runtime.context import RunContext   # resume_state() loads it into ctx
    from types import SimpleNamespace

    from mpi4py import MPI

    from hpcasync.checkpoint import CheckpointManager
    from hpcasync.metrics import MetricsWriter
    from hpcasync.runtime.context import Progress
    cfg = SimpleNamespace(resume=str(path), algorithm="ssgd", model="lenet",
                          divergence_factor=3.0)
    ctx = RunContext(cfg=cfg, topo=SimpleNamespace(rank=0, size=2, world=MPI.COMM_SELF),
                     train=None, test=None, make_model=None,
                     metrics=MetricsWriter(None, enabled=False), progress=Progress(False),
                     checkpoints=CheckpointManager(ck))
    ctx.resume_state()
    assert (ctx.divergence.best, ctx.divergence.first, ctx.divergence.seen) == \
        (d["best"], d["first"], d["seen"])


@pytest.mark.rank0
@pytest.mark.one_mpi       # MPICH: a resume's MPI path is test_worker_failure's
def test_failed_workers_are_kept_across_a_resume(tmp_path):
    """asgd under ULFM: worker 2 (rank 3) dies at its push 10 of epoch 1; the epoch-1 checkpoint
    holds the failure; a run resumed from it (every worker alive again) lists it, marked
    ``before_resume``, in its summary."""
    need_ulfm()
    ck, m1, m2 = tmp_path / "ck", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    args = [sys.executable, "-m", "hpcasync.cli", *MINI, "--algorithm", "asgd", "--epochs", "2",
            "--checkpoint-dir", str(ck)]
    out = subprocess.run([*mpiexec(4, ft=True), *args, "--metrics", str(m1)],
                         env=clean_env(HPCASYNC_INJECT_KILL="3:10"), cwd=REPO,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    [dead] = last_summary(m1)["failed_workers"]
    [path] = sorted(ck.glob("ckpt-e0001-*.pt"))
    assert [f["rank"] for f in load_checkpoint(path)["ps"]["failed_workers"]] == [3]
    out = subprocess.run([*mpiexec(4, ft=True), *args, "--metrics", str(m2), "--resume",
                          str(path)], env=clean_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    [kept] = last_summary(m2)["failed_workers"]
    assert kept == {**dead, "before_resume": True}
