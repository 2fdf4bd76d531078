"""pytest under MPI: ``mpiexec -n 4 python -m mpi4py -m pytest tests/mpi``.

tests/unit runs in one process (``python -m pytest tests/unit``): with one rank the machinery
below does nothing (no barrier, no agreement, no duplicate communicator), only the timeout hooks
and the markers remain.

Every rank collects and runs the same tests in the same order; rank 0 alone prints the report (the
terminal reporter is unregistered on the other ranks). An autouse fixture starts and ends every
test with an idle barrier. The harness's own collectives run on a duplicate of COMM_WORLD
(``HARNESS_COMM``), so they can never be matched against a test's collectives.

Failures (the rule: any rank's failure shows, with its traceback, and never hangs the job):

* Collection: the ranks compare what they collected (node ids, collection errors). If they
  differ, rank 0 prints the difference and the job ends (MPI_Abort): the ranks would otherwise
  run different tests against each other.
* End-of-test agreement: once a test's call (or its failed/skipped setup) is over, every rank
  posts an ``Iallgather`` of "failed here?" and polls it, sleeping. A rank whose test passed waits
  for it as long as the per-test timeout lets it. A rank whose test failed waits at most
  ``HPCASYNC_TEST_AGREE_TIMEOUT`` s (default 5) plus half the failed phase's duration: if the
  others have not arrived by then they are stuck (typically in a collective the failing rank
  skipped when its assert raised), so that rank writes its failure -- rank, test id, traceback,
  captured output, every line prefixed ``[rank N]`` -- to stderr and calls ``MPI_Abort``. The job
  ends within seconds instead of waiting for the timeout.
* If the agreement completes and some rank failed, the failing ranks' reports are gathered to
  rank 0 (``pytest_report_to_serializable``) and the test is reported FAILED on every rank, so
  the counts, ``-x``/``--maxfail`` and the exit status are the same everywhere. Rank 0's report
  carries the failing rank's own traceback when rank 0 passed (its short summary line reads
  ``[rank N] <message>``), and a "MPI ranks" section says which ranks failed and shows the
  tracebacks of other ranks that failed differently. A test that fails alike on every rank is an
  ordinary pytest failure, and the suite goes on.
* Teardown failures on ranks other than 0 are gathered at the end of the session, printed by
  rank 0, and fail the run.

Timeouts: the per-test limit is pytest-timeout's (``timeout`` in pytest.ini, 600 s; a
``@pytest.mark.timeout`` marker or ``--timeout`` win), overridden by the environment variable
``HPCASYNC_TEST_TIMEOUT_PER_TEST`` (seconds; 0 disables). The timer itself is ours, through
pytest-timeout's ``pytest_timeout_set_timer`` hook, for every ``timeout_method``: pytest-timeout's
own handlers write through the terminal reporter, which is gone on ranks other than 0, so there
they crashed silently and the job hung. On expiry every rank still in that test writes
``[rank N] TIMEOUT <test id>``, where it is (in the test, or done and waiting for the others), its
captured output and the stacks of its threads (pytest/pluggy frames left out) to stderr, then
calls ``MPI_Abort``. A faulthandler watchdog (``dump_traceback_later``, 30 s later, no GIL needed)
is the backstop should the Python timer thread never run.

Finally every rank waits (idle, at most 60 s) in ``pytest_unconfigure`` until rank 0 has printed
its summary, so that a rank exiting non-zero (``python -m mpi4py`` then aborts the job) cannot
cut the report short.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import threading
import time
import traceback
import zlib
from array import array

import pytest

from tests.mpi_util import COMM, RANK, SIZE, idle_barrier, idle_wait

# Tests compare separate jobs bitwise (a resume with its uninterrupted run, a grow-back with an
# undisturbed one): every job of the session must sum a size class alike, so allreduce auto keeps
# the first decision it cached (no re-check or re-measurement between jobs; test_comm_tune tests
# those with HPCASYNC_TUNE_RECHECK=1). A resume from a checkpoint pins its choices either way.
os.environ.setdefault("HPCASYNC_TUNE_RECHECK", "0")

TIMEOUT_ENV = "HPCASYNC_TEST_TIMEOUT_PER_TEST"
AGREE_ENV = "HPCASYNC_TEST_AGREE_TIMEOUT"
AGREE_DEFAULT = 5.0       # s a failed rank waits for the others at the end of its test
BACKSTOP = 30.0           # s after the timeout, faulthandler ends the process if we could not
FINAL_WAIT = 60.0         # s pytest_unconfigure waits for the other ranks

# The harness's collectives, apart from anything a test does on COMM_WORLD.
HARNESS_COMM = COMM.Dup() if SIZE > 1 else COMM

_failures: list[str] = []            # teardown failures on this rank, gathered at session end
_state = {"where": "between tests"}  # what this rank is doing, for the timeout message
_err_fd: int | None = None           # the real stderr, whatever pytest's capture does to fd 2
_agree_timeout = AGREE_DEFAULT


# ---------------------------------------------------------------------------------------------
# Configuration, collection


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    global _err_fd, _agree_timeout
    # Each rank its own temp root: ranks sharing pytest's default one race on its cleanup.
    if config.option.basetemp is None and SIZE > 1:
        config.option.basetemp = tempfile.mkdtemp(prefix=f"hpcasync-pytest-r{RANK}-")
    config.addinivalue_line("markers", "rank0: runs on rank 0 only (launches its own MPI job)")
    config.addinivalue_line("markers", "slow: acceptance-size run")
    config.addinivalue_line("markers", "no_mpi: launches no MPI job (in tests/mpi for the time "
                            "budget of tests/unit only); CI's MPICH pass leaves it out")
    config.addinivalue_line("markers", "one_mpi: takes the MPI paths of a twin test that runs under "
                            "every MPI (tests.mpi_util.MPI_TWINS, or named where it is marked); "
                            "CI's MPICH pass leaves it out")
    config.addinivalue_line("markers", "e2e: an end-to-end training run to an accuracy bar (examples, "
                            "learning bars, plugins' training, acceptance): its MPI calls are the "
                            "other tests'; CI's MPICH pass leaves it out")
    # Before pytest-timeout's pytest_configure reads it: the environment beats pytest.ini, an
    # explicit --timeout beats the environment.
    if os.environ.get(TIMEOUT_ENV) and getattr(config.option, "timeout", None) is None:
        config.option.timeout = _seconds(TIMEOUT_ENV)
    if os.environ.get(AGREE_ENV):
        _agree_timeout = _seconds(AGREE_ENV)
    if _err_fd is None:
        _err_fd = os.dup(2)  # capture is suspended while plugins configure


def _seconds(var: str) -> float:
    try:
        value = float(os.environ[var])
    except ValueError:
        value = -1.0
    if value < 0:
        raise pytest.UsageError(f"{var}={os.environ[var]!r}: expected a number of seconds >= 0")
    return value


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    config = session.config
    if RANK != 0:
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_collection_modifyitems(config, items):
    # rank0 tests: the body runs on rank 0 only; other ranks record a pass-through.
    if RANK == 0:
        return
    for item in items:
        if item.get_closest_marker("rank0"):
            item.obj = _noop


def _noop(*args, **kwargs):
    return None


def pytest_collection_finish(session):
    """All ranks must run the same tests, or their collectives pair up wrongly: check it."""
    if SIZE == 1:
        return
    ids = [item.nodeid for item in session.items]
    mine = array("q", [len(ids), zlib.crc32("\n".join(ids).encode()), session.testsfailed])
    every = array("q", bytes(8 * 3 * SIZE))
    req = HARNESS_COMM.Iallgather(mine, every)
    limit = _timeout_of(session.config)
    if not idle_wait(req, timeout=limit or None):
        _abort(f"the other ranks did not finish collecting within {limit:g} s: ending the job")
    if all(every[3 * r:3 * r + 3] == mine for r in range(SIZE)):
        return
    lists = HARNESS_COMM.gather(ids, root=0)
    if RANK == 0:
        lines = ["the ranks collected different tests (they must run the same ones in the same "
                 "order): ending the job"]
        for r in range(SIZE):
            n, _, errors = every[3 * r:3 * r + 3]
            lines.append(f"  rank {r}: {n} tests, {errors} collection errors")
            extra = [i for i in lists[r] if i not in set(lists[0])][:5]
            missing = [i for i in lists[0] if i not in set(lists[r])][:5]
            lines += [f"    only on rank {r}: {i}" for i in extra]
            lines += [f"    not on rank {r}: {i}" for i in missing]
        _write("\n".join(lines))
    idle_barrier(HARNESS_COMM)
    _abort(None)


# ---------------------------------------------------------------------------------------------
# Every test: start and end together; agree on the outcome


@pytest.fixture(autouse=True)
def _ranks_in_step(request):
    """Start and end every test together, without spinning, so collectives line up."""
    if SIZE == 1:
        yield
        return
    idle_barrier(HARNESS_COMM)
    yield
    idle_barrier(HARNESS_COMM)


def pytest_runtest_setup(item):
    _state["where"] = "in its setup"


def pytest_runtest_call(item):
    _state["where"] = "in the test function"


def pytest_runtest_teardown(item):
    _state["where"] = "in its teardown"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    # Exactly one agreement per test on every rank: after the call, or after a setup that did not
    # pass (then there is no call).
    if SIZE > 1 and (call.when == "call" or (call.when == "setup" and not report.passed)):
        _agree(item, report)
    return report


def _agree(item, report) -> None:
    failed = report.failed
    _state["where"] = (f"done with the test ({report.when} {report.outcome} on this rank) and "
                       "waiting for the other ranks to finish it")
    mine = array("b", [1 if failed else 0])
    every = array("b", bytes(SIZE))
    req = HARNESS_COMM.Iallgather(mine, every)
    deadline = _agree_timeout + 0.5 * (report.duration or 0.0) if failed else None
    if not idle_wait(req, timeout=deadline):
        _abort("\n".join([
            _banner(f"FAILED {report.nodeid} ({report.when}) on rank {RANK}"),
            _report_text(report),
            f"the other ranks did not reach the end of this test within {deadline:.1f} s after it "
            f"failed here: they are most likely waiting in a collective this rank never joined. "
            f"Ending the job (MPI_Abort). ({AGREE_ENV} sets the wait.)"]))
    _state["where"] = "between tests"
    failed_ranks = [r for r in range(SIZE) if every[r]]
    if not failed_ranks:
        return
    config = item.config
    mine = config.hook.pytest_report_to_serializable(config=config, report=report) if failed else None
    gathered = HARNESS_COMM.gather(mine, root=0)
    if RANK == 0:
        others = {r: config.hook.pytest_report_from_serializable(config=config, data=gathered[r])
                  for r in failed_ranks if r != 0}
        if not (failed_ranks == [0] and item.get_closest_marker("rank0")):
            _merge_into_rank0(report, failed_ranks, others)
    elif not failed:
        _mark_failed(report, f"failed on rank(s) {_ranks(failed_ranks)}")


def _merge_into_rank0(report, failed_ranks: list[int], others: dict) -> None:
    """Make rank 0's report tell the whole story of the test on all ranks."""
    passed = [r for r in range(SIZE) if r not in failed_ranks]
    primary = 0 if 0 in failed_ranks else failed_ranks[0]
    note = [f"failed on rank{'s' if len(failed_ranks) > 1 else ''} {_ranks(failed_ranks)}"
            + (f", passed on {_ranks(passed)}" if passed else " (every rank)")]
    if primary != 0:
        other = others[primary]
        _mark_failed(report, other.longrepr)
        report.sections.extend((f"{title} (rank {primary})", text) for title, text in other.sections)
        note.append(f"the traceback above is rank {primary}'s ({other.when})")
    message = _crash_message(report)
    same = [r for r in failed_ranks if r != primary and _crash_message(others[r]) == message]
    if same:
        note.append(f"rank{'s' if len(same) > 1 else ''} {_ranks(same)}: the same failure "
                    f"({message.strip().splitlines()[0] if message.strip() else 'no message'})")
    for r in failed_ranks:
        if r != primary and r not in same:
            note.append(f"rank {r} ({others[r].when}):\n{_report_text(others[r])}")
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and passed:
        crash.message = f"[rank {primary}] {crash.message}"
    _add_note(report, "MPI ranks", "\n".join(note))


