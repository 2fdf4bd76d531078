"""Helpers for tests that run under ``mpiexec -n 4 python -m mpi4py -m pytest``.

Every rank runs the same tests in the same order. Collective tests use ``COMM``; tests that launch
their own MPI job (the CLI end to end, crash and bad-input checks) run on rank 0 only through
:func:`run_mpi`, while the other ranks wait without spinning (``idle_barrier``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from mpi4py import MPI

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
SIZE = COMM.Get_size()
REPO = Path(__file__).resolve().parent.parent

# Variables through which a launcher hands a job to its processes: a nested mpiexec must not see
# its parent's, or it would try to join the parent's job.
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "OPAL_", "HWLOC_", "SLURM_")


def idle_barrier(comm=COMM, poll: float = 0.002) -> None:
    """A barrier that sleeps between polls: 4 ranks on 2 cores must not burn CPU while waiting."""
    idle_wait(comm.Ibarrier(), poll=poll)


def idle_wait(request, timeout: float | None = None, poll: float = 0.002) -> bool:
    """Wait for a non-blocking MPI request, sleeping between polls; False if ``timeout`` seconds
    passed first (the request is then still pending)."""
    end = None if timeout is None else time.monotonic() + timeout
    while not request.Test():
        if end is not None and time.monotonic() > end:
            return False
        time.sleep(poll)
    return True


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1", PYTHONUNBUFFERED="1")
    env.setdefault("PYTHONPATH", str(REPO))
    env.update(extra)
    return env


def mpiexec() -> str:
    """The mpiexec that belongs to this Python's MPI (the venv's Open MPI, else the PATH's)."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def run_mpi(n: int, args: list[str], *, timeout: float = 300, cwd=None, env=None,
            ) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python -m hpcasync.cli ARGS`` (or a raw command when args[0] is '--')."""
    if args and args[0] == "--":
        cmd = args[1:]
    else:
        cmd = [sys.executable, "-m", "hpcasync.cli", *args]
    full = [mpiexec(), "--oversubscribe", "-n", str(n), *cmd]
    return subprocess.run(full, env=env or clean_env(), cwd=cwd or REPO, capture_output=True,
                          text=True, timeout=timeout)


def run_cli(args: list[str], *, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
    """Run ``python -m hpcasync.cli ARGS`` as a singleton (no mpiexec)."""
    return subprocess.run([sys.executable, "-m", "hpcasync.cli", *args], env=env or clean_env(),
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def last_summary(path) -> dict:
    """The last ``summary`` record of a metrics stream."""
    from hpcasync.metrics import read_metrics

    return [r for r in read_metrics(path) if r["event"] == "summary"][-1]


def wait_for(predicate, timeout: float, what: str, poll: float = 0.1) -> None:
    """Poll ``predicate`` until it is true; AssertionError naming ``what`` after ``timeout`` s."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if predicate():
            return
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


#: CI (and ``HPCASYNC_HOROVOD=1 bash scripts/test.sh``) builds Horovod: then its tests must run, and a
#: Horovod that does not import fails them instead of skipping them.
HOROVOD_REQUIRED = os.environ.get("HPCASYNC_HOROVOD") == "1"


def _horovod_import_error() -> str | None:
    try:
        import horovod.torch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - an ImportError, or a broken build's OSError
        return f"{type(exc).__name__}: {exc}"
    return None


#: None when ``horovod.torch`` imports (decided on rank 0, the same answer on every rank)
HOROVOD_ERROR = COMM.bcast(_horovod_import_error() if RANK == 0 else None, root=0)


def need_horovod() -> None:
    """At the top of a test that compares against Horovod: skip when it is not installed, but fail
    when this run was asked to have it (``HPCASYNC_HOROVOD=1``, as CI sets)."""
    import pytest

    if HOROVOD_ERROR is None:
        return
    if HOROVOD_REQUIRED:
        pytest.fail(f"HPCASYNC_HOROVOD=1 (Horovod was to be built) but horovod.torch does not "
                    f"import: {HOROVOD_ERROR}")
    pytest.skip("Horovod is not installed (scripts/install-horovod.sh)")
