"""``hpcasync bench allreduce``: MPI_Allreduce vs ours (auto, window, persistent, hierarchical) vs
Horovod, beside a memory-bandwidth bound, in µs and as bus bandwidth.

Per message size m (float32 sum, in place, n ranks), µs of one allreduce (slowest rank, median of
``--iters``; the methods take turns inside every iteration): ``MPI`` (``MPI_Allreduce``), ``ours``
(:func:`hpcasync.comm.allreduce`, ``auto``), ``window`` (the shared-memory window forced),
``persistent`` (``MPI_Allreduce_init`` once, then Start/Wait: :mod:`hpcasync.comm.persistent`),
``hier`` (2 virtual nodes), ``hvd`` (Horovod, when it imports). The bound column is
``(3 + 1/n)·m / (2B)``: an in-place allreduce's memory traffic at the cold single-core copy
bandwidth B measured in the same run ("of bound" = bound / time). ``busbw = (m / t)·2(n−1)/n``
(nccl-tests' bus bandwidth). The derivation and the timing rules: docs/design/comm.md.

Example (the committed tables use 4 ranks)::

    mpiexec -n 4 hpcasync bench allreduce [--sizes 4K 64K 1M 64M] [--iters 50] [--out FILE]
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from . import emit, idle_barrier
from ..errors import ConfigError, TopologyError

log = logging.getLogger(__name__)

DEFAULT_SIZES = ["4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M"]
WARMUP = 3
TARGET = 0.97                     # the goal: ours >= 0.97x MPI_Allreduce at every size
COLD_POOL = 256 << 20             # bytes of buffers the cold copy rotates through
# Open MPI variables that mpiexec itself sets in every process (not the user's settings)
_LAUNCHER_SET = {"OMPI_MCA_PREFIXES", "OMPI_MCA_num_procs", "OMPI_MCA_initial_wdir",
                 "OMPI_MCA_cpu_type"}


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536 bytes (K, M, G = KiB, MiB, GiB); a positive multiple of 4 bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        value = int(raw[:-1]) * units[raw[-1]] if raw and raw[-1] in units else int(raw)
    except ValueError:
        raise ConfigError(f"--sizes: cannot read {text!r} (use e.g. 4K, 64K, 1M, 64M)") from None
    if value < 4 or value % 4:
        raise ConfigError(f"--sizes: {text!r} is not a positive multiple of 4 bytes")
    return value


def human(nbytes: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, metavar="SIZE",
                        help="message sizes, e.g. 4K 64K 1M 64M (default: 4K 16K ... 64M)")
    parser.add_argument("--iters", type=int, default=100,
                        help="timed iterations per cell, fewer for big messages (default 100)")
    parser.add_argument("--budget-mb", type=int, default=1024,
                        help="at most this many MiB moved per timed cell (default 1024)")
    parser.add_argument("--no-horovod", action="store_true", help="skip Horovod even if installed")
    parser.add_argument("--out", default=None, help="also write the markdown report to FILE")


# -- timing ------------------------------------------------------------------------------------
def time_interleaved(comm, methods: dict, nbytes: int, iters: int) -> dict[str, float]:
    """Median over iterations of the slowest rank's seconds per method.

    The methods take turns inside every iteration (each call after a barrier; the order and the
    buffer each method reduces are drawn afresh every iteration, from one seeded generator that
    every rank shares), so a burst of background load hits all of them alike instead of
    whichever happened to be running, no method keeps a buffer whose pages happen to be faster,
    and no method always follows the same other one on the same buffer (a fixed rotation would
    hand one method the buffer another had just written, every iteration). Why, with figures:
    docs/design/comm.md.
    """
    from mpi4py import MPI

    from ..comm import persistent

    items = list(methods.items())
    tensors = [persistent.register(torch.zeros(nbytes // 4)) for _ in items]   # zeros: no overflow
    warmup = max(WARMUP, len(items))   # every method has met every buffer before timing
    times = np.empty((len(items), warmup + iters))
    draw = np.random.default_rng(0)    # the same draws on every rank: the same calls in turn
    for i in range(warmup + iters):
        order, buffers = draw.permutation(len(items)), draw.permutation(len(items))
        for k in order:
            comm.Barrier()
            t0 = time.perf_counter()
            items[k][1](tensors[buffers[k]])
            times[k, i] = time.perf_counter() - t0
    slowest = np.ascontiguousarray(times[:, warmup:])
    comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
    return {name: float(np.median(slowest[k])) for k, name in enumerate(methods)}


def time_memcpy(comm, nbytes: int, iters: int) -> float:
    """Rank 0 copies ``nbytes`` between cold buffers (rotating through :data:`COLD_POOL` bytes)
    while the other ranks sleep; every rank gets the median seconds."""
    median = 0.0
    if comm.Get_rank() == 0:
        count = max(2, COLD_POOL // nbytes)
        pool = torch.ones(count * nbytes // 4)
        bufs = pool.view(count, nbytes // 4)
        times = []
        for i in range(WARMUP + iters):
            src, dst = bufs[(2 * i) % count], bufs[(2 * i + 1) % count]
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        median = statistics.median(times[WARMUP:])
        del pool, bufs
    idle_barrier(comm)
    return comm.bcast(median, root=0)


def bound_seconds(nbytes: int, ranks: int, copy_seconds: float) -> float:
    """The physical bound of one allreduce (module doc): (3 + 1/n)·m bytes at 2m per copy."""
    return (3 + 1 / ranks) * copy_seconds / 2


def verify(comm, methods: dict, numel: int) -> None:
    """Each method's sum of random data must equal MPI_Allreduce's in float64 (to rounding)."""
    from mpi4py import MPI

    from ..comm import persistent

    data = torch.randn(numel, generator=torch.Generator().manual_seed(1234 + comm.Get_rank()))
    ref = data.double()
    comm.Allreduce(MPI.IN_PLACE, ref.numpy(), op=MPI.SUM)
    bad = []
    for name, fn in methods.items():
        t = persistent.register(data.clone())          # (the persistent path needs it)
        fn(t)
        if not torch.allclose(t.double(), ref, rtol=1e-5, atol=1e-4):
            bad.append(name)
    bad = sorted(set(comm.allreduce(bad)))
    if bad:
        raise RuntimeError(f"allreduce benchmark: wrong results from {', '.join(bad)}")


def load_horovod(comm, skip: bool):
    """``horovod.torch`` if it imports on every rank, else None (not initialised yet)."""
    from mpi4py import MPI

    hvd = None
    if not skip:
        try:
            import horovod.torch as hvd
        except Exception as exc:  # ImportError, or a Horovod built against another MPI/torch
            log.info("horovod unavailable: %s", exc)
            hvd = None
    return hvd if comm.allreduce(hvd is not None, op=MPI.LAND) else None


def measure(comm, sizes: list[int], *, iters: int, budget_bytes: int, hvd=None) -> list[dict]:
    """One row per size: ``bytes``, ``iters``, ``layout`` and seconds per method.

    Horovod is measured last, in its own pass: once initialised, its background thread runs a
    coordination cycle every few milliseconds and would slow every other method down.
    """
    from mpi4py import MPI

    from ..comm import allreduce, hierarchical_allreduce, persistent
    from ..topology import Topology

    n = comm.Get_size()
    topo = Topology.build(comm, ranks_per_node=n // 2) if n % 2 == 0 else None
    from ..comm.tune import cached_choice, use_shm

    def auto_choice(nbytes: int) -> dict:
        """What auto chose for the size (``auto``), and where the choice came from
        (``auto_from``): the tune file (its date), or measured now (none there, or the cached
        one was stale or failed its check)."""
        before = cached_choice(comm, nbytes, torch.float32) if comm.Get_rank() == 0 else None
        chosen = "window" if use_shm(comm, nbytes, torch.float32) else "MPI"
        after = cached_choice(comm, nbytes, torch.float32) if comm.Get_rank() == 0 else None
        cached = (before is not None and after is not None
                  and before.get("time") == after.get("time"))
        source = f"cached {str(before.get('measured', '?'))[:10]}" if cached else "measured now"
        return {"auto": chosen, "auto_from": comm.bcast(source, root=0)}

    methods = {
        "mpi": lambda t: comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM),
        "ours": lambda t: allreduce(comm, t),
        "shm": lambda t: allreduce(comm, t, algorithm="shm"),
    }
    if persistent.supported():
        methods["persistent"] = lambda t: persistent.allreduce(comm, t)
    if topo is not None:
        methods["hier"] = lambda t: hierarchical_allreduce(topo, t)
    layout = f"{topo.num_nodes}×{topo.local_size}" if topo is not None else ""
    rows = []
    try:
        for nbytes in sizes:
            cell_iters = max(5, min(iters, budget_bytes // nbytes))
            verify(comm, methods, nbytes // 4)
            row = {"bytes": nbytes, "iters": cell_iters, "layout": layout, "ranks": n,
                   "memcpy": time_memcpy(comm, nbytes, cell_iters),
                   **auto_choice(nbytes)}
            row.update(time_interleaved(comm, methods, nbytes, cell_iters))
            rows.append(row)
            log.info("allreduce bench: %s done", human(nbytes))
    finally:
        if topo is not None:
            topo.free()
    if hvd is not None:
        hvd.init(comm=comm)
        try:
            horovod = {"hvd": lambda t: hvd.allreduce_(t, op=hvd.Sum, name=f"bench.{t.numel()}")}
            for row in rows:
                verify(comm, horovod, row["bytes"] // 4)
                row.update(time_interleaved(comm, horovod, row["bytes"], row["iters"]))
        finally:
            hvd.shutdown()
    return rows


# -- report ------------------------------------------------------------------------------------
def _gbps(nbytes: int, seconds: float | None) -> float | None:
    return None if not seconds else nbytes / seconds / 1e9


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s: message bytes / time (nccl-tests' ``algbw``)."""
    return nbytes / seconds / 1e9


