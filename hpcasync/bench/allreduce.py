"""``hpcasync bench allreduce``: MPI_Allreduce vs ours (flat, hierarchical) vs Horovod, with memcpy.

Run with several ranks (the committed table uses 4)::

    mpiexec -n 4 hpcasync bench allreduce [--sizes 4K 64K 1M 64M] [--iters 50] [--out FILE]

Per message size m (float32 elements, sum, in place) it measures:

* ``copy``: one process copying m bytes (``torch.Tensor.copy_``) from and to *cold* buffers (a
  rotation through buffers totalling >= 256 MiB, far more than any cache) while the other ranks
  sleep: this machine's single-core copy bandwidth B, in the same run;
* ``MPI``: ``MPI_Allreduce`` through mpi4py;
* ``ours``: :func:`hpcasync.comm.allreduce` with its default ``algorithm="auto"`` (MPI unless the
  window was measured >= 1.2x faster for the size class: :mod:`hpcasync.comm.tune`); the column
  ``auto`` says which it chose;
* ``window``: the same with ``algorithm="shm"`` (the shared-memory window forced);
* ``hier``: :func:`hpcasync.comm.hierarchical_allreduce` on 2 virtual nodes of size/2 ranks;
* ``hvd``: ``horovod.torch.allreduce_`` (Sum), when ``import horovod.torch`` works.

The physical bound: an in-place allreduce of m bytes over n ranks of one node must, per rank, at
least read the n pieces of its 1/n share (m bytes), write its reduced share (m/n), read all
reduced shares (m) and write them into its buffer (m): (3 + 1/n)·m bytes of memory traffic, while a
copy of m bytes moves 2m. So ``bound = (3 + 1/n)·m / (2B)`` seconds; a method's ``of bound`` is
bound / its time (1.00 = as fast as one core can move the bytes; ranks share the memory bus, so
reaching it is not expected).

Times are µs of one allreduce: an iteration's time is the slowest rank's (each iteration starts
after a barrier); a cell is the median over ``--iters`` iterations after 3 warm-up ones, fewer for
big messages (at most ``--budget-mb`` MiB moved per cell, and at least 5). Before timing, each
method's result on random data is checked against MPI_Allreduce's. Torch runs single-threaded.
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

    The methods take turns inside every iteration (each call after a barrier; the first to go
    and the buffer each method reduces rotate from one iteration to the next), so a burst of
    background load hits all of them alike instead of whichever happened to be running, and no
    method keeps a buffer whose pages happen to be faster (two identical MPI calls on two
    different 16 MiB buffers differed by 6-9 % here).
    """
    from mpi4py import MPI

    items = list(methods.items())
    tensors = [torch.zeros(nbytes // 4) for _ in items]              # zeros: no overflow
    times = np.empty((len(items), WARMUP + iters))
    for i in range(WARMUP + iters):
        for j in range(len(items)):    # rotate who goes first and which buffer each one gets:
            k = (i + j) % len(items)   # neither the position nor a buffer's pages favour anyone
            comm.Barrier()
            t0 = time.perf_counter()
            items[k][1](tensors[(k + i) % len(items)])
            times[k, i] = time.perf_counter() - t0
    slowest = np.ascontiguousarray(times[:, WARMUP:])
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

    data = torch.randn(numel, generator=torch.Generator().manual_seed(1234 + comm.Get_rank()))
    ref = data.double()
    comm.Allreduce(MPI.IN_PLACE, ref.numpy(), op=MPI.SUM)
    bad = []
    for name, fn in methods.items():
        t = data.clone()
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

    from ..comm import allreduce, hierarchical_allreduce
    from ..topology import Topology

    n = comm.Get_size()
    topo = Topology.build(comm, ranks_per_node=n // 2) if n % 2 == 0 else None
    from ..comm.tune import use_shm

    methods = {
        "mpi": lambda t: comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM),
        "ours": lambda t: allreduce(comm, t),
        "shm": lambda t: allreduce(comm, t, algorithm="shm"),
    }
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
                   "auto": "window" if use_shm(comm, nbytes, torch.float32) else "MPI"}
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


def format_table(rows: list[dict]) -> str:
    """Markdown table: µs per method, bound, ratios to MPI_Allreduce and to the bound."""
    has_hier = any("hier" in r for r in rows)
    has_hvd = any("hvd" in r for r in rows)
    head = ["size", "iters", "cold copy GB/s", "bound µs", "MPI_Allreduce µs", "ours µs", "auto",
            "window µs"]
    head += [f"hier {rows[0]['layout']} µs"] * has_hier + ["Horovod µs"] * has_hvd
    head += ["ours/MPI", "window/MPI"] + ["hier/MPI"] * has_hier + ["ours/Horovod"] * has_hvd
    head += ["MPI of bound", "ours of bound"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        b = r["bytes"]
        bound = bound_seconds(b, r["ranks"], r["memcpy"])

        def us(key):
            return "–" if r.get(key) is None else f"{r[key] * 1e6:.1f}"

        cells = [human(b), str(r["iters"]), f"{b / r['memcpy'] / 1e9:.2f}", f"{bound * 1e6:.1f}",
                 us("mpi"), us("ours"), r["auto"], us("shm")]
        cells += [us("hier")] * has_hier + [us("hvd")] * has_hvd
        cells += [f"{r['mpi'] / r['ours']:.2f}", f"{r['mpi'] / r['shm']:.2f}"]
        if has_hier:
            cells.append(f"{r['mpi'] / r['hier']:.2f}")
        if has_hvd:
            cells.append(f"{r['hvd'] / r['ours']:.2f}")
        cells += [f"{bound / r['mpi']:.2f}", f"{bound / r['ours']:.2f}"]
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
    hv = [r for r in rows if "hvd" in r]
    if hv:
        worst = min(hv, key=lambda r: r["hvd"] / r["ours"])
        out.append(f"ours vs Horovod: lowest ours/Horovod {worst['hvd'] / worst['ours']:.2f} "
                   f"at {human(worst['bytes'])}.")
    else:
        out.append("Horovod: not measured (`import horovod.torch` failed or --no-horovod).")
    return " ".join(out)


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
        "iterations; MPI, ours, window and hier take turns inside every iteration, Horovod runs "
        "in a pass of its own after them). bound = (3 + 1/n)·m bytes of traffic at the cold "
        "single-core copy bandwidth measured in the same run (`hpcasync.bench.allreduce` doc); "
        "'of bound' = bound / time. Ratios X/Y = time(Y) / time(X) (> 1: X is faster). auto = "
        "what the default chose for the size (`hpcasync.comm.tune`).", "",
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
