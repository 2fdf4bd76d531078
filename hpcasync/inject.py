"""Fault injection for tests: the one hook production code calls, and the phases it is called at.

Production code calls ``inject.point(PHASE)`` at each phase of :data:`PHASES` (and nothing else of
this module but :func:`start_run`, :func:`forget_first_launch` and :func:`dump`); the call does
nothing unless one of the variables below names this process. Tests set them in the launcher's
environment (or in ``os.environ`` between in-process runs: a run's start reads them again)::

    HPCASYNC_INJECT_KILL_AT=3:step:5          # rank 3 SIGKILLs itself at its 5th completed step
    HPCASYNC_INJECT_KILL_AT=1:grow:1:2:bg     # rank 1, 2 s after its first grow, from a timer

Variables (RANK: the process's rank in the first launch -- its ``MPI_COMM_WORLD`` rank, or the
launcher's before MPI starts; several comma-separated items name other ranks):

``HPCASYNC_INJECT_KILL_AT=RANK:PHASE:N[:WAIT[:bg|sleep|fail]]``
    at the N-th time RANK reaches PHASE: SIGKILL itself (WAIT s later when given); ``bg``: from a
    timer WAIT s later while the rank goes on (a death inside its next collective); ``sleep``:
    only sleep WAIT s (a late rank); ``fail``: raise :class:`~hpcasync.errors.ProcessFailedError`
    after WAIT s, as an MPI call that reports a death does.
``HPCASYNC_INJECT_KILL=RANK:N``
    SIGKILL at the N-th ``push`` (a worker) or ``served`` (a server).
``HPCASYNC_INJECT_SIGNAL=RANK:N``
    SIGUSR1 (a scheduler's preemption signal) at the N-th ``step`` (a worker) or ``served``.
``HPCASYNC_INJECT_FAULT=RANK:N``
    a ``RuntimeError`` at every ``step`` from the N-th on (the abort path, with a real exception).
``HPCASYNC_INJECT_NAN=RANK:N``
    a NaN in the gradient of the worker's N-th step (``gradient``): the PS must reject it.
``HPCASYNC_INJECT_KILL_LOG=FILE``
    every kill first appends ``RANK PHASE N UNIX_TIME`` to FILE (a study measures from it).
``HPCASYNC_DUMP_BUFFERS=DIR``
    :func:`dump` saves tensors at a PS takeover (what a test compares).

The variables are read at the first phase, again at each of the CLI's start-up phases and at
each run's start (:func:`start_run`), so a test may change them between in-process runs; a phase
that nothing names costs a dictionary lookup. Counts restart with each run. A replacement
spawned by a grow-back drops the variables that name ranks of the first launch
(:func:`forget_first_launch`), as does a PS takeover for ``HPCASYNC_INJECT_KILL``.
"""
from __future__ import annotations

import os
import signal
import threading
import time

KILL_AT_ENV = "HPCASYNC_INJECT_KILL_AT"
KILL_ENV = "HPCASYNC_INJECT_KILL"
SIGNAL_ENV = "HPCASYNC_INJECT_SIGNAL"
FAULT_ENV = "HPCASYNC_INJECT_FAULT"
NAN_ENV = "HPCASYNC_INJECT_NAN"
KILL_LOG_ENV = "HPCASYNC_INJECT_KILL_LOG"
DUMP_ENV = "HPCASYNC_DUMP_BUFFERS"
_PLAN_ENV = (KILL_AT_ENV, KILL_ENV, SIGNAL_ENV, FAULT_ENV, NAN_ENV)
#: what a replacement drops (the ranks they name are the first launch's)
FIRST_LAUNCH_ONLY = (KILL_AT_ENV, KILL_ENV, FAULT_ENV)

#: every phase, in roughly the order a rank meets them, and where it is
PHASES = {
    "launch": "the CLI's imports done, before the options are read",
    "data": "before the data set is loaded, MPI not started",
    "mpi": "MPI just initialised, before the topology's collectives",
    "startup": "a run's first broadcast (synchronous families, the PS), before it",
    "adopt": "a PS takeover's set-up, before the new server's first broadcast (counted on "
             "every survivor, fired on the new server only)",
    "attach": "a PS set-up (the constructor's, a takeover's), after its first broadcast, before "
              "its windows",
    "step": "after a completed training step, on every training rank",
    "gradient": "a PS worker's gradient, before it is pushed",
    "push": "a PS worker's push, its gradient written, before its header",
    "shard_push": "a PS worker's push to shard server s > 0 (its push to the shards before it "
                  "sent), as in push",
    "served": "the PS, after an accepted push",
    "epoch_agree": "an epoch end, before its preemption agreement",
    "checkpoint": "when a checkpoint is written",
    "epoch_end": "before an epoch's evaluation",
    "epoch_done": "DASO's epoch end, its last collective done",
    "final": "before a run's final gathers",
    "recovery": "a synchronous recovery, after the state broadcast, before the topology rebuild",
    "recovered": "a synchronous recovery's attempt, after its last collective",
    "takeover": "a PS takeover's exchange, between its allgather and its gathers",
    "reset": "an elastic loop's reset, after the shrink, before the rebuild",
    "grow": "a grow-back's survivor, the replacements spawned, before the merge or connect",
}
EARLY_PHASES = ("launch", "data", "mpi")

