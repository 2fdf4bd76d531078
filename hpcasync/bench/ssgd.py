"""``hpcasync bench ssgd``: time per SSGD step — ours (overlapped and not) vs PyTorch DDP vs Horovod
vs compute only.

Run (the committed tables: 2 and 4 ranks, on an otherwise idle machine)::

    mpiexec -n 4 hpcasync bench ssgd [--models resnet20 lenet mlp] [--batch-size 32]
        [--steps 100] [--threads T] [--bucket-mb 0.25] [--out FILE]

Every method trains its own replica of the same model (same seed, same initial parameters) on the
same batches (seeded synthetic Fashion-MNIST-shaped images, different on each rank, the same for
every method), with SGD (lr 0.01, momentum 0.9), batch ``--batch-size`` per rank. One step =
``zero_grad``, forward, cross-entropy, backward, ``step()``. The methods take turns inside every
step (after an idle barrier), so a burst of load on the machine hits all of them alike:

* ``compute``: the same step with a plain local ``torch.optim.SGD`` — no communication (the bound);
* ``ours``: :class:`hpcasync.ssgd.DistributedOptimizer` (buckets reduced during backward);
* ``ours-no-overlap``: the same, ``overlap=False`` (the same buckets after backward);
* ``ours-test``: overlapped with ``progress="test"`` (nonblocking allreduces advanced from the
  hooks, no communication thread);
* ``facade``: ``hpcasync.horovod.DistributedOptimizer`` — a Horovod script's optimizer line run on
  hpcasync (the same bucket reducer as ``ours``, reached through Horovod's API);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel``, gloo backend, its defaults (25 MiB
  buckets, buffers broadcast from rank 0 at every forward); ``torch.distributed`` is initialised
  over TCP at rank 0's address, sent to the others over MPI;
* ``horovod``: ``horovod.torch.DistributedOptimizer`` (per-parameter hooks, fused by its background
  thread), when ``import horovod.torch`` works — in a pass of its own after the others (its
  background thread polls and would slow them), interleaved with a second ``compute`` column and
  a second ``facade`` column: ``Horovod/facade`` compares the two within that pass (steps taking
  turns), since a pass with fewer methods runs faster (warmer caches) than the first.

A step's time is the slowest rank's (the others wait for it at the next collective anyway); the
table gives the median over the timed steps. Ratios: ``X/compute`` = time(X) / time(compute)
(≥ 1; 1.05 = 5 % over the bound); ``DDP/ours`` and ``Horovod/ours`` = time(peer) / time(ours)
(> 1: ours is faster); ``Horovod/facade``, ``DDP/facade`` the same for the facade. Check line:
ours and ours-no-overlap must end bitwise equal (they run the same reductions on the same data),
and ours must stay close to DDP (same algorithm).

With ``--powersgd-rank R``, a pass of its own after the others (same turns, same batches):
``compute``, ``ours-powersgd`` (:class:`~hpcasync.ssgd.DistributedOptimizer` with
``compress=PowerSGD(rank=R, start_iter=2)``) and ``ddp-powersgd`` (DDP with torch's
``powerSGD_hook``, the same options, one bucket: with several, the hook's allreduces, issued from
callbacks of buckets in flight, can meet in different orders on different ranks and Gloo hangs,
seen with resnet20's two default buckets); ``DDP-hook/ours`` = time(DDP's) / time(ours), and the
largest parameter difference between the two after the timed steps (0 where the sums agree;
with ``--threads 1`` on a machine of more cores the hook's products, computed in Gloo's callback
thread at torch's default thread count, round differently from the main thread's: lenet at 2
ranks ends 2e-4 apart, bitwise at 2 threads).

Differences from the references: DDP's own benchmarks (``torch/distributed/benchmarks``) time
ResNet-50 on GPUs with NCCL; Horovod's ``pytorch_synthetic_benchmark.py`` reports images/s of one
method per run. Here all methods run in one job, step by step, on CPU.
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import socket
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from . import emit, idle_barrier
from ..errors import ConfigError, TopologyError

log = logging.getLogger(__name__)

MODELS = ("resnet20", "lenet", "mlp")
METHODS = ("compute", "ours", "ours-no-overlap", "ours-test", "facade", "ddp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: cores / ranks on the node)")
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="our gradient bucket size in MiB (default: the optimizer's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ddp", action="store_true", help="skip PyTorch DDP")
    parser.add_argument("--no-horovod", action="store_true", help="skip Horovod even if installed")
    parser.add_argument("--powersgd-rank", type=int, default=None,
                        help="also time PowerSGD of this rank: ours vs DDP's powerSGD_hook")
    parser.add_argument("--out", default=None, help="also write the markdown report to FILE")


def make_batches(args, rank: int, n: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` seeded synthetic batches of this rank (cycled through by every method)."""
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    return [(torch.randn(args.batch_size, 1, 28, 28, generator=g),
             torch.randint(0, 10, (args.batch_size,), generator=g)) for _ in range(n)]


