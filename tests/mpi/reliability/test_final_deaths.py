"""A rank dies at the final gathers of a synchronous run (``mpirun --with-ft ulfm``, a real
SIGKILL at the kill phase ``final``): the survivors recover and finish, instead of hanging.

Found while building grow-back: mpi4py's object reductions (``comm.allreduce(x)``) ran point to
point on mpi4py's private duplicate of the world, which the recovery's revoke does not reach, so a
survivor waited there for one already in ``MPI_Comm_shrink`` (2 of 2 runs hung; with
``fast_reduce`` off they are an allgather on the world itself: hpcasync.topology)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.mpi_util import REPO, clean_env, last_summary, mpiexec, need_ulfm

ARGS = ["train", "--algorithm", "ssgd", "--dataset", "fashion-mnist-mini", "--train-limit", "1024",
        "--test-limit", "200", "--epochs", "1", "--batch-size", "32", "--progress", "off"]


@pytest.mark.rank0
@pytest.mark.timeout(150)
@pytest.mark.parametrize("algorithm", ["ssgd", "odsgd"])
def test_a_death_at_the_final_gathers_is_survived(tmp_path, algorithm):
    """OD-SGD: its ``finish()`` (the round in flight completed, the global model everywhere)
    runs inside the loop's ``try`` after the final gathers: the death at the gathers is reset,
    and the final step (gathers, then ``finish()``) runs again on the survivors."""
    need_ulfm()
    metrics = tmp_path / "m.jsonl"
    args = [*ARGS]
    args[args.index("ssgd")] = algorithm
    try:
        r = subprocess.run([*mpiexec(4, ft=True), sys.executable, "-m", "hpcasync", *args,
                            "--metrics", str(metrics)], cwd=REPO, capture_output=True, text=True,
                           env=clean_env(HPCASYNC_INJECT_KILL_AT="3:final:1"), timeout=90)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung after a death at the final gathers:\n{(exc.stderr or '')[-2000:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = last_summary(metrics)
    assert summary["world_size"] == 3 and summary["failed_ranks"] == [3], summary
    assert len(set(summary["replica_sha256"])) == 1, summary["replica_sha256"]
