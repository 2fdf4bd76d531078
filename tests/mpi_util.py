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

from hpcasync.launch import OPEN_MPI, child_env, describe, mpi_vendor, mpiexec_command

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
SIZE = COMM.Get_size()
REPO = Path(__file__).resolve().parent.parent
#: the MPI this run uses ("openmpi" or "mpich"): the launcher of every nested job follows it
VENDOR = mpi_vendor()


def idle_barrier(comm=COMM, poll: float = 0.002) -> None:
    """A barrier that sleeps between polls: 4 ranks on 2 cores must not burn CPU while waiting."""
    idle_wait(comm.Ibarrier(), poll=poll)


def idle_wait(request, timeout: float | None = None, poll: float = 0.002,
              longest: float = 0.02, patience: float = 0.5) -> bool:
    """Wait for a non-blocking MPI request, sleeping ``poll`` s between polls, ``longest`` once
    ``patience`` s have passed (the three ranks waiting out a rank0 test's own jobs poll 50 times
    a second, not 500; an in-process test's barriers keep their 2 ms); False if ``timeout``
    seconds passed first (the request is then still pending)."""
    now = time.monotonic()
    end = None if timeout is None else now + timeout
    slow = now + patience
    while not request.Test():
        now = time.monotonic()
        if end is not None and now > end:
            return False
        time.sleep(longest if now > slow else poll)
    return True


def digest(model) -> bytes:
    """The bytes of a model's floating parameters and buffers (replicas compare equal bitwise)."""
    import torch

    return torch.cat([t.detach().reshape(-1) for t in [*model.parameters(), *model.buffers()]
                      if t.is_floating_point()]).numpy().tobytes()


def identical_everywhere(model) -> bool:
    """Collective on COMM_WORLD: every rank holds this model bitwise."""
    return len(set(COMM.allgather(digest(model)))) == 1


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the launcher's job variables (a nested mpiexec must not join the
    parent's job; ``hpcasync.launch.child_env``), the repo on PYTHONPATH, then ``extra``."""
    env = child_env()
    env.setdefault("PYTHONPATH", str(REPO))
    env.update(extra)
    return env


def mpiexec(n: int, **kwargs) -> list[str]:
    """The launcher argv for ``n`` ranks of this run's MPI (Open MPI: ``mpiexec --oversubscribe
    -n N``; MPICH: ``mpiexec -n N``); ``ft=True`` adds ULFM (Open MPI only)."""
    return mpiexec_command(n, **kwargs)


def need_ulfm() -> None:
    """At the top of a test that needs ULFM: skip it under any MPI but Open MPI."""
    import pytest

    if VENDOR != OPEN_MPI:
        pytest.skip(f"ULFM needs Open MPI (this run: {describe()})")


def run_mpi(n: int, args: list[str], *, timeout: float = 300, cwd=None, env=None,
            ) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python -m hpcasync.cli ARGS`` (or a raw command when args[0] is '--')."""
    if args and args[0] == "--":
        cmd = args[1:]
    else:
        cmd = [sys.executable, "-m", "hpcasync.cli", *args]
    return subprocess.run([*mpiexec(n), *cmd], env=env or clean_env(), cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout)


def run_cli(args: list[str], *, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
    """Run ``python -m hpcasync.cli ARGS`` as a singleton (no mpiexec)."""
    return subprocess.run([sys.executable, "-m", "hpcasync.cli", *args], env=env or clean_env(),
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def last_summary(path) -> dict:
    """The last ``summary`` record of a metrics stream."""
    from hpcasync.metrics import read_metrics

    return [r for r in read_metrics(path) if r["event"] == "summary"][-1]


def assert_resumed_from(dump: Path, state: dict) -> None:
    """A run resumed from the PS checkpoint whose payload is ``state``, with
    ``HPCASYNC_DUMP_BUFFERS=dump``: its server (shard 0) started from the checkpoint's θ at its
    version, bitwise (``hpcasync.ps.serving`` dumps them at the resume)."""
    import torch

    at = torch.load(Path(dump) / f"ps-{state.get('kind', 'resume')}-shard0.pt", weights_only=True)
    saved = state["ps"]["rule"]
    assert at["version"] == int(saved["version"]), (at["version"], saved["version"])
    assert torch.equal(at["theta"], saved["theta"]), "the resumed θ is not the checkpoint's"


#: The uninterrupted 4-rank SSGD run that the kill and preemption tests (test_recovery.py,
#: test_preemption.py) compare their resumed runs with, bitwise: one job serves both
#: (:func:`reference_summary`). 16 steps an epoch, 3 epochs.
SSGD_REFERENCE = ["train", "--algorithm", "ssgd", "--dataset", "fashion-mnist-mini",
                  "--train-limit", "2048", "--test-limit", "300", "--epochs", "3", "--progress",
                  "off", "--seed", "3"]
_references: dict = {}


def reference_summary(args: list[str], directory: Path, n: int = 4) -> dict:
    """The summary record of ``mpiexec -n n python -m hpcasync.cli ARGS`` (run once per session
    and argument list, on the rank that asks: rank 0 of a ``rank0`` test); its metrics go to
    ``directory``. A failed run fails every test that asks for it."""
    key = (n, tuple(args))
    if key not in _references:
        metrics = Path(directory) / "reference.jsonl"
        r = run_mpi(n, [*args, "--metrics", str(metrics)], timeout=300)
        _references[key] = (r, last_summary(metrics) if r.returncode == 0 else None)
    r, summary = _references[key]
    assert r.returncode == 0, f"the reference run failed:\n{r.stderr[-2000:]}"
    return summary


def error_lines(text: str) -> list[str]:
    """The lines of ``text`` that are an ``hpcasync: error`` line, as a rank printed it. Blanks
    and NULs before it are skipped: prterun's aggregated help message ("1 more process has sent
    help message ...") once left a NUL at the start of the next line in a job's stderr."""
    return [ln for ln in text.splitlines() if ln.lstrip(" \t\0").startswith("hpcasync: error")]


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


#: PS rules whose MPI traffic is another rule's: the same transport and the same push and reply
#: shapes (ASP and ENSEMBLE are SHAT at α = 1 and 0; the rule is server-side math, tested in
#: tests/unit). A per-algorithm end-to-end test marks these ``one_mpi`` (:func:`per_algorithm`):
#: CI's MPICH pass runs it for the twin, not again for each of them.
MPI_TWINS = {"dcasgd": "asgd", "dcasgd-a": "asgd", "dana": "smega2", "nag": "smega2",
             "shat-root": "shat", "ensemble": "shat", "asp": "shat", "rennala": "asgd",
             "ringmaster": "asgd", "asgd-da": "asgd"}


def selected(request, name: str | None = None) -> list:
    """The ``algorithm`` of each item of test ``name`` (default: the asking test's) in the asking
    test's module that the session runs, None for an item without one: a module whose tests read
    one job's runs runs what they read (CI's MPICH pass deselects the one_mpi ones)."""
    name = name or request.node.originalname
    return [getattr(item, "callspec", None) and item.callspec.params.get("algorithm")
            for item in request.session.items
            if getattr(item, "originalname", None) == name and item.module is request.module]


def per_algorithm(algorithms):
    """pytest params, one per algorithm name, marked ``one_mpi`` where :data:`MPI_TWINS` names a
    twin whose run takes the same MPI paths."""
    import pytest

    return [pytest.param(a, marks=[pytest.mark.one_mpi] if a in MPI_TWINS else [], id=a)
            for a in algorithms]
