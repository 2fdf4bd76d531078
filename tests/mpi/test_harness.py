"""The MPI test harness itself (tests/conftest.py): a failure on any rank, or a hang, ends the job
quickly with a message that names the rank and the test, instead of deadlocking until CI's limit.

Each test runs a tiny suite from tests/harness/ (files named case_*.py, so the main suite does not
collect them) as its own 4-rank job, under this repository's conftest."""
from __future__ import annotations

import sys
import time

import pytest

from tests.mpi_util import REPO, clean_env, run_mpi

CASES = REPO / "tests" / "harness"


def _suite(case: str, *, timeout: float = 120, **env: str):
    """Run tests/harness/CASE under ``mpiexec -n 4 python -m mpi4py -m pytest``: (process, seconds
    it took, stdout + stderr)."""
    t0 = time.monotonic()
    proc = run_mpi(4, ["--", sys.executable, "-m", "mpi4py", "-m", "pytest", "-q",
                       "--color=no", "-p", "no:cacheprovider", str(CASES / case)],
                   timeout=timeout, env=clean_env(OMPI_MCA_osc="^ucx", **env))
    return proc, time.monotonic() - t0, proc.stdout + proc.stderr


@pytest.mark.rank0
def test_one_rank_failing_before_a_collective_ends_the_job_within_seconds():
    # Before the harness agreed on outcomes this hung until pytest-timeout's 600 s, silently.
    # the failing rank's wait for the others: 1 s instead of the default 5 (the same path, a
    # shorter wait)
    proc, took, out = _suite("case_one_rank_fails_before_collective.py", timeout=90,
                             HPCASYNC_TEST_AGREE_TIMEOUT="1")
    assert proc.returncode != 0, out
    assert took < 60, f"took {took:.1f} s\n{out}"
    assert "[rank 2]" in out, out
    assert "test_rank2_fails_before_barrier" in out, out
    assert "rank 2 disagrees before the barrier" in out, out   # the assertion message
    assert "case_one_rank_fails_before_collective.py:6" in out, out  # and its traceback
    assert "test_never_reached" not in out, out


@pytest.mark.rank0
def test_one_rank_failing_alone_is_reported_by_rank0_and_the_suite_goes_on():
    proc, _, out = _suite("case_one_rank_fails_no_collective.py")
    assert proc.returncode != 0, out
    assert "1 failed, 1 passed" in out, out
    assert "FAILED tests/harness/case_one_rank_fails_no_collective.py::test_rank1_fails_alone" \
        in out, out
    assert "only rank 1 fails this one" in out, out
    assert "failed on rank 1, passed on 0, 2, 3" in out, out


@pytest.mark.rank0
def test_a_failure_on_every_rank_is_an_ordinary_failure():
    proc, _, out = _suite("case_all_ranks_fail.py")
    assert proc.returncode == 1, out
    assert "every rank fails here" in out, out
    assert "1 failed, 1 passed" in out, out
    assert "FAILED tests/harness/case_all_ranks_fail.py::test_every_rank_fails" in out, out
    assert "Ending the job" not in out and "TIMEOUT" not in out, out


@pytest.mark.rank0
def test_a_hang_ends_the_job_naming_the_test():
    proc, took, out = _suite("case_hang.py", timeout=90, HPCASYNC_TEST_TIMEOUT_PER_TEST="2")
    assert proc.returncode != 0, out
    assert took < 30, f"took {took:.1f} s\n{out}"
    for rank in range(4):
        assert f"[rank {rank}] ======== TIMEOUT tests/harness/case_hang.py::test_deadlocks" \
            in out, out
    assert "time.sleep(1000)" in out, out            # rank 0's stack
    assert "test_never_reached" not in out, out


@pytest.mark.rank0
def test_a_passing_suite_exits_0():
    proc, _, out = _suite("case_all_pass.py")
    assert proc.returncode == 0, out
    assert "4 passed, 1 skipped" in out, out
