"""How much memory the parameter server holds: the rule's state plus the transport's buffers.

For a model of n float32 parameters and e float buffers (BatchNorm statistics) trained by N
workers, the PS rank holds (bytes)::

    total     = rule + transport + buffers
    rule      = rule.state_bytes()                θ and the algorithm's state (rule_state_bytes)
    transport = transport_bytes(kind, N, n, e)    the windows / message buffers, per kind below
    buffers   = N · e · 4                         each worker's latest float buffers, which the
                                                  server averages (ParameterServer)

Example::

    python -m hpcasync.ps.memory --params 25557032 --buffers 53120 --workers 4 16 64

Differences from the papers: the papers count the optimizer's state only (SMEGA2's "single
momentum buffer"); the message buffers are an implementation's, so they are counted here.

Design: docs/design/ps.md#memory (per transport, per rule, the records, ResNet-50 at N = 64).
"""
from __future__ import annotations

import argparse

from ..errors import ConfigError

KINDS = ("rma", "rma-put", "p2p")


def _check(kind: str, num_workers: int, numel: int, extra: int) -> None:
    if kind not in KINDS:
        raise ConfigError(f"unknown PS transport {kind!r} (choose from {', '.join(KINDS)})")
    for name, value in (("num_workers", num_workers), ("numel", numel), ("extra", extra)):
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")


def transport_bytes(kind: str, num_workers: int, numel: int, extra: int = 0, *,
                    reply_buffers: int | None = None) -> int:
    """Bytes the PS side of transport ``kind`` holds (docs/design/ps.md#memory). ``reply_buffers``:
    p2p's reply copies alive (default: the bound, ``num_workers``); ignored by rma and rma-put."""
    _check(kind, num_workers, numel, extra)
    slot = (numel + extra) * 4
    if kind in ("rma", "rma-put"):
        return num_workers * slot
    replies = num_workers if reply_buffers is None else reply_buffers
    if not isinstance(replies, int) or not 0 <= replies <= max(num_workers, 1):
        raise ConfigError(f"reply_buffers must be an integer in [0, {num_workers}], "
                          f"got {replies!r}")
    return slot + replies * numel * 4


def worker_transport_bytes(kind: str, numel: int, extra: int = 0) -> int:
    """Bytes the transport holds on each worker: rma-put's reply window, else 0."""
    _check(kind, 1, numel, extra)
    return numel * 4 if kind == "rma-put" else 0


def buffer_table_bytes(num_workers: int, extra: int) -> int:
    """The server's table of each worker's latest float buffers (``ParameterServer``)."""
    _check("rma", num_workers, 0, extra)
    return num_workers * extra * 4


def memory_record(kind: str, num_workers: int, numel: int, extra: int, rule_bytes: int, *,
                  peak: int | None = None) -> dict:
    """The memory fields of a PS run's epoch and summary records (the MPI PS and the simulator):
    ``ps_state_bytes`` (the rule's), ``ps_transport_bytes`` (:func:`transport_bytes`, the bound),
    ``ps_buffers_bytes`` (:func:`buffer_table_bytes`), ``ps_total_bytes`` (their sum) and, from a
    real transport, ``ps_transport_peak_bytes`` (the most it held)."""
    transport = transport_bytes(kind, num_workers, numel, extra)
    buffers = buffer_table_bytes(num_workers, extra)
    record = {"ps_state_bytes": int(rule_bytes), "ps_transport_bytes": transport,
              "ps_buffers_bytes": buffers, "ps_total_bytes": int(rule_bytes) + transport + buffers}
    if peak is not None:
        record["ps_transport_peak_bytes"] = int(peak)
    return record


def rule_state_bytes(name: str, num_workers: int, numel: int, **hyper) -> int:
    """``rule.state_bytes()`` of rule ``name`` for ``numel`` parameters once every worker has
    pushed (DANA's buffers exist from a worker's first push), without allocating the model: the
    state is a·numel + b, measured on two small rules (exact: the state is tensors of numel floats
    plus a constant part)."""
    import torch

    from ..rules import PushMeta, make_rule

    hyper.setdefault("lr", 0.1)
    sizes = []
    for n in (8, 16):
        rule = make_rule(name, torch.zeros(n), num_workers, **hyper)
        for w in range(num_workers):
            rule.initial_reply(w)
            rule.on_push(w, torch.zeros(n), PushMeta(version=rule.version, loss=1.0,
                                                     oracle_loss=1.0))
        sizes.append(rule.state_bytes())
    slope = (sizes[1] - sizes[0]) // 8
    return sizes[0] + slope * (numel - 8)


def ps_memory(rule: str, kind: str, num_workers: int, numel: int, extra: int = 0,
              **hyper) -> dict:
    """The PS's bytes by part (module formula): rule, transport (bound), buffers, total."""
    parts = {"rule": rule_state_bytes(rule, num_workers, numel, **hyper),
             "transport": transport_bytes(kind, num_workers, numel, extra),
             "buffers": buffer_table_bytes(num_workers, extra)}
    return {**parts, "total": sum(parts.values())}


def memory_table(numel: int, extra: int, workers, rules=("smega2", "dana", "asgd")) -> str:
    """A markdown table of :func:`ps_memory` (GB = 1e9 bytes), and for comparison rma with N reply
    slots besides the N gradient slots (its earlier layout: docs/design/ps.md#memory)."""
    lines = ["| N | rule | rule state | rma or rma-put: total | p2p: total (bound, N replies "
             "in flight) | p2p: total (1 reply in flight) | rma before issue 13: total |",
             "|" + "---|" * 7]
    for n in workers:
        for rule in rules:
            rma, p2p = ps_memory(rule, "rma", n, numel, extra), ps_memory(rule, "p2p", n, numel,
                                                                           extra)
            one = p2p["total"] - p2p["transport"] + transport_bytes("p2p", n, numel, extra,
                                                                    reply_buffers=1)
            before = rma["total"] + n * numel * 4
            cells = [rma["rule"], rma["total"], p2p["total"], one, before]
            lines.append(f"| {n} | {rule} | " + " | ".join(f"{c / 1e9:.2f}" for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcasync.ps.memory",
                                     description="PS memory (GB) by rule and transport")
    parser.add_argument("--params", type=int, required=True)
    parser.add_argument("--buffers", type=int, default=0)
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--rules", nargs="+", default=["smega2", "dana", "asgd"])
    args = parser.parse_args(argv)
    print(memory_table(args.params, args.buffers, args.workers, args.rules))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