def init_ddp(comm) -> None:
    """``torch.distributed`` (gloo) over TCP at rank 0's address, found and sent over MPI."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    addr = None
    if comm.Get_rank() == 0:
        host = socket.gethostbyname(socket.gethostname())
        with socket.socket() as s:
            s.bind(("", 0))
            addr = f"tcp://{host}:{s.getsockname()[1]}"
    addr = comm.bcast(addr, root=0)
    dist.init_process_group("gloo", init_method=addr, rank=comm.Get_rank(),
                            world_size=comm.Get_size())


class Method:
    """One replica and its step: ``step(x, y)`` = zero_grad, forward, loss, backward, step."""

    def __init__(self, name: str, model, opt, wrapped=None):
        self.name, self.model, self.opt = name, model, opt
        self.net = wrapped if wrapped is not None else model
        self.times: list[float] = []

    def step(self, x, y) -> None:
        self.opt.zero_grad()
        F.cross_entropy(self.net(x), y).backward()
        self.opt.step()

    def params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


def build(name: str, model_name: str, args, comm, hvd=None) -> Method:
    from ..comm import FlatModel
    from ..models import build_model
    from ..ssgd.optimizer import DistributedOptimizer

    torch.manual_seed(args.seed)                     # the same initial parameters everywhere
    model = build_model(model_name, (1, 28, 28), 10)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if name == "compute":
        return Method(name, model, sgd)
    if name in ("ours", "ours-no-overlap", "ours-test"):
        kw = {} if args.bucket_mb is None else {"bucket_bytes": max(4, int(args.bucket_mb * 2**20))}
        opt = DistributedOptimizer(sgd, FlatModel(model), comm.Dup(),
                                   overlap=name != "ours-no-overlap",
                                   progress="test" if name == "ours-test" else "thread", **kw)
        return Method(name, model, opt)
    if name == "facade":
        import hpcasync.horovod as facade

        facade.init()
        opt = facade.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        return Method(name, model, opt)
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return Method(name, model, sgd, DistributedDataParallel(model))
    if name == "horovod":
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        return Method(name, model, opt)
    if name == "ours-powersgd":
        from ..ssgd.powersgd import PowerSGD

        opt = DistributedOptimizer(sgd, FlatModel(model), comm.Dup(), overlap=False,
                                   compress=PowerSGD(rank=args.powersgd_rank, start_iter=2,
                                                     bucket_cap_mb=1024))
        return Method(name, model, opt)
    if name == "ddp-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, bucket_cap_mb=1024)     # one bucket: module doc
        ddp.register_comm_hook(hook.PowerSGDState(None, matrix_approximation_rank=args.powersgd_rank,
                                                  start_powerSGD_iter=2), hook.powerSGD_hook)
        return Method(name, model, sgd, ddp)
    raise ConfigError(f"unknown method {name!r}")


def time_turns(comm, methods: list[Method], batches, steps: int, warmup: int) -> None:
    """Run ``warmup + steps`` steps, the methods taking turns in each; fill ``Method.times``.
    The order of the turns is drawn afresh every step from one seeded generator that every rank
    shares (the same calls in the same order everywhere), so no method always follows the same
    other one (what the previous turn left in the caches and the allocator is not one method's
    luck)."""
    draw = np.random.default_rng(0)
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        for k in draw.permutation(len(methods)):
            m = methods[k]
            idle_barrier(comm, 0.0005)
            t0 = time.perf_counter()
            m.step(x, y)
            if i >= warmup:
                m.times.append(time.perf_counter() - t0)


def slowest_median(comm, times: list[float]) -> float:
    """Median over steps of the slowest rank's time, in ms."""
    from mpi4py import MPI

    arr = np.asarray(times, dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.MAX)
    return statistics.median(arr.tolist()) * 1e3


