"""The ``HPCASYNC_*`` environment variables, and a word about one that nothing reads.

hpcasync is steered by a few environment variables (``HPCASYNC_GROW_BACK``,
``HPCASYNC_ARRIVAL_TIMEOUT``, ``HPCASYNC_ALLREDUCE``, the test hooks of :mod:`hpcasync.inject`,
...). A
misspelt one (``HPCASYNC_GROW_BAK=1``) would be ignored without a word, the run then doing
something else than asked: :func:`say_unknown` (called by ``hpcasync.init`` and
``hpcasync train`` on their first rank) says it in one warning line, with the nearest known
name. :data:`KNOWN` lists every name read by hpcasync, its scripts, CI and its tests (a test
keeps it complete: ``tests/unit/test_environ.py``).

Example::

    $ HPCASYNC_GROW_BAK=1 mpiexec -n 4 python train.py
    [05:31:34 r0] HPCASYNC_GROW_BAK (HPCASYNC_GROW_BACK?): not read by hpcasync, ignored
"""
from __future__ import annotations

import difflib
import logging
import os

from .errors import ConfigError

log = logging.getLogger("hpcasync")

#: every ``HPCASYNC_*`` variable read anywhere in this repository (the package, scripts/,
#: slurm/, .ci/, tests/, experiments/)
KNOWN = frozenset({
    # the package
    "HPCASYNC_ALLREDUCE", "HPCASYNC_ARRIVAL_TIMEOUT", "HPCASYNC_DATA_DIR",
    "HPCASYNC_DUMP_BUFFERS", "HPCASYNC_EXIT_TIMEOUT", "HPCASYNC_FULL_EXIT", "HPCASYNC_GROW_BACK",
    "HPCASYNC_HOROVOD_AGREE", "HPCASYNC_HOROVOD_PROBE_S", "HPCASYNC_INJECT_FAULT",
    "HPCASYNC_INJECT_KILL", "HPCASYNC_INJECT_KILL_AT", "HPCASYNC_INJECT_KILL_LOG",
    "HPCASYNC_INJECT_NAN", "HPCASYNC_INJECT_SIGNAL", "HPCASYNC_JOINER",
    "HPCASYNC_JOIN_CONNECT_TIMEOUT", "HPCASYNC_JOIN_TIMEOUT", "HPCASYNC_MALLOC",
    "HPCASYNC_MAX_RANKS", "HPCASYNC_PERSISTENT",
    "HPCASYNC_RANKS_PER_NODE", "HPCASYNC_RESTART_COUNT", "HPCASYNC_STARTUP_TIMEOUT",
    "HPCASYNC_SUPERVISOR_DIR", "HPCASYNC_TUNE_FILE", "HPCASYNC_TUNE_RECHECK",
    # scripts/, slurm/, .ci/
    "HPCASYNC_CI_MPICH", "HPCASYNC_HOROVOD", "HPCASYNC_MPI", "HPCASYNC_PYTHON", "HPCASYNC_REPO",
    "HPCASYNC_VENV", "HPCASYNC_OPENMPI_TEST_TIMEOUT", "HPCASYNC_MPICH_TEST_TIMEOUT",
    # tests/, experiments/probes/
    "HPCASYNC_PROBE_DEVICE", "HPCASYNC_CASES_MD", "HPCASYNC_HOROVOD_EXAMPLES", "HPCASYNC_SKIP_SLURM",
    "HPCASYNC_STANDIN_LIMIT", "HPCASYNC_TEST_AGREE_TIMEOUT", "HPCASYNC_TEST_DEVICE",
    "HPCASYNC_TEST_PASSES", "HPCASYNC_TEST_REAL_DYNAMO", "HPCASYNC_TEST_REAL_TORCH",
    "HPCASYNC_TEST_RESTART_JOB", "HPCASYNC_TEST_TIMEOUT", "HPCASYNC_TEST_TIMEOUT_PER_TEST",
})

#: the form of each variable whose value is read as a number of seconds, a switch or one of a
#: few words (so that a value it cannot hold is one line at ``hpcasync.init`` rather than
#: read as something else: ``HPCASYNC_HOROVOD_AGREE=no`` as on, a bad timeout as its default)
FORMS: dict[str, object] = {
    **dict.fromkeys(("HPCASYNC_ARRIVAL_TIMEOUT", "HPCASYNC_EXIT_TIMEOUT",
                     "HPCASYNC_HOROVOD_PROBE_S", "HPCASYNC_JOIN_CONNECT_TIMEOUT",
                     "HPCASYNC_JOIN_TIMEOUT", "HPCASYNC_STARTUP_TIMEOUT"), "seconds"),
    **dict.fromkeys(("HPCASYNC_FULL_EXIT", "HPCASYNC_GROW_BACK", "HPCASYNC_HOROVOD_AGREE",
                     "HPCASYNC_PERSISTENT", "HPCASYNC_TUNE_RECHECK"), "switch"),
    "HPCASYNC_ALLREDUCE": ("mpi", "shm"),
    "HPCASYNC_MALLOC": ("default",),
}

_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")

_said = False


def seconds(name: str, default: float, environ=None) -> float:
    """The number of seconds variable ``name`` holds (``default`` when unset or empty); a value
    that is not a number >= 0 is a one-line ConfigError naming it."""
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return float(default)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds")
    return value


def switch(name: str, default: bool, environ=None) -> bool:
    """Whether switch ``name`` is on (``1``/``true``/``on``/``yes``, or ``0``/``false``/``off``/
    ``no``; ``default`` when unset or empty); another value is a one-line ConfigError."""
    raw = (os.environ if environ is None else environ).get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in _ON + _OFF:
        raise ConfigError(f"{name}={raw!r}: use 1 or 0")
    return raw in _ON


def word(name: str, environ=None) -> str:
    """The value of ``name``, one of :data:`FORMS`' words for it (lower case), or ``""`` when
    unset or empty; another value is a one-line ConfigError."""
    raw = (os.environ if environ is None else environ).get(name, "").strip().lower()
    if raw and raw not in FORMS[name]:
        raise ConfigError(f"{name}={raw!r}: use {' or '.join(FORMS[name])}, or leave it unset")
    return raw


def check(environ=None) -> None:
    """Every set variable of :data:`FORMS` holds a value of its form (else the one-line
    ConfigError of :func:`seconds`, :func:`switch` or :func:`word`); ``hpcasync.init`` calls this
    on every rank, so that a value read later (at exit, in a wait, by a grow-back) is never a
    surprise there."""
    for name, form in FORMS.items():
        if form == "seconds":
            seconds(name, 0.0, environ)
        elif form == "switch":
            switch(name, False, environ)
        else:
            word(name, environ)


def unknown(environ=None) -> list[tuple[str, str | None]]:
    """``(name, nearest known name or None)`` for each ``HPCASYNC_*`` variable of ``environ``
    (default ``os.environ``) that nothing reads."""
    env = os.environ if environ is None else environ
    return [(name, next(iter(difflib.get_close_matches(name, KNOWN, n=1, cutoff=0.8)), None))
            for name in sorted(env) if name.startswith("HPCASYNC_") and name not in KNOWN]


def say_unknown(environ=None) -> None:
    """One warning line (once a process) naming the ``HPCASYNC_*`` variables nothing reads."""
    global _said
    if _said:
        return
    _said = True
    found = unknown(environ)
    if found:
        log.warning("%s: not read by hpcasync, ignored", ", ".join(
            f"{name} ({near}?)" if near else name for name, near in found))
