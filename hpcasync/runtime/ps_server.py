"""The parameter server's loop: receive a push, validate it, apply the rule, answer that worker.

The loop is transport-agnostic (``ps_transport``) and rule-agnostic (``hpcasync.rules``)::

    server = PSServer(transport, rule, pushes_per_epoch=W * batches, epochs=E, on_epoch=cb)
    stats = server.serve()          # returns when every worker has sent its last push

Protocol, per worker: the PS first sends ``rule.initial_reply(w)``; then the worker alternates
push -> reply. A push is rejected (counted, never applied) when its length is wrong or
``rule.validate`` objects (NaN/Inf, a version from the future, ...); the worker is answered anyway
with ``rule.initial_reply(w)`` (it resumes from θ) and a flag telling it the push was not applied.
A ``PEEK`` message (LC-ASGD's oracle) is answered with the current θ and changes nothing.

Epochs: the PS crosses epoch e when the accepted pushes reach ``e · pushes_per_epoch``; it answers
the push first, then calls ``on_epoch(e, record)``. Rejected pushes delay the crossing; any epoch
not crossed when the last worker stops is recorded then, with the final θ.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..rules import PushMeta
from .ps_stats import PushStats
from .ps_transport import KIND_PEEK, KIND_PUSH

log = logging.getLogger("hpcasync")


class PSServer:
    """Drives one rule over one transport until every worker is done.

    Args:
        transport: a PS-side transport (``recv_push``/``send_reply``).
        rule: the update rule (PS side).
        pushes_per_epoch: pushes of all workers in one epoch (W × batches per worker).
        epochs: epochs to record.
        on_epoch: ``on_epoch(epoch, record)`` after the epoch's crossing push was answered;
            ``record`` holds the staleness histogram and push counts of that epoch.
        lr_at: ``lr_at(epoch_float) -> lr`` set on the rule before each accepted push
            (None: the rule's lr stays as built).
        on_push: ``on_push(worker, staleness, loss)`` after each accepted push (progress, logs).
        on_buffers: ``on_buffers(worker, extra)`` with the float buffers of each accepted push.
        keep_log: keep every push in ``stats.log``.
    """

    def __init__(self, transport, rule, *, pushes_per_epoch: int, epochs: int,
                 on_epoch: Callable[[int, dict], Any] | None = None,
                 lr_at: Callable[[float], float] | None = None,
                 on_push: Callable[[int, int, float], Any] | None = None,
                 on_buffers: Callable[[int, Any], Any] | None = None, keep_log: bool = True):
        self.transport = transport
        self.rule = rule
        self.pushes_per_epoch = pushes_per_epoch
        self.epochs = epochs
        self.on_epoch = on_epoch
        self.lr_at = lr_at
        self.on_push = on_push
        self.on_buffers = on_buffers
        self.stats = PushStats(transport.num_workers, keep_log=keep_log)
        self.next_epoch = 1
        self.apply_time = 0.0          # seconds in validate + on_push
        self.peeks = 0
        self._bytes_mark = (0, 0)

    def serve(self) -> PushStats:
        t = self.transport
        for w in range(t.num_workers):
            reply = self.rule.initial_reply(w)
            t.send_reply(w, reply.params, reply.version, True, reply.scalars)
        done = [False] * t.num_workers
        while not all(done):
            push = t.recv_push()
            if push.kind == KIND_PEEK:
                self.peeks += 1
                t.send_reply(push.worker, self.rule.theta, self.rule.version, True,
                             (0.0,) * self.rule.reply_scalars)
                continue
            if push.kind != KIND_PUSH:
                raise RuntimeError(f"PS: unknown message kind {push.kind} from worker "
                                   f"{push.worker}")
            self.handle(push)
            if push.last:
                done[push.worker] = True
        while self.next_epoch <= self.epochs:      # epochs not crossed (rejected pushes)
            self._cross_epoch()
        return self.stats

    def handle(self, push) -> None:
        """Validate and apply one push, answer its worker, cross an epoch if due."""
        rule, w = self.rule, push.worker
        meta = PushMeta(version=push.version, loss=push.loss, oracle_loss=push.oracle_loss)
        t0 = time.perf_counter()
        reason = None
        if push.numel != self.transport.numel:
            reason = f"gradient has {push.numel} elements, expected {self.transport.numel}"
        reason = reason or rule.validate(w, push.grad, meta)
        if reason is not None:
            self.stats.reject(w, push.version, reason, push.loss)
            reply = rule.initial_reply(w)
            self.apply_time += time.perf_counter() - t0
            self.transport.send_reply(w, reply.params, reply.version, False, reply.scalars)
            return
        if self.lr_at is not None:
            rule.lr = self.lr_at(self.stats.accepted / self.pushes_per_epoch)
        staleness = rule.staleness(meta)
        reply = rule.on_push(w, push.grad, meta)
        self.apply_time += time.perf_counter() - t0
        self.stats.accept(w, push.version, staleness, push.loss)
        if self.on_buffers is not None and push.extra.numel():
            self.on_buffers(w, push.extra)
        self.transport.send_reply(w, reply.params, reply.version, True, reply.scalars)
        if self.on_push is not None:
            self.on_push(w, staleness, push.loss)
        if (self.next_epoch <= self.epochs
                and self.stats.accepted >= self.next_epoch * self.pushes_per_epoch):
            self._cross_epoch()

    def _cross_epoch(self) -> None:
        t = self.transport
        record = self.stats.end_epoch()
        bytes_in, bytes_out = t.bytes_in - self._bytes_mark[0], t.bytes_out - self._bytes_mark[1]
        self._bytes_mark = (t.bytes_in, t.bytes_out)
        record.update(bytes_moved=bytes_in + bytes_out, bytes_in=bytes_in, bytes_out=bytes_out,
                      ps_version=self.rule.version)
        epoch = self.next_epoch
        self.next_epoch += 1
        if self.on_epoch is not None:
            self.on_epoch(epoch, record)