def measure_model(comm, model_name: str, args, names: list[str], batches, hvd=None) -> dict:
    methods = [build(n, model_name, args, comm, hvd) for n in names]
    time_turns(comm, methods, batches, args.steps, args.warmup)
    row = {m.name: slowest_median(comm, m.times) for m in methods}
    by = {m.name: m for m in methods}
    if "ours" in by and "ours-no-overlap" in by:
        row["bitwise"] = comm.allreduce(
            torch.equal(by["ours"].params(), by["ours-no-overlap"].params()), op=_land())
    for ours, ddp in (("ours", "ddp"), ("ours-powersgd", "ddp-powersgd")):
        if ours in by and ddp in by:
            row[f"{ddp}_diff"] = float((by[ours].params() - by[ddp].params()).abs().max())
    for m in methods:
        if hasattr(m.opt, "close"):
            m.opt.close()
    return row


def _land():
    from mpi4py import MPI
    return MPI.LAND


def load_horovod(comm, skip: bool):
    from .allreduce import load_horovod as load
    return load(comm, skip)


def ddp_available(comm, skip: bool) -> bool:
    import torch.distributed as dist
    ok = not skip and dist.is_available() and dist.is_gloo_available()
    return bool(comm.allreduce(ok, op=_land()))


def measure(comm, args) -> list[dict]:
    """One row per model: median ms/step (slowest rank) per method, plus the checks."""
    batches = make_batches(args, comm.Get_rank())
    names = ["compute", "ours", "ours-no-overlap", "ours-test", "facade"]
    if ddp_available(comm, args.no_ddp):
        init_ddp(comm)
        names.append("ddp")
    rows = []
    for model_name in args.models:
        row = measure_model(comm, model_name, args, names, batches)
        rows.append({"model": model_name, **row})
    if args.powersgd_rank and "ddp" in names:        # its own pass, as Horovod's
        for row in rows:
            h = measure_model(comm, row["model"], args,
                              ["compute", "ours-powersgd", "ddp-powersgd"], batches)
            row.update({"compute-psgd": h["compute"], "ours-powersgd": h["ours-powersgd"],
                        "ddp-powersgd": h["ddp-powersgd"],
                        "ddp-powersgd_diff": h["ddp-powersgd_diff"]})
    hvd = load_horovod(comm, args.no_horovod)
    if hvd is not None:              # its own pass: Horovod's background thread polls the CPU
        hvd.init(comm=comm)
        try:
            for row in rows:
                h = measure_model(comm, row["model"], args, ["compute", "facade", "horovod"],
                                  batches, hvd)
                row["horovod"], row["compute-hvd"] = h["horovod"], h["compute"]
                row["facade-hvd"] = h["facade"]
        finally:
            hvd.shutdown()
    return rows


