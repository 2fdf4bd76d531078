"""What ``algorithm="auto"`` means: per message size, ``MPI_Allreduce`` unless our shared-memory
window was *measured* to beat it on this machine, with this many ranks, beyond the measurement's
own spread.

Why measure: which one wins depends on the machine, not on a constant (a core per rank or
several ranks per core, the MPI's own shared-memory path, the size). A fixed threshold is wrong
somewhere.

Decision, per (communicator, size class, wire kind): the size class is the message size rounded up
to a power of two between 4 KiB and 64 MiB (bigger messages go in 64 MiB pieces anyway); the wire
kind is 32/64-bit or 16-bit (16-bit MPI sums run a user-defined op, so they are measured apart).
At the first message of a class every rank of the communicator measures (:func:`measure`): warm-up
rounds of both methods on the buffers they time (MPI's own buffers and the window warm), then
*paired* rounds — one MPI and one window reduction each, in an order that alternates, a barrier
before each — in batches, for at least :data:`MIN_TIME_S` (so that the rounds span more than one
mood of the scheduler when ranks share cores) and until the paired ratio t_MPI/t_window is clear
of :data:`MARGIN` (its median ± two standard errors, all above or all below), or the class's round
or time budget is spent. Times are combined with ``MPI_MAX`` after each batch, so every rank
reaches the same decision with no further message. The window is chosen only when the lower end
of that interval is at or above :data:`MARGIN` (the window at least 3 % faster, beyond the
spread) and the median at or above :data:`EFFECT` (10 % faster in the typical round: with ranks
sharing cores, timings minutes apart differ by more than one measurement's spread, so a near tie
goes to MPI), and only when a second, independent measurement agrees; anything else is MPI.

Reproducibility: the choice changes the summation order (window: rank order; MPI: its tree), so
decisions are written to a small JSON file (:func:`tune_file`: ``$HPCASYNC_TUNE_FILE``, default
``~/.cache/hpcasync/allreduce-auto.json``; ``none`` keeps them in memory only) keyed by host, MPI
library, communicator size and core count, with the times, the interval, the rounds, the load
average and the date. A later run reads the file instead of measuring, but re-checks (``HPCASYNC
_TUNE_RECHECK=0`` turns this off): a cached window choice is confirmed by a short paired check at
its first use in each process (the window slower than MPI there: measured again, and the file
rewritten); a record older than :data:`MAX_AGE_DAYS`, or measured while other work kept the
machine busy and read on a machine half as loaded, is measured again (:func:`stale`).
``hpcasync tune`` shows, clears or re-measures the file's choices; ``HPCASYNC_ALLREDUCE=mpi|shm``
forces the choice of ``auto``.

Resume: since a re-check or a re-measurement may change a choice between two jobs, a checkpoint
carries the choices its run made (:func:`in_use`, a header field written by
``hpcasync.checkpoint.save_checkpoint``), and reading one pins them (:func:`pin`): a run resumed
on the same machine reduces every class as the run that wrote it did, so an SSGD resume stays
bitwise equal to the uninterrupted run. A pinned class is neither re-checked nor measured; a
class the checkpoint does not name (another machine, MPI or world size) is decided as usual.

Example::

    from hpcasync.comm.tune import use_shm
    use_shm(topo.local, 4 << 20, torch.float32)   # collective on first use of the class; cached
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import environ
from ..launch import ft_requested
from .cache import comm_cache
from .ops import HALF_DTYPES

log = logging.getLogger(__name__)

MARGIN = 1.03                   # the window must be at least this much faster (beyond the spread)
EFFECT = 1.10                   # ... and this much faster in the typical round (the median)
ROUNDS = (8, 200)               # paired rounds per measurement: at least, at most
BATCH = 4                       # rounds between two looks at the spread
MIN_TIME_S = 0.25               # a measurement spans at least this long (the scheduler's moods)
BUDGET_S = 1.5                  # seconds a measurement may take (it stops at a batch's end)
WARMUP_S = 0.05                 # at least this long of warm-up per method (and WARMUP rounds)
WARMUP = 3
CHECK_ROUNDS = 8                # the short check of a cached window choice
MAX_AGE_DAYS = 30.0             # a record older than this is measured again
MIN_CLASS = 4 << 10
MAX_CLASS = 64 << 20
_memory: dict[str, bool] = {}   # decisions of this process (made, or pinned by a checkpoint read)


@dataclass
class Measurement:
    """Paired rounds of MPI and window reductions of one size (every rank the same numbers):
    medians of the slowest rank's seconds, and the paired ratio t_MPI/t_window with its interval
    (median ± 2 standard errors of the median)."""
    mpi_s: float
    shm_s: float
    ratio: float
    low: float
    high: float
    rounds: int

    @property
    def window(self) -> bool:
        """The window is faster than MPI by :data:`MARGIN` beyond the spread and by
        :data:`EFFECT` in the median round: a near tie goes to MPI, whose speed is the baseline,
        since the next minute's timings may differ by more than one measurement's spread."""
        return self.low >= MARGIN and self.ratio >= EFFECT

    def record(self) -> dict:
        return {"mpi_s": self.mpi_s, "shm_s": self.shm_s, "ratio": self.ratio, "low": self.low,
                "high": self.high, "rounds": self.rounds}


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a power of two in [4 KiB, 64 MiB]."""
    c = MIN_CLASS
    while c < min(nbytes, MAX_CLASS):
        c *= 2
    return c


