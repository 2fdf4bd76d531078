"""``hpcasync bench daso``: DASO vs SSGD (own) vs Horovod SSGD — time per epoch, time to accuracy.

Run with 4 ranks, grouped as 2 virtual nodes of 2 (the committed table)::

    mpiexec -n 4 hpcasync bench daso [--epochs 6] [--train-limit 30000] [--targets 0.84 0.85]
        [--delays 0 50000] [--out FILE]

Every method trains the same model from the same seed on the same shards (``shard_indices`` with
the same seed and epoch), with the same SGD hyperparameters, for ``--epochs`` epochs; after each
epoch the (identical) replicas are evaluated on the test set, outside the timed region. A method's
epoch time is the slowest rank's; time to target = the summed epoch times up to the first epoch
whose test accuracy reaches each of ``--targets`` (epoch granularity).

Methods:

* ``daso``: :class:`hpcasync.daso.DASO` (node-local gradient averages, one global group per
  ``global_skip`` batches, bf16 global messages); the bench defaults to 1 warm-up and 1 cool-down
  epoch (the paper's 4 + 4 would make a short run all blocking);
* ``ssgd``: own SSGD, :class:`hpcasync.ssgd.DistributedOptimizer` (flat allreduce over all
  ranks, float32) — as ``hpcasync train --algorithm ssgd``;
* ``ssgd-hier``: own SSGD through :func:`hpcasync.comm.hierarchical_allreduce` (node reduce-scatter,
  across-node allreduce, node allgather; float32);
* ``horovod``: Horovod's ``DistributedOptimizer`` on all ranks (float32), when installed.

Emulated slow inter-node link (``--delays``, µs per 10^6 bytes; 0 = none): every collective that
crosses nodes sleeps d µs per 10^6 bytes of its message, counted once per node (see
:class:`hpcasync.daso.LinkDelay`). DASO: its global sends (bf16: 2 bytes/element; the sleep only
covers what is left when the message is completed, B batches after the send) and its blocking
global averages. ``ssgd-hier``: its across-node stage, 4 bytes × gradient elements per step.
``horovod``: the same 4 bytes × gradient elements per step, slept after its allreduce. ``ssgd``'s
flat allreduce cannot be charged per cross-node byte, so it runs only at delay 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.nn.functional as F

from . import emit, idle_barrier
from ..errors import ConfigError

log = logging.getLogger(__name__)

METHODS = ("daso", "ssgd", "ssgd-hier", "horovod")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--train-limit", type=int, default=30000,
                        help="first N training images (default 30000: half of Fashion-MNIST)")
    parser.add_argument("--test-limit", type=int, default=None)
    parser.add_argument("--model", default="lenet")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.84, 0.85, 0.86, 0.87],
                        help="test accuracies to reach (default 0.84 0.85 0.86 0.87)")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 50000.0],
                        help="emulated link delays, µs per 10^6 bytes (default 0 50000)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--daso-warmup-epochs", type=int, default=1)
    parser.add_argument("--daso-cooldown-epochs", type=int, default=1)
    parser.add_argument("--daso-global-skip", type=int, default=4)
    parser.add_argument("--daso-batches-to-wait", type=int, default=1)
    parser.add_argument("--daso-cast", choices=("none", "bf16", "fp16"), default="bf16")
    parser.add_argument("--out", default=None, help="also write the markdown report to FILE")


# -- the methods -------------------------------------------------------------------------------
def _ssgd_hier(optimizer, flat, topo, delay):
    from ..comm import hierarchical_allreduce
    from ..ssgd.optimizer import DistributedOptimizer

    class HierarchicalSSGD(DistributedOptimizer):
        def synchronize(self):
            t0 = time.perf_counter()
            hierarchical_allreduce(topo, self.flat.grads, average=True)
            delay.block(self.flat.grads.numel() * 4)
            self.comm_time += time.perf_counter() - t0
            self._synchronized = True

    return HierarchicalSSGD(optimizer, flat, topo.world)


def _horovod(optimizer, model, topo, delay):
    from ..ssgd.horovod import HorovodOptimizer

    class DelayedHorovod(HorovodOptimizer):
        def step(self):
            result = super().step()
            delay.block(self.numel * 4)
            return result

    return DelayedHorovod(optimizer, model, topo.world)


def build(method: str, model, topo, args, delay_us: float, nbatches: int):
    """(optimizer wrapper, per-epoch-end callable) for ``method``."""
    from ..comm import FlatModel
    from ..daso import DASO, LinkDelay
    from ..ssgd.optimizer import DistributedOptimizer

    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    delay = LinkDelay(delay_us)
    if method == "horovod":
        return _horovod(sgd, model, topo, delay)
    flat = FlatModel(model)
    if method == "daso":
        return DASO(sgd, flat, topo, total_epochs=args.epochs, batches_per_epoch=nbatches,
                    warmup_epochs=args.daso_warmup_epochs,
                    cooldown_epochs=args.daso_cooldown_epochs,
                    global_skip=args.daso_global_skip, batches_to_wait=args.daso_batches_to_wait,
                    max_global_skips=max(8, args.daso_global_skip), cast=args.daso_cast,
                    link_delay_us_per_mb=delay_us)
    if method == "ssgd":
        return DistributedOptimizer(sgd, flat, topo.world)
    return _ssgd_hier(sgd, flat, topo, delay)


def train_epochs(method: str, topo, train, test, args, delay_us: float):
    """Train ``method`` for ``args.epochs`` epochs, yielding its result dict after each epoch
    (per-epoch times of the slowest rank, test accuracy), so runs can be interleaved by epoch."""
    from mpi4py import MPI

    from ..data import batches, shard_indices
    from ..models import build_model
    from ..runtime.context import evaluate

    torch.manual_seed(args.seed)
    model = build_model(args.model, train.input_shape, train.num_classes)
    nbatches = len(train) // topo.size // args.batch_size
    opt = build(method, model, topo, args, delay_us, nbatches)
    opt.broadcast_parameters(root=0)
    out = {"method": method, "delay": delay_us, "epoch_s": [], "acc": [], "loss": [],
           "global_wait_s": 0.0, "phases": []}
    for epoch in range(1, args.epochs + 1):
        indices = shard_indices(len(train), shard_index=topo.rank, num_shards=topo.size,
                                seed=args.seed, epoch=epoch)
        idle_barrier(topo.world, 0.002)
        t0 = time.perf_counter()
        loss_sum = 0.0
        model.train()
        for x, y in batches(train, indices, args.batch_size):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            loss_sum += loss.item()
        if method == "daso":
            rec = opt.epoch_end(loss_sum / nbatches)
            out["global_wait_s"] += topo.world.allreduce(rec["daso_global_wait_s"], op=MPI.MAX)
            phase = rec["daso_phase"]
            out["phases"].append(f"gs{rec['daso_global_skip']}" if phase == "cycling"
                                 else phase[:4])
        else:
            opt.average_buffers()
        elapsed = topo.world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        _, acc = evaluate(model, test, topo.world)
        out["epoch_s"].append(elapsed)
        out["acc"].append(acc)
        out["loss"].append(topo.world.allreduce(loss_sum / nbatches) / topo.size)
        if topo.rank == 0:
            log.warning("bench daso: %s delay %g: epoch %d %.2f s, accuracy %.4f", method,
                        delay_us, epoch, elapsed, acc)
        yield out


def interleaved(runs) -> list[dict]:
    """Advance the ``train_epochs`` generators one epoch each, in turn, to the end: a burst of
    load from elsewhere on a shared machine then hits every method alike."""
    results = [None] * len(runs)
    live = list(range(len(runs)))
    while live:
        for i in list(live):
            try:
                results[i] = next(runs[i])
            except StopIteration:
                live.remove(i)
    return results


def median(values) -> float:
    v = sorted(values)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2


def time_to_target(result: dict, target: float, *, robust: bool = False) -> float | None:
    """Summed epoch times up to the first epoch at ``target`` accuracy (None: not reached).

    ``robust``: each epoch counts as the median time of the method's epochs of the same kind
    (DASO: blocking or cycling; the others: all epochs), so one epoch slowed by load from elsewhere
    on a shared machine does not decide the comparison."""
    kinds = [("block" if p in ("warm", "cool") else "cycling") for p in result["phases"]] or \
        ["all"] * len(result["epoch_s"])
    typical = {k: median([t for t, k2 in zip(result["epoch_s"], kinds) if k2 == k]) for k in kinds}
    total = 0.0
    for seconds, acc, kind in zip(result["epoch_s"], result["acc"], kinds):
        total += typical[kind] if robust else seconds
        if acc >= target:
            return total
    return None


# -- report ------------------------------------------------------------------------------------
def _ttt_cell(result: dict, target: float) -> str:
    ttt = time_to_target(result, target)
    robust = time_to_target(result, target, robust=True)
    reach = next((i + 1 for i, a in enumerate(result["acc"]) if a >= target), None)
    return f"{robust:.1f} / {ttt:.1f} ({reach})" if ttt else "–"


def format_table(results: list[dict], targets: list[float]) -> str:
    head = ["link delay µs/MB", "method", "s/epoch (median)", "s/epoch (each)", "train s (total)"]
    head += [f"to {100 * t:g} %: s robust / measured (epochs)" for t in targets]
    head += ["final acc", "acc per epoch (%)", "DASO wait s", "DASO phases"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [f"{r['delay']:g}", r["method"], f"{median(r['epoch_s']):.2f}",
                 " ".join(f"{t:.1f}" for t in r["epoch_s"]), f"{sum(r['epoch_s']):.1f}"]
        cells += [_ttt_cell(r, t) for t in targets]
        cells += [f"{100 * r['acc'][-1]:.2f} %", " ".join(f"{100 * a:.1f}" for a in r["acc"]),
                  f"{r['global_wait_s']:.2f}" if r["method"] == "daso" else "–",
                  " ".join(r["phases"]) or "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(results: list[dict], targets: list[float]) -> str:
    """One line per delay and reference: DASO's median epoch time and time to each target,
    relative to the reference (negative = DASO faster)."""
    out = []
    for delay in dict.fromkeys(r["delay"] for r in results):
        rows = {r["method"]: r for r in results if r["delay"] == delay}
        d = rows.get("daso")
        if d is None:
            continue
        for ref in ("horovod", "ssgd-hier", "ssgd"):
            if ref not in rows:
                continue
            ea, eb = median(d["epoch_s"]), median(rows[ref]["epoch_s"])
            parts = []
            for t in targets:
                a = time_to_target(d, t, robust=True)
                b = time_to_target(rows[ref], t, robust=True)
                parts.append(f"{100 * t:g} %: " + (f"{100 * (a / b - 1):+.0f} %" if a and b else
                             f"DASO {'reached' if a else 'not reached'}, {ref} "
                             f"{'reached' if b else 'not reached'}"))
            out.append(f"delay {delay:g} µs/MB, DASO vs {ref}: median time per epoch "
                       f"{100 * (ea / eb - 1):+.0f} %; robust time to " + ", ".join(parts) +
                       f"; final accuracy {100 * d['acc'][-1]:.2f} % vs "
                       f"{100 * rows[ref]['acc'][-1]:.2f} %.")
    return "\n".join(f"- {line}" for line in out)


def command_line(args) -> str:
    argv = [f"--epochs {args.epochs}", f"--train-limit {args.train_limit}",
            "--targets " + " ".join(f"{t:g}" for t in args.targets), f"--seed {args.seed}",
            "--delays " + " ".join(f"{d:g}" for d in args.delays),
            "--methods " + " ".join(args.methods),
            f"--daso-warmup-epochs {args.daso_warmup_epochs}",
            f"--daso-cooldown-epochs {args.daso_cooldown_epochs}"]
    from ..launch import shown_mpiexec

    return f"{shown_mpiexec(4)} hpcasync bench daso " + " ".join(argv)


def run(args: argparse.Namespace) -> int:
    """``hpcasync bench daso`` (every rank calls it); rank 0 prints the table."""
    from ..data import load_dataset
    from ..topology import Topology

    if args.epochs < 1 or not all(0 < t <= 1 for t in args.targets):
        raise ConfigError("--epochs must be >= 1 and every --targets value in (0, 1]")
    if any(d < 0 for d in args.delays):
        raise ConfigError("--delays must be >= 0 µs per 10^6 bytes")
    topo = Topology.build(ranks_per_node=args.ranks_per_node)
    topo.require_uniform("bench daso")
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // topo.size))
    train, test = load_dataset(args.dataset, data_dir=args.data_dir, train_limit=args.train_limit,
                               test_limit=args.test_limit)
    hvd_ok = "horovod" in args.methods and _horovod_importable(topo.world)
    load = os.getloadavg()
    results = []
    try:
        for delay in args.delays:
            ours = [m for m in args.methods if m != "horovod" and not (m == "ssgd" and delay > 0)]
            results += interleaved([train_epochs(m, topo, train, test, args, delay) for m in ours])
            if "horovod" in args.methods and hvd_ok:    # alone: its thread slows the others
                import horovod.torch as hvd

                results += interleaved([train_epochs("horovod", topo, train, test, args, delay)])
                hvd.shutdown()
    finally:
        torch.set_num_threads(threads)
    if topo.rank == 0:
        text = report(results, args, topo, len(train), len(test), load)
        emit(text, args.out)
    topo.free()
    return 0


def _horovod_importable(comm) -> bool:
    try:
        import horovod.torch  # noqa: F401
        ok = True
    except Exception:
        ok = False
    return all(comm.allgather(ok))


def report(results, args, topo, ntrain, ntest, load) -> str:
    return "\n".join([
        "## Benchmark table", "",
        f"Command: `{command_line(args)}`", "",
        f"Setup: {topo.size} ranks as {topo.num_nodes} virtual nodes × {topo.local_size}, "
        f"{os.cpu_count()} cores, {args.model} on {args.dataset} ({ntrain} train / {ntest} test "
        f"images), batch {args.batch_size} per rank, SGD lr {args.lr} momentum {args.momentum}, "
        f"seed {args.seed}, {args.epochs} epochs. DASO phases per epoch: warm/cool = blocking "
        f"warm-up/cool-down, gsN = cycling with global skip N. Load average (1 min) at start / "
        f"end: {load[0]:.1f} / {os.getloadavg()[0]:.1f}. Time to a target: robust = each epoch "
        f"counted as the median of the method's epochs of its kind (DASO: blocking or cycling), "
        f"measured = the actual sum; (epochs) = epochs needed.", "",
        format_table(results, args.targets), "", verdict(results, args.targets), ""])