def format_table(rows: list[dict]) -> str:
    has_ddp, has_hvd = "ddp" in rows[0], "horovod" in rows[0]
    head = ["model", "compute ms", "ours ms", "no-overlap ms", "ours-test ms", "facade ms"]
    head += ["DDP ms"] * has_ddp
    head += ["Horovod ms", "compute (Horovod pass) ms", "facade (Horovod pass) ms"] * has_hvd
    head += ["ours/compute", "no-overlap/compute", "ours-test/compute"] + ["DDP/ours"] * has_ddp
    head += ["Horovod/ours"] * has_hvd + ["DDP/facade"] * has_ddp + ["Horovod/facade"] * has_hvd
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], f"{r['compute']:.2f}", f"{r['ours']:.2f}",
                 f"{r['ours-no-overlap']:.2f}", f"{r['ours-test']:.2f}", f"{r['facade']:.2f}"]
        if has_ddp:
            cells.append(f"{r['ddp']:.2f}")
        if has_hvd:
            cells += [f"{r['horovod']:.2f}", f"{r['compute-hvd']:.2f}", f"{r['facade-hvd']:.2f}"]
        cells += [f"{r[k] / r['compute']:.3f}" for k in ("ours", "ours-no-overlap", "ours-test")]
        if has_ddp:
            cells.append(f"{r['ddp'] / r['ours']:.3f}")
        if has_hvd:
            cells.append(f"{r['horovod'] / r['ours']:.3f}")
        if has_ddp:
            cells.append(f"{r['ddp'] / r['facade']:.3f}")
        if has_hvd:
            cells.append(f"{r['horovod'] / r['facade-hvd']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine(comm, threads: int) -> str:
    from mpi4py import MPI

    cores = os.cpu_count() or 0
    ranks = comm.Get_size()
    over = " (oversubscribed)" if ranks * threads > cores else ""
    lib = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
    return (f"{ranks} ranks x {threads} torch thread(s) on {cores} cores{over}, "
            f"{platform.processor() or platform.machine()}, {lib}, torch {torch.__version__}")


def report(comm, rows, args, threads: int, load: float, load_after: float) -> str:
    checks = []
    for r in rows:
        if "bitwise" in r:
            checks.append(f"{r['model']}: ours == no-overlap bitwise: {r['bitwise']}"
                          + (f", max |ours - DDP| {r['ddp_diff']:.2g}" if "ddp_diff" in r else "")
                          + (f", max |ours - DDP| with PowerSGD {r['ddp-powersgd_diff']:.2g}"
                             if "ddp-powersgd_diff" in r else ""))
    return "\n".join([
        "# SSGD step benchmark", "",
        f"Command: `{command_line(comm, args)}`", "",
        f"Machine: {machine(comm, threads)}. 1-minute load average before the run: {load:.2f}, "
        f"after: {load_after:.2f} (the benchmark's own ranks count in the second).", "",
        f"ms per step (slowest rank, median of {args.steps} timed steps after {args.warmup} "
        f"warm-up; batch {args.batch_size} per rank; methods take turns in every step). "
        "X/compute = time ratio (≥ 1); DDP/ours, Horovod/ours = time(peer)/time(ours) "
        "(> 1: ours faster).", "",
        format_table(rows), "", *powersgd_table(rows, args),
        "Checks: " + "; ".join(checks), ""])


def powersgd_table(rows: list[dict], args) -> list[str]:
    """The PowerSGD pass's table (its own pass: compare within it)."""
    if "ours-powersgd" not in rows[0]:
        return []
    lines = [f"PowerSGD, rank {args.powersgd_rank} (a pass of its own):", "",
             "| model | compute ms | ours ms | DDP-hook ms | ours/compute | DDP-hook/ours |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['compute-psgd']:.2f} | {r['ours-powersgd']:.2f} | "
                     f"{r['ddp-powersgd']:.2f} | {r['ours-powersgd'] / r['compute-psgd']:.3f} | "
                     f"{r['ddp-powersgd'] / r['ours-powersgd']:.3f} |")
    return lines + [""]


def command_line(comm, args) -> str:
    from ..launch import shown_mpiexec

    argv = ["--models", *args.models, "--batch-size", str(args.batch_size),
            "--steps", str(args.steps), "--warmup", str(args.warmup)]
    argv += ["--threads", str(args.threads)] if args.threads else []
    argv += ["--bucket-mb", str(args.bucket_mb)] if args.bucket_mb is not None else []
    argv += ["--no-ddp"] * bool(args.no_ddp) + ["--no-horovod"] * bool(args.no_horovod)
    argv += ["--powersgd-rank", str(args.powersgd_rank)] if args.powersgd_rank else []
    return f"{shown_mpiexec(comm.Get_size())} hpcasync bench ssgd {' '.join(argv)}"


def run(args: argparse.Namespace, comm=None) -> int:
    """``hpcasync bench ssgd`` (every rank calls it); rank 0 prints the table."""
    from ..topology import init_mpi

    for opt in ("batch_size", "steps"):
        if getattr(args, opt) < 1:
            raise ConfigError(f"--{opt.replace('_', '-')} must be >= 1, got {getattr(args, opt)}")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {args.warmup}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    if args.powersgd_rank is not None and args.powersgd_rank < 1:
        raise ConfigError(f"--powersgd-rank must be >= 1, got {args.powersgd_rank}")
    if args.bucket_mb is not None and not args.bucket_mb > 0:
        raise ConfigError(f"--bucket-mb must be > 0, got {args.bucket_mb}")
    MPI = init_mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm.Get_size() < 2:
        raise TopologyError("the SSGD benchmark needs at least 2 ranks "
                            "(mpiexec -n 2 hpcasync bench ssgd)")
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    threads = args.threads or max(1, (os.cpu_count() or 1) // local)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    load_before = os.getloadavg()[0]
    try:
        rows = measure(comm, args)
    finally:
        torch.set_num_threads(old)
    if comm.Get_rank() == 0:
        text = report(comm, rows, args, threads, load_before, os.getloadavg()[0])
        emit(text, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone: ``mpiexec -n 4 python -m hpcasync.bench.ssgd [options]``."""
    from . import standalone

    return standalone(sys.modules[__name__], "hpcasync bench ssgd", "SSGD step benchmark (see module docstring)", argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
