"""pytest under MPI: every rank runs the suite; rank 0 alone prints the report, and failures on
other ranks are gathered to it and fail the run. A test that hangs is killed by pytest-timeout's
thread method, which exits the process, so mpiexec ends the whole job instead of deadlocking."""
from __future__ import annotations

import tempfile

import pytest

from tests.mpi_util import COMM, RANK, SIZE, idle_barrier

_failures: list[str] = []


def pytest_configure(config):
    # Each rank its own temp root: ranks sharing pytest's default one race on its cleanup.
    if config.option.basetemp is None and SIZE > 1:
        config.option.basetemp = tempfile.mkdtemp(prefix=f"hpcasync-pytest-r{RANK}-")
    config.addinivalue_line("markers", "rank0: runs on rank 0 only (launches its own MPI job)")
    config.addinivalue_line("markers", "slow: acceptance-size run")


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    config = session.config
    if RANK != 0:
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


@pytest.fixture(autouse=True)
def _ranks_in_step(request):
    """Start and end every test together, without spinning, so collectives line up."""
    idle_barrier(COMM)
    if request.node.get_closest_marker("rank0") and RANK != 0:
        yield
        idle_barrier(COMM)
        return
    yield
    idle_barrier(COMM)


def pytest_collection_modifyitems(config, items):
    # rank0 tests: the body runs on rank 0 only; other ranks record a pass-through.
    if RANK == 0:
        return
    for item in items:
        if item.get_closest_marker("rank0"):
            item.obj = _noop


def _noop(*args, **kwargs):
    return None


def pytest_runtest_logreport(report):
    if report.failed:
        _failures.append(f"{report.nodeid} [{report.when}]: {report.longreprtext.splitlines()[-1] if report.longreprtext else ''}")


def pytest_sessionfinish(session, exitstatus):
    if SIZE == 1:
        return
    idle_barrier(COMM)
    gathered = COMM.gather(_failures, root=0)
    others_failed = COMM.bcast(any(gathered[1:]) if RANK == 0 else None, root=0)
    if RANK == 0 and others_failed:
        for r, fails in enumerate(gathered):
            for line in fails if r else []:
                print(f"\n[rank {r}] FAILED {line}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif RANK != 0 and others_failed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
