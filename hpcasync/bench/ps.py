"""``hpcasync bench ps``: how many pushes per second the parameter server handles.

Run with 4 ranks (rank 0 serves, up to 3 workers push)::

    mpiexec -n 4 hpcasync bench ps [--params 1M 10M] [--workers 1 2 3] [--rules asgd dcasgd]
                                   [--transports rma rma-put p2p] [--seconds 1.5] [--out FILE]
                                   [--ps-ranks 1 2]

Per (model size, workers, rule, transport), the workers push a fixed random gradient back to back
(no compute) for ``--seconds``; the PS runs the training loop itself (``PSServer``: validate, the
rule's ``on_push``, the reply) over the transport. Pushes/s = accepted pushes / the PS's time
from its first reply to the last worker's stop. "PS transport MB" is the most the PS's transport held
(``peak_bytes``: rma's gradient slots, p2p's receive buffer and reply copies; ``ps.memory``).

The *bound* is measured in the same run (best of three) by one process doing what one push needs,
without any communication: copy the gradient into a slot (the worker's Put), ``rule.validate``,
``rule.on_push``, copy θ into a reply slot (the PS), copy the reply into the local model (the
worker's Get). The ratio pushes/s ÷ bound says how much of that budget the real PS reaches; the
copies of a real push are spread over the PS and the workers, so more cores than ranks could take
it above 1. Transports: ``rma`` (Put in, Get out), ``rma-put`` (Put in, the PS Puts replies),
``p2p`` (two-sided Isend/Recv). Torch runs one thread per rank.

``--ps-ranks 1 2`` measures each cell with K = 1 and K = 2 shard servers side by side (ranks
0..K-1 serve one contiguous slice of θ each, ``hpcasync.ps.shards``; cells with workers + K above
the world size are skipped): a worker pushes its K slices, then takes the K replies. Pushes/s is
shard 0's accepted pushes (each is one whole push: every shard accepts it) over its serving time;
the bound column stays the one-server bound, so the ratio shows what K buys against it.
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import time

import torch

from . import emit
from ..errors import ConfigError, TopologyError

log = logging.getLogger(__name__)


def parse_count(text: str) -> int:
    """``"1M"`` -> 1_000_000, ``"10M"``, ``"500K"``, ``"123"`` (decimal units)."""
    units = {"K": 10**3, "M": 10**6, "G": 10**9}
    raw = text.strip().upper()
    try:
        value = int(float(raw[:-1]) * units[raw[-1]]) if raw[-1:] in units else int(raw)
    except (ValueError, IndexError):
        raise ConfigError(f"--params: cannot read {text!r} (use e.g. 1M, 10M)") from None
    if value < 1:
        raise ConfigError(f"--params: {text!r} must be >= 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", nargs="+", default=["1M", "10M"], help="model sizes")
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--rules", nargs="+", default=["asgd", "dcasgd"])
    parser.add_argument("--transports", nargs="+", default=["rma", "rma-put", "p2p"])
    parser.add_argument("--seconds", type=float, default=1.5, help="pushing time per cell")
    parser.add_argument("--out", default=None, help="also write the markdown report to FILE")
    parser.add_argument("--ps-ranks", nargs="+", type=int, default=[1],
                        help="shard servers K (e.g. 1 2: side by side)")


def _idle(comm, poll: float = 0.002) -> None:
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll)


def measure_bound(rule_name: str, numel: int, workers: int, seconds: float) -> float:
    """Pushes/s of one process doing a push's rule math and copies (see the module docstring)."""
    from ..rules import PushMeta, make_rule

    gen = torch.Generator().manual_seed(1)
    grad = torch.randn(numel, generator=gen) * 1e-3
    rule = make_rule(rule_name, torch.zeros(numel), workers, lr=0.01)
    for w in range(workers):
        rule.initial_reply(w)
    slot, out, local = torch.empty(numel), torch.empty(numel), torch.empty(numel)
    n, t0 = 0, time.perf_counter()
    while True:
        w = n % workers
        slot.copy_(grad)
        meta = PushMeta(version=rule.version)
        assert rule.validate(w, slot, meta) is None
        reply = rule.on_push(w, slot, meta)
        out.copy_(reply.params)
        local.copy_(out)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and n >= 3:
            return n / elapsed