def _crash_message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    return crash.message if crash is not None else _last_line(_longrepr_text(report))


def _mark_failed(report, longrepr) -> None:
    report.outcome = "failed"
    report.longrepr = longrepr
    if hasattr(report, "wasxfail"):
        del report.wasxfail


def _add_note(report, title: str, text: str) -> None:
    if hasattr(report.longrepr, "addsection"):
        report.longrepr.addsection(title, text)
    else:
        report.longrepr = f"{_longrepr_text(report)}\n\n{title}: {text}"


def _longrepr_text(report) -> str:
    return report.longreprtext if report.longrepr is not None else ""


def _report_text(report) -> str:
    parts = [_longrepr_text(report)]
    for title, text in report.sections:
        parts.append(f"{'-' * 10} {title} {'-' * 10}\n{text.rstrip()}")
    return "\n".join(parts)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def pytest_runtest_logreport(report):
    if report.failed and report.when == "teardown":
        _failures.append(f"{report.nodeid} [teardown]:\n{report.longreprtext}")


# ---------------------------------------------------------------------------------------------
# Timeouts (through pytest-timeout's hooks)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    timeout = settings.timeout
    timer = threading.Timer(timeout, _on_timeout, (item, timeout))
    timer.name = f"hpcasync-timeout {item.nodeid}"
    timer.daemon = True

    def cancel():
        timer.cancel()
        if timer is not threading.current_thread():
            timer.join()
        faulthandler.cancel_dump_traceback_later()

    item.cancel_timeout = cancel
    timer.start()
    if _err_fd is not None:
        faulthandler.dump_traceback_later(timeout + BACKSTOP, exit=True, file=_err_fd)
    return True


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item):
    cancel = getattr(item, "cancel_timeout", None)
    if cancel:
        cancel()
    return True


