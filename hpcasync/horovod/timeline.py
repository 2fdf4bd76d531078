"""The Horovod timeline: a Chrome-trace JSON file of every facade collective's phases.

``HOROVOD_TIMELINE=/path/timeline.json`` (read by ``hvd.init()``; ``HOROVOD_TIMELINE_MARK_CYCLES=1``
adds cycle marks) or ``hvd.start_timeline(path, mark_cycles=False)`` … ``hvd.stop_timeline()``
record on rank 0, as Horovod's coordinator does; the other ranks write nothing. Open the file in
``chrome://tracing`` or https://ui.perfetto.dev::

    hvd.start_timeline("/tmp/timeline.json")
    ...  # training steps
    hvd.stop_timeline()

The format is the one Horovod 0.28.1 writes: a JSON array of events; one "process" row per
tensor, named ``allreduce.<name>`` (``allgather.``, ``broadcast.``, ``alltoall.``,
``reducescatter.``; ``grouped_allreduce.<name>_<i>of<n>`` for a grouped call;
``allreduce.noname.<k>`` without a name), its ``process_name``/``process_sort_index`` metadata
first; on each row ``B``/``E`` pairs (timestamps in µs from the ``start_time_since_epoch_in_micros``
of row 0) of the phases ``NEGOTIATE_ALLREDUCE`` (the cross-rank agreement, :mod:`.agree`) →
``ALLREDUCE`` ⊃ ``MPI_ALLREDUCE`` (``ADASUM`` ⊃ ``MPI_ADASUM_ALLREDUCE``, ``ALLGATHER`` ⊃
``MPI_ALLGATHER``, ``BROADCAST`` ⊃ ``MPI_BCAST``, ...), the last ``E`` carrying the tensor's
``dtype`` and ``shape``; ``mark_cycles`` adds a global instant ``CYCLE_START`` at each
negotiation. A ``DistributedOptimizer`` gives each gradient its row ``allreduce.<parameter name>``
(the rows of one bucket share their phases, as Horovod's fused tensors do); sparse gradients
appear as their ``.indices``/``.values`` allgathers.

Cost: with no timeline, a collective pays one module-global ``None`` check in each of its three
hooks (negotiation, submission, completion); nothing is allocated or written. Differences from
Horovod: no per-rank "ready" ``X`` marks inside the negotiation (the agreement is one allreduce,
with no per-rank arrival to record), no fusion-buffer phases (``MEMCPY_IN_FUSION_BUFFER``, ...);
an ``_async`` collective's phases end when it is synchronized; a ``DistributedOptimizer``'s
``ALLREDUCE`` spans the reduction of its buckets in ``synchronize()`` (buckets overlapped with
backward show only their wait); ``start_timeline`` needs no ``HOROVOD_TIMELINE=DYNAMIC``;
``barrier`` and the ``*_object`` helpers show their negotiation only.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import json
import os
import threading
import time

#: the recording timeline on this rank, or None: the one thing a collective checks
ACTIVE: Timeline | None = None
#: a collective's name -> the rows of its tensors (a DistributedOptimizer's parameters)
ROWS: dict[str, list[str]] = {}

#: kind -> (operation phase, MPI phase); the negotiation is NEGOTIATE_<operation phase>
_PHASES = {"ALLREDUCE": ("ALLREDUCE", "MPI_ALLREDUCE"),
           "OPTIMIZER": ("ALLREDUCE", "MPI_ALLREDUCE"),
           "ALLGATHER": ("ALLGATHER", "MPI_ALLGATHER"),
           "BROADCAST": ("BROADCAST", "MPI_BCAST"),
           "ALLTOALL": ("ALLTOALL", "MPI_ALLTOALL"),
           "REDUCESCATTER": ("REDUCESCATTER", "MPI_REDUCESCATTER"),
           "BARRIER": ("BARRIER", "MPI_BARRIER")}
_ADASUM = ("ADASUM", "MPI_ADASUM_ALLREDUCE")
_ADASUM_OP = 2                          # hvd.Adasum
_FLUSH_S = 1.0
_NONE = contextlib.nullcontext()


class Timeline:
    """One timeline file being written (module doc). Thread-safe: each event is written under a
    lock, its timestamp taken there, so every row's timestamps increase."""

    def __init__(self, path: str, mark_cycles: bool = False):
        self.path, self.mark_cycles = str(path), bool(mark_cycles)
        self._f = open(self.path, "w", encoding="utf-8")       # noqa: SIM115 (closed in close)
        self._lock = threading.Lock()
        self._t0 = time.perf_counter_ns()
        self._first = True
        self._flushed = time.monotonic()
        self._pids: dict[str, int] = {}
        self._open: dict[str, list[str]] = {}                 # row -> its open phases
        self._works: dict[int, tuple] = {}                    # id(work) -> (rows, phases)
        self._pending = None                                   # the last negotiation's rows
        self._noname = itertools.count()
        self.closed = False
        self._f.write("[\n")
        self._event({"name": "process_name", "ph": "M", "pid": 0,
                     "args": {"start_time_since_epoch_in_micros": time.time_ns() // 1000}})
        self._event({"name": "process_sort_index", "ph": "M", "pid": 0,
                     "args": {"sort_index": 0}})

    # -- writing ------------------------------------------------------------------------------------
    def _event(self, ev: dict) -> None:
        self._f.write(("" if self._first else ",\n") + json.dumps(ev, separators=(", ", ": ")))
        self._first = False

    def _ts(self) -> int:
        return (time.perf_counter_ns() - self._t0) // 1000

    def _pid(self, row: str) -> int:
        pid = self._pids.get(row)
        if pid is None:
            pid = self._pids[row] = len(self._pids) + 1
            self._event({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": row}})
            self._event({"name": "process_sort_index", "ph": "M", "pid": pid,
                         "args": {"sort_index": pid}})
        return pid

    def begin(self, rows, phase: str) -> None:
        with self._lock:
            if self.closed:
                return
            ts = self._ts()
            for row in rows:
                self._event({"ph": "B", "name": phase, "ts": ts, "pid": self._pid(row)})
                self._open.setdefault(row, []).append(phase)

    def end(self, rows, args=None) -> None:
        """Close the innermost open phase of each row; ``args[i]`` (a dict) on row i's event."""
        with self._lock:
            if self.closed:
                return
            ts = self._ts()
            for i, row in enumerate(rows):
                stack = self._open.get(row)
                if not stack:
                    continue
                stack.pop()
                ev = {"ph": "E", "ts": ts, "pid": self._pid(row)}
                if args is not None and i < len(args) and args[i]:
                    ev["args"] = args[i]
                self._event(ev)
            if time.monotonic() - self._flushed > _FLUSH_S:
                self._f.flush()
                self._flushed = time.monotonic()

    def cycle(self) -> None:
        with self._lock:
            if not self.closed:
                self._event({"ph": "i", "name": "CYCLE_START", "ts": self._ts(), "s": "g"})

    @contextlib.contextmanager
    def span(self, rows, *phases, args=None):
        """``phases`` nested on each row for the duration of the block."""
        for phase in phases:
            self.begin(rows, phase)
        try:
            yield
        finally:
            for k in range(len(phases)):
                self.end(rows, args if k == len(phases) - 1 else None)

    def close(self) -> None:
        """End every open phase now and close the file (a complete JSON array)."""
        with self._lock:
            if self.closed:
                return
            ts = self._ts()
            for row, stack in self._open.items():
                while stack:
                    stack.pop()
                    self._event({"ph": "E", "ts": ts, "pid": self._pid(row)})
            self._f.write("\n]\n")
            self._f.close()
            self.closed = True

    # -- the collectives' hooks ------------------------------------------------------------------
    def _rows_of(self, desc) -> tuple[list[str], tuple] | None:
        phases = _PHASES.get(desc.kind)
        if phases is None:
            return None
        if desc.kind == "ALLREDUCE" and desc.op == _ADASUM_OP:
            phases = _ADASUM
        if desc.name in ROWS:
            return ROWS[desc.name], phases
        prefix = desc.kind.lower()
        if desc.kind == "BARRIER":
            return ["barrier"], phases
        name = desc.name if desc.name is not None else f"noname.{next(self._noname)}"
        n = len(desc.specs)
        if n > 1:
            return [f"grouped_{prefix}.{name}_{i + 1}of{n}" for i in range(n)], phases
        return [f"{prefix}.{name}"], phases

    def negotiation(self, desc):
        """Rows and phases of ``desc``, its NEGOTIATE phase begun (None: not a timed kind)."""
        found = self._rows_of(desc)
        if found is None:
            return None
        if self.mark_cycles:
            self.cycle()
        rows, phases = found
        self.begin(rows, "NEGOTIATE_" + phases[0])
        return found

    def negotiated(self, found) -> None:
        rows, phases = found
        self.end(rows)
        self._pending = found

    def started(self, work) -> None:
        """The collective just negotiated now moves data: its phases begin on its rows."""
        found, self._pending = self._pending, None
        if found is None or id(work) in self._works:
            return
        rows, phases = found
        self._works[id(work)] = found
        for phase in phases:
            self.begin(rows, phase)

    def transferred(self, work) -> None:
        """The data of ``work`` has moved (its MPI phase ends; Adasum's, before delivery)."""
        found = self._works.get(id(work))
        if found is not None and len(found) == 2:
            self._works[id(work)] = (*found, True)
            self.end(found[0])

    def completed(self, work) -> None:
        found = self._works.pop(id(work), None)
        if found is None:
            return
        rows = found[0]
        if len(found) == 2:
            self.end(rows)
        self.end(rows, _args(work.result, len(rows)))


def _args(result, n: int) -> list[dict]:
    import torch

    if isinstance(result, tuple):                       # alltoall: (output, received splits)
        result = result[0]
    items = result if isinstance(result, list) else [result] * n
    return [{"dtype": str(t.dtype).replace("torch.", ""), "shape": str(list(t.shape))}
            if torch.is_tensor(t) else {} for t in items[:n]]


# -- hooks (decorators: with no timeline each costs one global check) --------------------------------

def negotiates(agree):
    """Wraps :func:`.agree.agree`: its exchange is the collective's NEGOTIATE phase."""
    @functools.wraps(agree)
    def timed(comm, desc, *args, **kwargs):
        tl = ACTIVE
        if tl is None:
            return agree(comm, desc, *args, **kwargs)
        found = tl.negotiation(desc)
        try:
            return agree(comm, desc, *args, **kwargs)
        finally:
            if found is not None:
                tl.negotiated(found)
    return timed


def submits(handle):
    """Wraps ``collectives._handle``: the negotiated collective's phases begin."""
    @functools.wraps(handle)
    def timed(work):
        tl = ACTIVE
        if tl is not None:
            tl.started(work)
        return handle(work)
    return timed


def completes(complete):
    """Wraps ``_Work.complete``: the collective's phases end (with its dtype and shape)."""
    @functools.wraps(complete)
    def timed(work):
        tl = ACTIVE
        if tl is None:
            return complete(work)
        result = complete(work)
        tl.completed(work)
        return result
    return timed


def span(rows, *phases):
    """A block timed as ``phases`` on ``rows`` (a no-op context without a timeline)."""
    tl = ACTIVE
    return _NONE if tl is None else tl.span(rows, *phases)


def name_rows(name: str, rows: list[str]) -> None:
    """The collectives named ``name`` (a DistributedOptimizer's) show as these rows."""
    ROWS[name] = list(rows)


# -- the API (``hvd.start_timeline`` / ``hvd.stop_timeline`` call these with this rank) ---------------

def start(file_path, mark_cycles: bool = False, *, rank: int) -> None:
    """Record the timeline to ``file_path`` on rank 0 (elsewhere nothing happens); a timeline
    already recording is closed first."""
    global ACTIVE
    if rank != 0:
        return
    if ACTIVE is not None:
        ACTIVE.close()
    ACTIVE = Timeline(os.fspath(file_path), mark_cycles)


def stop() -> None:
    """Stop recording and close the file (a complete JSON array)."""
    global ACTIVE
    tl, ACTIVE = ACTIVE, None
    if tl is not None:
        tl.close()


def start_from_env(*, rank: int) -> None:
    """At ``hvd.init()``: ``HOROVOD_TIMELINE=path`` starts recording (``DYNAMIC``: wait for
    ``start_timeline``); ``HOROVOD_TIMELINE_MARK_CYCLES=1`` marks cycles."""
    path = os.environ.get("HOROVOD_TIMELINE")
    if path and path != "DYNAMIC" and ACTIVE is None:
        marks = os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "0").lower() in ("1", "true")
        start(path, marks, rank=rank)


@atexit.register
def _close_at_exit() -> None:
    if ACTIVE is not None:
        ACTIVE.close()