def measure_cell(comm, rule_name: str, numel: int, workers: int, transport: str,
                 seconds: float, shards: int = 1) -> dict | None:
    """One cell on ranks 0..workers + shards - 1 (ranks 0..shards-1 serve a slice of θ each); the
    others wait. Returns the row on rank 0."""
    from mpi4py import MPI

    from ..ps.server import PSServer
    from ..ps.shards import ShardLayout
    from ..ps.transport import make_transport
    from ..rules import make_rule

    rank = comm.Get_rank()
    sub = comm.Split(0 if rank < workers + shards else MPI.UNDEFINED, rank)
    row = None
    if sub != MPI.COMM_NULL:
        layout = ShardLayout.build(sub, ps_rank=0, shards=shards, numel=numel)
        mine = [(s, c) for s, c in enumerate(layout.comms) if c is not None]
        ts = [make_transport(transport, c, 0 if shards > 1 else layout.servers[0],
                             layout.slice(torch.empty(numel), s).numel()) for s, c in mine]
        if layout.shard >= 0:
            t = ts[0]
            rule = make_rule(rule_name, torch.zeros(t.numel), workers, lr=0.01)
            server = PSServer(t, rule, pushes_per_epoch=10**12, epochs=0, keep_log=False)
            t0 = time.perf_counter()
            stats = server.serve()
            elapsed = time.perf_counter() - t0
            if layout.shard == 0:
                row = {"params": numel, "workers": workers, "rule": rule_name,
                       "transport": transport, "ps_ranks": shards, "pushes": stats.accepted,
                       "pushes_per_s": stats.accepted / elapsed,
                       "mb_per_s": (t.bytes_in + t.bytes_out) * shards / elapsed / 1e6,
                       "ps_busy": server.apply_time / elapsed,
                       "ps_transport_bytes": t.peak_bytes}
        else:
            gen = torch.Generator().manual_seed(rank)
            grad = torch.randn(numel, generator=gen) * 1e-3
            local = torch.empty(numel)
            pieces = [(t, layout.slice(grad, s), layout.slice(local, s))
                      for t, (s, _) in zip(ts, mine)]
            heads = [t.recv_reply(out) for t, _, out in pieces]
            t0 = time.perf_counter()
            while True:
                last = time.perf_counter() - t0 >= seconds
                for (t, g, _), head in zip(pieces, heads):
                    t.push(g, version=head.version, loss=0.0, last=last)
                heads = [t.recv_reply(out) for t, _, out in pieces]
                if last:
                    break
        for t in ts:
            t.close()
        layout.free()
        sub.Free()
    _idle(comm)
    return row