_state: dict = {"plan": None, "counts": {}}


def point(phase: str, *, fire: bool = True, step: int | None = None, grad=None) -> None:
    """This process reached ``phase`` (one of :data:`PHASES`): count it and do what the
    variables ask for it. ``fire=False``: counted, never acted on. ``gradient`` passes the
    worker's ``step`` and ``grad`` (poisoned in place)."""
    if phase in EARLY_PHASES:
        _state["plan"] = None
    actions = _plan().get(phase)
    if not actions:
        return
    counts = _state["counts"]
    counts[phase] = n = counts.get(phase, 0) + 1
    for kind, at, wait, how in actions:
        if kind == "nan":
            if step == at and grad is not None:
                grad[0] = float("nan")
        elif kind == "fault":
            if n >= at:
                raise RuntimeError(f"injected fault ({FAULT_ENV}) at step {n}")
        elif n == at and fire:
            _act(kind, phase, n, wait, how)


def start_run() -> None:
    """A training run starts in this process: the variables are read again, the counts begin
    again."""
    _state["plan"], _state["counts"] = None, {}


def forget_first_launch() -> None:
    """In a replacement spawned by a grow-back: drop the variables naming first-launch ranks."""
    forget(*FIRST_LAUNCH_ONLY)


def forget(*names: str) -> None:
    for name in names:
        os.environ.pop(name, None)
    _state["plan"] = None


def dump(tag: str, **what) -> None:
    """``HPCASYNC_DUMP_BUFFERS=DIR``: save ``what`` (tensors cloned to the CPU) to
    ``DIR/<tag>.pt``."""
    where = os.environ.get(DUMP_ENV)
    if not where:
        return
    import torch

    os.makedirs(where, exist_ok=True)
    copy = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in what.items()}
    torch.save(copy, os.path.join(where, f"{tag}.pt"))


# -- the plan: what the variables ask of this process ------------------------------------------------

def _rank() -> int:
    from .errors import _mpi_world, launcher_rank

    world = _mpi_world()
    return world.Get_rank() if world is not None else launcher_rank()


def _plan() -> dict:
    if _state["plan"] is None:
        named = any(os.environ.get(v) for v in _PLAN_ENV)
        _state["plan"] = _parse(_rank()) if named else {}
    return _state["plan"]


def _parse(rank: int) -> dict:
    """{phase: [(kind, n, wait, how)]} for ``rank`` from the variables (ConfigError if bad)."""
    plan: dict[str, list] = {}

    def add(phase, kind, n, wait=0.0, how=""):
        plan.setdefault(phase, []).append((kind, n, wait, how))

    kill_at: dict[str, tuple] = {}          # (a phase named twice for a rank: the last item)
    for item in filter(None, os.environ.get(KILL_AT_ENV, "").split(",")):
        r, phase, n, wait, how = (item.split(":") + [""] * 5)[:5]
        if phase not in PHASES or not (r.isdigit() and n.isdigit()) \
                or not (wait == "" or wait.replace(".", "", 1).isdigit()) \
                or how not in ("", "bg", "sleep", "fail"):
            from .errors import ConfigError
            raise ConfigError(f"{KILL_AT_ENV}: {item!r} is not RANK:PHASE:N[:WAIT[:bg|sleep|"
                              f"fail]] with PHASE one of {', '.join(PHASES)}")
        if int(r) == rank:
            kill_at[phase] = (int(n), float(wait or 0), how)
    for phase, (n, wait, how) in kill_at.items():
        add(phase, "kill", n, wait, how)
    for var, phases, kind in ((KILL_ENV, ("push", "served"), "kill"),
                              (SIGNAL_ENV, ("step", "served"), "signal"),
                              (FAULT_ENV, ("step",), "fault"), (NAN_ENV, ("gradient",), "nan")):
        mine = [int(n) for r, _, n in (i.partition(":") for i in os.environ.get(var, "").split(","))
                if r.isdigit() and n.isdigit() and int(r) == rank]
        for phase in phases if mine else ():
            add(phase, kind, mine[0])
    return plan


def _act(kind: str, phase: str, n: int, wait: float, how: str) -> None:
    what = f"{_rank()} {'push' if kind == 'kill' and phase in ('push', 'served') else phase} {n}"
    if kind == "signal":
        os.kill(os.getpid(), signal.SIGUSR1)
        return
    if how == "bg":
        threading.Timer(wait, _kill, (what,)).start()
        return
    if wait:
        time.sleep(wait)
    if how == "fail":
        from .errors import ProcessFailedError
        raise ProcessFailedError(f"injected ({KILL_AT_ENV}): a collective failed here at "
                                 f"{phase} {n}", [])
    if how != "sleep":
        _kill(what)


def _kill(what: str) -> None:
    path = os.environ.get(KILL_LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{what} {time.time():.6f}\n")
    os.kill(os.getpid(), signal.SIGKILL)