def _timeout_of(config) -> float:
    """The per-test limit in force (0: none), as pytest-timeout resolves it without a marker."""
    try:
        value = config.getoption("timeout", None) or os.environ.get("PYTEST_TIMEOUT") \
            or config.getini("timeout")
        return float(value or 0)
    except (ValueError, TypeError):
        return 0.0


def _on_timeout(item, timeout: float) -> None:
    """The test outlived its limit on this rank: say where every thread is, and end the job."""
    start = time.monotonic()
    where = _state["where"]
    try:
        lines = [_banner(f"TIMEOUT {item.nodeid}: not finished after {timeout:g} s on rank {RANK}"),
                 f"this rank is {where}; ending the job (MPI_Abort). The limit: "
                 f"@pytest.mark.timeout, else --timeout, else {TIMEOUT_ENV}, else pytest.ini."]
        capman = item.config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            try:
                capman.suspend_global_capture(in_=True)
                out, err = capman.read_global_capture()
            except Exception:  # capture in an odd state: the stacks matter more
                out = err = ""
            for title, text in (("captured stdout", out), ("captured stderr", err)):
                if text and text.strip():
                    lines.append(f"{'-' * 10} {title} {'-' * 10}\n{text.rstrip()}")
        lines.append(_stacks(skip_main=where.startswith("done with the test")))
        # Ranks time out together; one after the other keeps their dumps apart.
        time.sleep(0.2 * (RANK % 16))
        _write("\n".join(lines))
    except Exception:
        _write("".join(traceback.format_exc()))
    finally:
        time.sleep(max(0.0, 0.2 * min(SIZE, 16) + 1.0 - (time.monotonic() - start)))
        _abort(None, grace=0)