def measure(comm, sizes, workers, rules, transports, seconds, ps_ranks=(1,)) -> list[dict]:
    rows = []
    for numel in sizes:
        for rule_name in rules:
            bound = None
            if comm.Get_rank() == 0:       # best of 3: the machine may be shared
                bound = max(measure_bound(rule_name, numel, 1, seconds / 3) for _ in range(3))
            _idle(comm)
            cells = [(w, tr, k) for w in workers for tr in transports for k in ps_ranks
                     if w + k <= comm.Get_size()]
            for w, tr, k in cells:
                row = measure_cell(comm, rule_name, numel, w, tr, seconds, k)
                if row is not None:
                    row["bound"] = bound
                    row["ratio"] = row["pushes_per_s"] / bound
                    rows.append(row)
                    log.info("%s", row)
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("| params | workers | rule | transport | PS ranks | pushes/s | bound pushes/s | "
            "ratio | MB/s moved | PS busy in rule | PS transport MB |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['params'] / 1e6:g} M | {r['workers']} | {r['rule']} | "
                     f"{r['transport']} | {r.get('ps_ranks', 1)} | {r['pushes_per_s']:.1f} | "
                     f"{r['bound']:.1f} | "
                     f"{r['ratio']:.2f} | {r['mb_per_s']:.0f} | {100 * r['ps_busy']:.0f} % | "
                     f"{r.get('ps_transport_bytes', 0) / 1e6:.0f} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    out = []
    for numel in sorted({r["params"] for r in rows}):
        for rule in sorted({r["rule"] for r in rows}):
            for k in sorted({r.get("ps_ranks", 1) for r in rows}):
                cell = {(r["transport"], r["workers"]): r["pushes_per_s"] for r in rows
                        if r["params"] == numel and r["rule"] == rule
                        and r.get("ps_ranks", 1) == k}
                if not cell:
                    continue
                wmax = max(w for _, w in cell)
                parts = [f"{tr} {cell[(tr, wmax)]:.1f}" for tr in ("rma", "rma-put", "p2p")
                         if (tr, wmax) in cell]
                servers = f", {k} PS ranks" if k > 1 else ""
                out.append(f"{numel / 1e6:g} M {rule}, {wmax} workers{servers}: "
                           + ", ".join(parts) + " pushes/s")
    return "; ".join(out) + "."


def machine(comm) -> str:
    from mpi4py import MPI

    cores = os.cpu_count() or 0
    ranks = comm.Get_size()
    over = " (oversubscribed)" if ranks > cores else ""
    lib = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
    return (f"{ranks} ranks on {cores} cores{over}, {platform.machine()}, {lib}, "
            f"torch {torch.__version__}, 1 torch thread per rank")


def run(args: argparse.Namespace, comm=None) -> int:
    """``hpcasync bench ps`` (every rank calls it); rank 0 prints the markdown report."""
    from ..rules import RULES
    from ..ps.transport import TRANSPORTS

    sizes = [parse_count(s) for s in args.params]
    for r in args.rules:
        if r not in RULES:
            raise ConfigError(f"--rules: unknown rule {r!r} (choose from {', '.join(RULES)})")
    for tr in args.transports:
        if tr not in TRANSPORTS:
            raise ConfigError(f"--transports: {tr!r} is not one of {', '.join(TRANSPORTS)}")
    if not args.seconds > 0:
        raise ConfigError(f"--seconds must be > 0, got {args.seconds}")
    from ..topology import init_mpi

    MPI = init_mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    size = comm.Get_size()
    from ..ps.shards import check_shards

    for k in args.ps_ranks:
        check_shards(k, size)
    bad = [w for w in args.workers if not 1 <= w < size]
    if bad:
        raise TopologyError(f"--workers {bad}: with {size} ranks at most {size - 1} workers "
                            f"(mpiexec -n 4 hpcasync bench ps)")
    torch.set_num_threads(1)
    rows = measure(comm, sizes, args.workers, args.rules, args.transports, args.seconds,
                   args.ps_ranks)
    if comm.Get_rank() == 0:
        cmd = ("mpiexec --oversubscribe -n {n} hpcasync bench ps --params {p} --workers {w} "
               "--rules {r} --transports {t} --seconds {s:g} --ps-ranks {k}").format(
            k=" ".join(map(str, args.ps_ranks)),
            n=size, p=" ".join(args.params), w=" ".join(map(str, args.workers)),
            r=" ".join(args.rules), t=" ".join(args.transports), s=args.seconds)
        text = "\n".join(["# Parameter-server benchmark", "", f"Command: `{cmd}`", "",
                          f"Machine: {machine(comm)}.", "", format_table(rows), "",
                          summary(rows), ""])
        emit(text, args.out)
    return 0
