"""What ``algorithm="auto"`` means: per message size, ``MPI_Allreduce`` unless our shared-memory
window was *measured* to beat it clearly on this machine, with this many ranks.

Why measure: which one wins depends on the machine, not on a constant. On a 2-core box with a core
per rank Open MPI's own shared-memory allreduce beat the window at every size up to 16 MiB
(window/MPI 0.55-0.88, issue 14's table), while with 4 ranks on the same 2 cores the window won
1.3-3.5x from 256 KiB. A fixed threshold is wrong in one of the two.

Decision, per (communicator, size class, wire kind): the size class is the message size rounded up
to a power of two between 4 KiB and 64 MiB (bigger messages go in 64 MiB pieces anyway); the wire
kind is 32/64-bit or 16-bit (16-bit MPI sums run a user-defined op, so they are measured apart).
At the first message of a class, every rank of the communicator runs rounds of one MPI and one
window reduction of a scratch buffer of the class size (the two take turns, after a barrier each;
3 warm-up rounds, then 40 timed rounds for small classes, fewer for big ones, at least 5: about
0.1 s per class at most on this machine, 64 MiB aside). The median per method of the slowest rank decides:
the window only if ``t_mpi >= WIN * t_shm``, else MPI. Since the times are combined with
``MPI_MAX`` every rank reaches the same decision without a further message.

Reproducibility: the choice changes the summation order (window: rank order; MPI: its tree), so a
run that re-measured differently could differ in the last bits from an earlier one. Decisions are
therefore written to a small JSON file (:func:`tune_file`: ``$HPCASYNC_TUNE_FILE``, default
``~/.cache/hpcasync/allreduce-auto.json``; ``none`` keeps them in memory only) keyed by host, MPI
library, communicator size and core count, and later runs -- a resumed job, the next test -- read
them instead of measuring. ``HPCASYNC_ALLREDUCE=mpi|shm`` forces the choice of ``auto``.

Example::

    from hpcasync.comm.tune import use_shm
    use_shm(topo.local, 4 << 20, torch.float32)   # collective on first use of the class; cached
"""
from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from ..errors import ConfigError
from ..launch import ft_requested
from .cache import comm_cache
from .ops import HALF_DTYPES

log = logging.getLogger(__name__)

WIN = 1.2                       # the window must be at least this much faster to be chosen
ROUNDS = (5, 40)                # timed rounds per method: 40 for small classes, down to 5
BUDGET = 64 << 20               # ... so that a method moves at most this many bytes
WARMUP = 3                      # untimed rounds first (page faults of a new window, caches)
MIN_CLASS = 4 << 10
MAX_CLASS = 64 << 20
_memory: dict[str, bool] = {}   # decisions of this process (``tune_file`` "none", or not yet read)


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
        forced = os.environ.get("HPCASYNC_ALLREDUCE", "").lower()
        if forced and forced not in ("mpi", "shm"):
            raise ConfigError(f"HPCASYNC_ALLREDUCE must be mpi or shm, got {forced!r}")
        hit = decisions[(cls, half)] = (forced == "shm") if forced else _decide(comm, cls, wire)
    return hit


def _decide(comm, cls: int, wire: torch.dtype) -> bool:
    key = _key(comm, cls, wire)
    path = tune_file()
    known = None
    if comm.Get_rank() == 0:
        known = _memory.get(key)
        if known is None:
            rec = _read(path).get(key)
            known = rec.get("shm") if isinstance(rec, dict) else None
    known = comm.bcast(known, root=0)
    if known is not None:
        return bool(known)
    t_mpi, t_shm = measure(comm, cls, wire)
    shm = bool(t_mpi >= WIN * t_shm)
    _memory[key] = shm
    if comm.Get_rank() == 0:
        _write(path, key, {"shm": shm, "mpi_s": t_mpi, "shm_s": t_shm,
                           "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "load": os.getloadavg()[0]})
    log.info("allreduce auto, %d ranks, %d-byte class: %s (MPI %.1f us, window %.1f us)",
             comm.Get_size(), cls, "window" if shm else "MPI", t_mpi * 1e6, t_shm * 1e6)
    return shm


def measure(comm, nbytes: int, wire: torch.dtype, rounds: int | None = None) -> tuple[float, float]:
    """(MPI, window) seconds of one reduction of ``nbytes`` of ``wire``: median over ``rounds``
    of the slowest rank (collective)."""
    if rounds is None:
        rounds = max(ROUNDS[0], min(ROUNDS[1], BUDGET // max(nbytes, 1)))
    import numpy as np
    from mpi4py import MPI

    from .handle import run_blocking
    from .ops import mpi_buffer, sum_op
    from .shm import ShmAllreduce

    engine = ShmAllreduce.for_comm(comm)
    scratch = torch.zeros(max(1, nbytes // wire.itemsize), dtype=wire)
    buf, op = mpi_buffer(scratch), sum_op(wire)      # MPI as allreduce()'s direct path calls it
    times = np.zeros((2, rounds))
    for i in range(WARMUP + rounds):
        for k in range(2):
            comm.Barrier()
            t0 = time.perf_counter()
            if k == 0:
                comm.Allreduce(MPI.IN_PLACE, buf, op=op)
            else:
                run_blocking(engine.steps(scratch, wire=wire))
            if i >= WARMUP:
                times[k, i - WARMUP] = time.perf_counter() - t0
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return float(statistics.median(times[0])), float(statistics.median(times[1]))