def tune_file() -> Path | None:
    """Where decisions are kept across runs (None: in memory only)."""
    raw = os.environ.get("HPCASYNC_TUNE_FILE", "")
    if raw.lower() == "none":
        return None
    if raw:
        return Path(raw)
    return Path.home() / ".cache" / "hpcasync" / "allreduce-auto.json"


def _key(comm, cls: int, wire: torch.dtype) -> str:
    from mpi4py import MPI

    lib = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
    kind = "16" if wire in HALF_DTYPES else "32"
    return f"{platform.node()}|{lib}|n={comm.Get_size()}|cores={os.cpu_count()}|{kind}|{cls}"


def _read(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}                        # a damaged cache is re-measured, not an error
    return data if isinstance(data, dict) else {}


def _write(path: Path | None, key: str, record: dict) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data[key] = record
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:               # read-only home: keep the decision in memory
        log.info("allreduce auto: cannot write %s (%s); decisions kept in memory", path, exc)


def use_shm(comm, nbytes: int, wire: torch.dtype) -> bool:
    """True when ``auto`` should reduce ``nbytes`` of ``wire`` on ``comm`` (one node, > 1 rank)
    through the shared-memory window (never under ULFM, where a dead peer must surface as an MPI
    error). Collective the first time a class is seen on ``comm``."""
    cls = size_class(nbytes)
    decisions = comm_cache(comm).setdefault("auto_shm", {})
    half = wire in HALF_DTYPES
    hit = decisions.get((cls, half))
    if hit is None and ft_requested():
        # under ULFM a peer's death must surface as an MPI error, not as a spin on window memory
        hit = decisions[(cls, half)] = False
    if hit is None:
        forced = environ.word("HPCASYNC_ALLREDUCE")
        hit = decisions[(cls, half)] = (forced == "shm") if forced else _decide(comm, cls, wire)
    return hit


def _rechecks() -> bool:
    return environ.switch("HPCASYNC_TUNE_RECHECK", True)


def stale(record: dict, ranks: int, now: float | None = None,
          load_now: float | None = None) -> str | None:
    """Why a cached record of a ``ranks``-rank communicator must be measured again (None: it
    stands): older than :data:`MAX_AGE_DAYS`, or measured while other work kept the machine busy
    (a load average above its cores plus the job's own ranks) and the machine is now at most half
    as loaded."""
    now = time.time() if now is None else now
    when = record.get("time")
    if isinstance(when, (int, float)) and now - when > MAX_AGE_DAYS * 86400:
        return f"measured {(now - when) / 86400:.0f} days ago"
    load = record.get("load")
    cores = os.cpu_count() or 1
    if isinstance(load, (int, float)) and load > cores + ranks:
        load_now = os.getloadavg()[0] if load_now is None else load_now
        if load_now <= load / 2:
            return (f"measured at load average {load:.1f} on {cores} cores ({ranks} ranks); "
                    f"{load_now:.1f} now")
    return None


def in_use() -> dict[str, bool]:
    """This process's decisions (made by its ``auto`` reductions, or pinned), by key (host, MPI,
    size, class): what a checkpoint records so that a resume reduces alike."""
    return dict(_memory)


def pin(choices) -> None:
    """Take ``choices`` (:func:`in_use` of the run that wrote a checkpoint) as this process's
    decisions for those keys, which are then neither re-checked nor measured (:func:`_decide`
    trusts its own decisions). Anything not a ``{str: bool}`` entry is ignored (a checkpoint of an
    older hpcasync has none)."""
    if isinstance(choices, dict):
        _memory.update({k: v for k, v in choices.items()
                        if isinstance(k, str) and isinstance(v, bool)})