def busbw(nbytes: int, seconds: float, ranks: int) -> float:
    """Bus bandwidth in GB/s of an allreduce: algbw · 2(n-1)/n (nccl-tests' ``busbw``), the
    rate each rank's link would need for a bandwidth-optimal ring; comparable across n."""
    return algbw(nbytes, seconds) * 2 * (ranks - 1) / ranks


def table_head(rows: list[dict]) -> list[str]:
    """The column names of :func:`format_table` (optional methods only where measured)."""
    has = {k: any(k in r for r in rows) for k in ("persistent", "hier", "hvd")}
    head = ["size", "iters", "cold copy GB/s", "bound µs", "MPI_Allreduce µs", "ours µs", "auto",
            "window µs"]
    head += ["persistent µs"] * has["persistent"]
    head += [f"hier {rows[0]['layout']} µs"] * has["hier"] + ["Horovod µs"] * has["hvd"]
    head += ["ours/MPI", "window/MPI"] + ["persistent/MPI"] * has["persistent"]
    head += ["hier/MPI"] * has["hier"] + ["ours/Horovod"] * has["hvd"]
    head += ["MPI of bound", "ours of bound", "MPI busbw GB/s", "ours busbw GB/s"]
    return head + ["persistent busbw GB/s"] * has["persistent"]


