"""Helpers of :class:`hpcasync.ps.optimizer.ParameterServer` kept apart (module size): the worker's
reply handling over K shards, LC-ASGD's peek, the description logged at construction, and the
interpreter-exit guard.

Example (what ``ParameterServer.push`` does after its K pushes)::

    head = take_replies(opt, g)        # every shard's reply slice into the model

Differences from the papers: none here (plumbing); sharding is described in :mod:`.shards`.
"""
from __future__ import annotations

import logging

import torch

from ..errors import ConfigError
from ..rules import Reply, ps_lr_factor
from .transport import KIND_PEEK

log = logging.getLogger("hpcasync")


def take_replies(opt, g, poll=None):
    """Worker: every shard's reply into its slice of the model, through that shard's worker-side
    rule (``g``: the pushed gradient, None for the first reply). One header back: accepted if
    every shard accepted, stop if any stops (they agree, :mod:`.shards`); its version is shard 0's
    (``opt.versions`` holds each shard's)."""
    L, heads = opt.layout, []
    for s, t in enumerate(opt.transports):
        out = L.slice(opt._reply, s)
        head = t.recv_reply(out, poll=poll)
        opt.rules[s].on_reply(L.slice(opt.flat.params, s),
                              Reply(out.to(opt.flat.device), head.version, head.scalars),
                              L.slice(g, s) if g is not None and head.accepted else None)
        opt.versions[s] = head.version
        heads.append(head)
    head = heads[0]
    if len(heads) > 1:
        if len({h.accepted for h in heads}) > 1:
            log.warning("%s worker %d: the shards disagree on accepting a push (%s)",
                        opt.algorithm, opt.worker, [h.accepted for h in heads])
        head.accepted = all(h.accepted for h in heads)
        head.stop = any(h.stop for h in heads)
    return head


def peek(opt, out: torch.Tensor) -> None:
    """Worker: every server's current θ slice into ``out`` (a PEEK message to each)."""
    for t in opt.transports:
        t.push(opt.flat.grads, kind=KIND_PEEK)
    for s, t in enumerate(opt.transports):
        t.recv_reply(opt.layout.slice(out, s))


def describe(opt) -> str:
    """The rule, its hyperparameters and the defaults in force, in words."""
    W = opt.num_workers
    hyper = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in opt.hyper.items())
    factor = ps_lr_factor(opt.algorithm, W, opt.warmup_epochs)
    warm = (5.0 if opt.warmup_epochs is None else opt.warmup_epochs) if factor else 0
    shards = (f"; {opt.layout.K} shard servers (ranks {opt.layout.servers})"
              if opt.layout.K > 1 else "")
    return (f"{opt.algorithm} on {W} workers ({hyper}); lr warm-up from lr/{W} over "
            f"{warm:g} epochs (warmup_epochs)" if warm else
            f"{opt.algorithm} on {W} workers ({hyper}); no lr warm-up (warmup_epochs)") + \
        ("; the server's model takes the workers' mean BatchNorm buffers (average_buffers)"
         if opt.sync_buffers else "") + f"; transport {opt.transport.name}" + shards


def at_exit(ref) -> None:
    """Interpreter exit: a worker that never called finish() finishes now (so the server can end);
    a server that never served ends the job, saying so (the workers wait for it)."""
    opt = ref()
    if opt is None or opt._closed:
        return
    from ..errors import fail_fast

    try:
        if opt.is_server and not opt.served:
            fail_fast(ConfigError(f"rank {opt.ps_rank} is the parameter server of {opt.algorithm} "
                                  "and exited without calling opt.serve(): the workers wait for "
                                  "it. Call opt.serve() on the server rank (ctx.is_server)"))
        elif not opt.is_server and opt.started:
            log.warning("%s worker %d: finish() was not called; finishing at exit",
                        opt.algorithm, opt.worker)
            opt.finish()
    except Exception as exc:  # noqa: BLE001 - at exit: report and end the job, never hang
        fail_fast(exc)