def _decide(comm, cls: int, wire: torch.dtype) -> bool:
    """The decision for a class: this process's (made or pinned), the file's (re-checked), or
    measured now (collective; rank 0's view is broadcast)."""
    key = _key(comm, cls, wire)
    path = tune_file()
    known = None
    if comm.Get_rank() == 0:
        known = _memory.get(key)
        if known is None:
            rec = _read(path).get(key)
            if isinstance(rec, dict) and isinstance(rec.get("shm"), bool):
                why = stale(rec, comm.Get_size()) if _rechecks() else None
                if why is None:
                    known = {"shm": rec["shm"], "checked": False}
                else:
                    log.info("allreduce auto, %d-byte class: the cached choice was %s; measuring "
                             "again", cls, why)
        else:
            known = {"shm": known, "checked": True}
    known = comm.bcast(known, root=0)
    if known is not None:
        if known["shm"] and not known["checked"] and _rechecks():
            check = measure(comm, cls, wire, rounds=CHECK_ROUNDS, adaptive=False)
            if check.ratio >= 1.0:
                _memory[key] = True
                return True
            log.info("allreduce auto, %d-byte class: the cached window choice measured %.2fx MPI "
                     "now; measuring again", cls, check.ratio)
        else:
            _memory[key] = known["shm"]
            return known["shm"]
    return _measure_and_keep(comm, cls, wire, key, path)


def remeasure(comm, nbytes: int, wire: torch.dtype) -> bool:
    """Measure the class of ``nbytes`` again (collective), keep the decision (file and memory,
    ``comm``'s own included) and return it: ``hpcasync tune measure``."""
    cls = size_class(nbytes)
    shm = _measure_and_keep(comm, cls, wire, _key(comm, cls, wire), tune_file())
    comm_cache(comm).setdefault("auto_shm", {})[(cls, wire in HALF_DTYPES)] = shm
    return shm


def _measure_and_keep(comm, cls: int, wire: torch.dtype, key: str, path) -> bool:
    """Measure ``cls``; a window verdict is measured a second time and kept only if confirmed.
    The decision goes to this process's memory and (rank 0) to the file."""
    first = measure(comm, cls, wire)
    second = measure(comm, cls, wire) if first.window else None
    shm = bool(first.window and second.window)
    _memory[key] = shm
    if comm.Get_rank() == 0:
        record = {"shm": shm, **first.record(), "confirmed": second is not None and shm,
                  "measured": time.strftime("%Y-%m-%d %H:%M:%S"), "time": time.time(),
                  "load": os.getloadavg()[0]}
        if second is not None:
            record["second"] = second.record()
        _write(path, key, record)
    log.info("allreduce auto, %d ranks, %d-byte class: %s (MPI %.1f us, window %.1f us, "
             "MPI/window %.2f [%.2f, %.2f], %d rounds%s)", comm.Get_size(), cls,
             "window" if shm else "MPI", first.mpi_s * 1e6, first.shm_s * 1e6, first.ratio,
             first.low, first.high, first.rounds,
             "" if second is None else f"; again: {second.ratio:.2f} [{second.low:.2f}, "
             f"{second.high:.2f}]")
    return shm