def format_table(rows: list[dict]) -> str:
    """Markdown table: µs per method, bound, ratios to MPI_Allreduce and to the bound, busbw."""
    has_pers = any("persistent" in r for r in rows)
    has_hier = any("hier" in r for r in rows)
    has_hvd = any("hvd" in r for r in rows)
    head = table_head(rows)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        b, n = r["bytes"], r["ranks"]
        bound = bound_seconds(b, n, r["memcpy"])

        def us(key):
            return "–" if r.get(key) is None else f"{r[key] * 1e6:.1f}"

        def ratio(key):
            return "–" if r.get(key) is None else f"{r['mpi'] / r[key]:.2f}"

        def bus(key):
            return "–" if r.get(key) is None else f"{busbw(b, r[key], n):.2f}"

        cells = [human(b), str(r["iters"]), f"{b / r['memcpy'] / 1e9:.2f}", f"{bound * 1e6:.1f}",
                 us("mpi"), us("ours"), f"{r['auto']} ({r.get('auto_from', '?')})", us("shm")]
        cells += [us("persistent")] * has_pers
        cells += [us("hier")] * has_hier + [us("hvd")] * has_hvd
        cells += [ratio("ours"), ratio("shm")] + [ratio("persistent")] * has_pers
        if has_hier:
            cells.append(ratio("hier"))
        if has_hvd:
            cells.append(f"{r['hvd'] / r['ours']:.2f}")
        cells += [f"{bound / r['mpi']:.2f}", f"{bound / r['ours']:.2f}", bus("mpi"), bus("ours")]
        cells += [bus("persistent")] * has_pers
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Facts about the targets (ours >= 0.97x MPI_Allreduce at every size; ours > Horovod)."""
    out = []
    if rows:
        worst = min(rows, key=lambda r: r["mpi"] / r["ours"])
        verdict = "met" if worst["mpi"] / worst["ours"] >= TARGET else "NOT met"
        out.append(f"ours >= {TARGET}x MPI_Allreduce at every size: {verdict} (lowest ours/MPI "
                   f"{worst['mpi'] / worst['ours']:.2f} at {human(worst['bytes'])}).")
        wins = [human(r["bytes"]) for r in rows if r["mpi"] / r["shm"] >= 1.2]
        out.append(f"window >= 1.2x MPI at: {', '.join(wins) or 'no size'}.")
        chose = [r for r in rows if r["auto"] == "window"]
        if chose:
            lo = min(chose, key=lambda r: r["mpi"] / r["ours"])
            out.append(f"where auto chose the window ({', '.join(human(r['bytes']) for r in chose)})"
                       f": lowest ours/MPI {lo['mpi'] / lo['ours']:.2f} at {human(lo['bytes'])}.")
        wrong = [human(r["bytes"]) for r in rows if _wrong_choice(r)]
        out.append(f"auto's choice slower than the other method by > 3 % in this run at: "
                   f"{', '.join(wrong) or 'no size'}.")
        pers = [r for r in rows if r.get("persistent")]
        if pers:
            lo = min(pers, key=lambda r: r["mpi"] / r["persistent"])
            hi = max(pers, key=lambda r: r["mpi"] / r["persistent"])
            out.append(f"persistent/MPI from {lo['mpi'] / lo['persistent']:.2f} "
                       f"({human(lo['bytes'])}) to {hi['mpi'] / hi['persistent']:.2f} "
                       f"({human(hi['bytes'])}).")
    hv = [r for r in rows if "hvd" in r]
    if hv:
        worst = min(hv, key=lambda r: r["hvd"] / r["ours"])
        out.append(f"ours vs Horovod: lowest ours/Horovod {worst['hvd'] / worst['ours']:.2f} "
                   f"at {human(worst['bytes'])}.")
    else:
        out.append("Horovod: not measured (`import horovod.torch` failed or --no-horovod).")
    return " ".join(out)


def _wrong_choice(row: dict) -> bool:
    """auto's choice was slower than the other method by more than 3 % in this run."""
    faster = row["mpi"] / row["shm"]            # > 1: the window was faster
    return faster < 1 / 1.03 if row["auto"] == "window" else faster > 1.03