_MACHINERY = (f"{os.sep}_pytest{os.sep}", f"{os.sep}pluggy{os.sep}", f"{os.sep}mpi4py{os.sep}",
              f"{os.sep}runpy.py", f"{os.sep}pytest{os.sep}__main__.py")


def _stacks(skip_main: bool) -> str:
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me or (skip_main and ident == threading.main_thread().ident):
            continue
        frames = [f for f in traceback.extract_stack(frame)
                  if not f.filename.startswith("<frozen")
                  and not any(m in f.filename for m in _MACHINERY)]
        out.append(f"stack of thread {names.get(ident, ident)!r}:\n"
                   + "".join(traceback.format_list(frames)).rstrip())
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# End of session


def pytest_sessionfinish(session, exitstatus):
    if SIZE == 1:
        return
    idle_barrier(HARNESS_COMM)
    gathered = HARNESS_COMM.gather(_failures, root=0)
    others_failed = HARNESS_COMM.bcast(any(gathered[1:]) if RANK == 0 else None, root=0)
    if RANK == 0:
        _failures_elsewhere[:] = [(r, text) for r, fails in enumerate(gathered) if r
                                  for text in fails]
    if others_failed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_failures_elsewhere: list[tuple[int, str]] = []  # on rank 0: teardown failures of other ranks


def pytest_terminal_summary(terminalreporter):
    if _failures_elsewhere:
        terminalreporter.write_sep("=", "teardown failures on other ranks", red=True)
        for r, text in _failures_elsewhere:
            terminalreporter.write_line(f"[rank {r}] FAILED {text}")


def pytest_unconfigure(config):
    # Rank 0 prints its summary after pytest_sessionfinish: let no rank exit (a non-zero exit
    # makes `python -m mpi4py` abort the job) before it has.
    if SIZE > 1:
        idle_wait(HARNESS_COMM.Ibarrier(), timeout=FINAL_WAIT)


# ---------------------------------------------------------------------------------------------
# Output and abort


def _banner(title: str) -> str:
    return f"{'=' * 8} {title} {'=' * 8}"


def _write(text: str) -> None:
    """Write to the real stderr in one piece, every line marked with this rank."""
    data = "".join(f"[rank {RANK}] {line}\n" for line in text.splitlines()).encode(errors="replace")
    fd = _err_fd if _err_fd is not None else 2
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass


def _abort(message: str | None, grace: float = 1.0) -> None:
    """Print ``message`` and end the whole job: MPI_Abort, or os._exit should that not return."""
    if message:
        _write(message)
    time.sleep(grace)  # let mpiexec forward the output before the kill
    threading.Timer(10.0, os._exit, (1,)).start()
    COMM.Abort(1)