def measure(comm, nbytes: int, wire: torch.dtype, *, rounds: int | None = None,
            adaptive: bool = True) -> Measurement:
    """Paired rounds of one MPI and one window reduction of ``nbytes`` of ``wire`` (collective;
    module doc). ``adaptive``: batches of :data:`BATCH` rounds from ``ROUNDS[0]`` on, until
    the ratio's interval is clear of :data:`MARGIN` or ``rounds`` (default ``ROUNDS[1]``)
    or :data:`BUDGET_S` is spent; else exactly ``rounds`` rounds."""
    import numpy as np
    from mpi4py import MPI

    from .handle import run_blocking
    from .ops import mpi_buffer, sum_op
    from .shm import ShmAllreduce

    most = ROUNDS[1] if rounds is None else rounds
    engine = ShmAllreduce.for_comm(comm)
    scratch = torch.zeros(max(1, nbytes // wire.itemsize), dtype=wire)
    buf, op = mpi_buffer(scratch), sum_op(wire)      # MPI as allreduce()'s direct path calls it

    def one(k: int) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        if k == 0:
            comm.Allreduce(MPI.IN_PLACE, buf, op=op)
        else:
            run_blocking(engine.steps(scratch, wire=wire))
        return time.perf_counter() - t0

    t_warm, i = time.perf_counter(), 0
    while i < WARMUP or comm.allreduce(time.perf_counter() - t_warm < WARMUP_S, op=MPI.LAND):
        one(0)
        one(1)
        i += 1
    times = np.zeros((2, 0))
    t0 = time.perf_counter()
    while True:
        n = times.shape[1]
        batch = np.zeros((2, BATCH if adaptive else most))
        for j in range(batch.shape[1]):
            order = (0, 1) if (n + j) % 2 == 0 else (1, 0)
            for k in order:
                batch[k, j] = one(k)
        comm.Allreduce(MPI.IN_PLACE, batch, op=MPI.MAX)
        times = np.concatenate([times, batch], axis=1)
        result = _summary(times)
        if not adaptive:
            return result
        spent = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        clear = result.low >= MARGIN or result.high < MARGIN
        if (clear and result.rounds >= ROUNDS[0] and spent >= MIN_TIME_S) or \
                result.rounds >= most or spent > BUDGET_S:
            return result


def _summary(times) -> Measurement:
    """The medians and the paired ratio's interval of ``times`` (2 × rounds, slowest rank)."""
    ratios = [m / max(w, 1e-12) for m, w in zip(times[0], times[1])]
    med = statistics.median(ratios)
    n = len(ratios)
    mad = statistics.median(abs(r - med) for r in ratios)
    se = 1.253 * 1.4826 * mad / math.sqrt(n)          # standard error of a median (normal model)
    return Measurement(mpi_s=float(statistics.median(times[0])),
                       shm_s=float(statistics.median(times[1])), ratio=float(med),
                       low=float(med - 2 * se), high=float(med + 2 * se), rounds=n)


# -- the file, for `hpcasync tune` -------------------------------------------------------------

def cached(comm=None) -> dict[str, dict]:
    """The file's records (those of ``comm``'s size on this host when ``comm`` is given)."""
    records = _read(tune_file())
    if comm is None:
        return records
    prefix = f"{platform.node()}|"
    size = f"|n={comm.Get_size()}|"
    return {k: v for k, v in records.items() if k.startswith(prefix) and size in k}


def cached_choice(comm, nbytes: int, wire: torch.dtype) -> dict | None:
    """The file's record for this class on ``comm`` (not collective), or None."""
    rec = _read(tune_file()).get(_key(comm, size_class(nbytes), wire))
    return rec if isinstance(rec, dict) else None


def clear(comm=None) -> int:
    """Remove the file's records (of ``comm``'s size on this host when given) and this process's
    memory of them; returns how many records went."""
    path = tune_file()
    records = _read(path)
    gone = cached(comm) if comm is not None else dict(records)
    for k in gone:
        records.pop(k, None)
        _memory.pop(k, None)
    if path is not None and gone:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    return len(gone)


def describe(records: dict[str, dict]) -> str:
    """A markdown table of cached records."""
    lines = ["| host | MPI | ranks | wire | class | choice | MPI µs | window µs | MPI/window "
             "[interval] | rounds | confirmed | load | measured |", "|" + "---|" * 13]
    for key, rec in sorted(records.items(), key=lambda kv: (kv[0].split("|")[:5],
                                                            int(kv[0].rsplit("|", 1)[1]))):
        host, lib, n, _cores, kind, cls = key.split("|")
        lines.append(
            f"| {host} | {lib} | {n[2:]} | {kind}-bit | {_human(int(cls))} | "
            f"{'window' if rec.get('shm') else 'MPI'} | {_us(rec.get('mpi_s'))} | "
            f"{_us(rec.get('shm_s'))} | {_interval(rec)} | {rec.get('rounds', '–')} | "
            f"{'yes' if rec.get('confirmed') else '–'} | {_num(rec.get('load'))} | "
            f"{rec.get('measured', '–')} |")
    return "\n".join(lines)


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _us(seconds) -> str:
    return "–" if not isinstance(seconds, (int, float)) else f"{seconds * 1e6:.1f}"


def _num(value) -> str:
    return "–" if not isinstance(value, (int, float)) else f"{value:.2f}"


def _interval(rec: dict) -> str:
    if not isinstance(rec.get("ratio"), (int, float)):
        t_mpi, t_shm = rec.get("mpi_s"), rec.get("shm_s")
        return f"{t_mpi / t_shm:.2f}" if isinstance(t_mpi, float) and t_shm else "–"
    return f"{rec['ratio']:.2f} [{_num(rec.get('low'))}, {_num(rec.get('high'))}]"