def machine(comm) -> str:
    from mpi4py import MPI

    cores = os.cpu_count() or 0
    ranks = comm.Get_size()
    over = " (oversubscribed: more ranks than cores)" if ranks > cores else ""
    lib = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
    return (f"{ranks} ranks on {cores} cores{over}, {platform.machine()}, {lib}, "
            f"mpi4py {__import__('mpi4py').__version__}, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def report(comm, rows: list[dict], command: str, load: float | None = None,
           load_after: float | None = None) -> str:
    busy = "" if load is None else (
        f" 1-minute load average before the run: {load:.2f}, after: {load_after:.2f} (the "
        f"benchmark's own ranks count in the second; anything else competes for the same cores).")
    return "\n".join([
        "# Allreduce benchmark", "",
        f"Command: `{command}`", "",
        f"Machine: {machine(comm)}.{busy}", "",
        "µs of one in-place float32 sum allreduce (slowest rank, median of the timed "
        "iterations; MPI, ours, window, persistent (MPI_Allreduce_init once, then Start/Wait) "
        "and hier take turns inside every iteration, Horovod runs in a pass of its own after "
        "them). bound = (3 + 1/n)·m bytes of traffic at the cold single-core copy bandwidth "
        "measured in the same run (`hpcasync.bench.allreduce` doc); 'of bound' = bound / time. "
        "Ratios X/Y = time(Y) / time(X) (> 1: X is faster). busbw = (m / time)·2(n−1)/n GB/s "
        "(nccl-tests' bus bandwidth). auto = what the default chose for the size "
        "(`hpcasync.comm.tune`) and whether that choice was read from the tune file (cached, "
        "its date) or measured in this run.", "",
        format_table(rows), "",
        summary(rows), ""])


def run(args: argparse.Namespace, comm=None) -> int:
    """``hpcasync bench allreduce`` (every rank calls it); rank 0 prints the table."""
    from ..topology import init_mpi

    sizes = [parse_size(s) for s in args.sizes]          # options first: before MPI starts
    if args.iters < 1:
        raise ConfigError(f"--iters must be >= 1, got {args.iters}")
    if args.budget_mb < 1:
        raise ConfigError(f"--budget-mb must be >= 1, got {args.budget_mb}")
    MPI = init_mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm.Get_size() < 2:
        raise TopologyError("the allreduce benchmark needs at least 2 ranks "
                            "(mpiexec -n 4 hpcasync bench allreduce)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    try:
        hvd = load_horovod(comm, args.no_horovod)
        rows = measure(comm, sizes, iters=args.iters, budget_bytes=args.budget_mb << 20, hvd=hvd)
    finally:
        torch.set_num_threads(threads)
    if comm.Get_rank() == 0:
        text = report(comm, rows, command_line(comm, args), load_before, os.getloadavg()[0])
        emit(text, args.out)
    return 0


def command_line(comm, args: argparse.Namespace) -> str:
    """The command that reproduces this run, with the Open MPI settings of its environment."""
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                   if k.startswith("OMPI_MCA_") and k not in _LAUNCHER_SET)
    argv = ["--sizes", *args.sizes, "--iters", str(args.iters), "--budget-mb", str(args.budget_mb)]
    argv += ["--no-horovod"] * bool(args.no_horovod)
    from ..launch import shown_mpiexec

    return (f"{env + ' ' if env else ''}{shown_mpiexec(comm.Get_size())} "
            f"hpcasync bench allreduce {' '.join(argv)}")


def main(argv: list[str] | None = None) -> int:
    """Standalone: ``mpiexec -n 4 python -m hpcasync.bench.allreduce [options]``."""
    from . import standalone

    return standalone(sys.modules[__name__], "hpcasync bench allreduce", "allreduce benchmark (see module docstring)", argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
