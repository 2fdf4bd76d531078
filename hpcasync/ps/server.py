"""The parameter server's loop: receive a push, validate it, apply the rule, answer that worker.

The loop is transport-agnostic (``ps.transport``) and rule-agnostic (``hpcasync.rules``)::

    server = PSServer(transport, rule, pushes_per_epoch=W * batches, epochs=E, on_epoch=cb)
    stats = server.serve()          # returns when every worker has sent its last push

Protocol, per worker: the PS first sends ``rule.initial_reply(w)``; then the worker alternates
push -> reply. A push is rejected (counted, never applied) when its length is wrong or
``rule.validate`` objects (NaN/Inf, a version from the future, ...); the worker is answered anyway
with ``rule.initial_reply(w)`` (it resumes from θ) and a flag telling it the push was not applied.
A ``PEEK`` message (LC-ASGD's oracle) is answered with the current θ and changes nothing.

Design: docs/design/ps.md#server-loop (epochs, checkpoints and the stop protocol, resume, worker
failure).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

from ..errors import CheckpointError
from ..rules import PushMeta
from ..runtime.ft import WorkerFailed
from .stats import PushStats
from .transport import KIND_DONE, KIND_FINISH, KIND_PEEK, KIND_PUSH, KIND_STOP
from .wire import END_GROW

log = logging.getLogger("hpcasync")


def _finite(value) -> bool:
    """A pushed hyperparameter (a float, or one per param group) that the worker did send."""
    return all(math.isfinite(x) for x in value) if isinstance(value, tuple) else math.isfinite(value)


class PSServer:
    """Drives one rule over one transport until every worker is done.

    Args:
        transport: a PS-side transport (``recv_push``/``send_reply``).
        rule: the update rule (PS side).
        pushes_per_epoch: pushes of all workers in one epoch (W × batches per worker); None: no
            epochs (a user's loop that did not say how long its epochs are).
        epochs: epochs to record; None: open-ended (epochs are recorded as pushes cross them,
            none is made up at the end).
        on_epoch: ``on_epoch(epoch, record)`` after the epoch's crossing push was answered;
            ``record`` holds the staleness histogram and push counts of that epoch.
        lr_factor: ``lr_factor(epoch_float) -> factor``: the rule's lr for an accepted push is
            the pushing worker's lr (its optimizer's, carried in the push, one per param group;
            the rule's lr as built when a push carries none) times this factor (the paper's
            warm-up; None: 1). The push's weight decay (per group) and momentum, when it carries
            them, become the rule's too.
        on_push: ``on_push(worker, staleness, loss)`` after each accepted push (progress, logs).
        on_buffers: ``on_buffers(worker, extra)`` with the float buffers of each accepted push.
        keep_log: keep every push in ``stats.log``.
        stop_requested: ``() -> bool``, polled between messages: the PS's own preemption flag.
        on_checkpoint: ``on_checkpoint(kind)`` with kind ``"epoch"`` or ``"periodic"``
            (docs/design/ps.md#server-loop).
        checkpoint_every: accepted pushes between periodic checkpoints (0: epoch ends only).
        on_failure: ``on_failure(record)`` after a worker was found dead and retired.
        on_served: ``on_served()`` when :meth:`serve` has crossed its last epoch, before it
            returns (the sharded server's end message to server 0, :mod:`.shards`).
        worker_ranks: the workers' ranks in the job's communicator, for records and logs
            (default: their ranks in the transport's, which differ for a shard's server).
        grow_back: a dead worker's replacement trains the rest of its shard
            (:class:`~.growth.PSGrowth`): ``stop_requested`` is asked once more when every
            worker is done (the spawn for a death that only the last wait saw).
        on_accept: ``on_accept(worker, loss)`` after each accepted push, before it is answered
            (may raise to end the run, e.g. a divergence guard).
        on_frozen: ``on_frozen(words)`` before an accepted push is applied, with the pushing
            worker's frozen parameters (:func:`~.wire.mask_words`; the rule's groups follow them).

    Attributes: ``stats``, ``positions`` (pushes answered per worker = its next batch),
    ``finished`` (workers whose last push was answered), ``stopping``, ``next_epoch``,
    ``failed`` (worker -> record of its death).
    """

    def __init__(self, transport, rule, *, pushes_per_epoch: int | None, epochs: int | None,
                 on_epoch: Callable[[int, dict], Any] | None = None,
                 lr_factor: Callable[[float], float] | None = None,
                 on_push: Callable[[int, int, float], Any] | None = None,
                 on_buffers: Callable[[int, Any], Any] | None = None, keep_log: bool = True,
                 stop_requested: Callable[[], bool] | None = None,
                 on_checkpoint: Callable[[str], Any] | None = None, checkpoint_every: int = 0,
                 on_failure: Callable[[dict], Any] | None = None,
                 on_accept: Callable[[int, float], Any] | None = None,
                 on_served: Callable[[], Any] | None = None,
                 on_frozen: Callable[[tuple], Any] | None = None,
                 worker_ranks: list[int] | None = None, grow_back: bool = False):
        self.transport = transport
        self.worker_ranks = list(transport.workers if worker_ranks is None else worker_ranks)
        self.on_served = on_served
        self.rule = rule
        self.pushes_per_epoch = pushes_per_epoch
        self.epochs = epochs
        self.on_epoch = on_epoch
        self.lr_factor = lr_factor
        self.base_lr = rule.lr
        self.on_push = on_push
        self.on_buffers = on_buffers
        self.stats = PushStats(transport.num_workers, keep_log=keep_log)
        self.next_epoch = 1
        self.apply_time = 0.0          # seconds in validate + on_push
        self.peeks = 0
        self._bytes_mark = (0, 0)
        self.stop_requested = stop_requested
        self.on_checkpoint = on_checkpoint
        self.checkpoint_every = checkpoint_every
        W = transport.num_workers
        self.positions = [0] * W
        self.finished = [False] * W
        self.stopping = False
        self.stop_reason = ""
        self.grow = False              # the stop is a grow-back's (ps.growth), not a preemption
        #: a grow-back is on (``.growth``): ``stop_requested`` is asked once more when every
        #: worker is done, so that a worker seen dead only by the last wait is replaced too
        self.grow_back = grow_back
        self.on_failure = on_failure
        self.on_accept = on_accept
        self.on_frozen = on_frozen
        self.failed: dict[int, dict] = {}
        #: ``on_header(push)``: called with each message before it is handled (inside the loop's
        #: failure handling; :mod:`.loop_checkpoint` takes the checkpoint requests it counts)
        self.on_header: Callable[[Any], None] | None = None
        self.failed_before: list[dict] = []        # from the checkpoint a resumed run began at
        self._done = [False] * W

    def serve(self) -> PushStats:
        """Serve until every worker has sent its last push, or until a stop
        (docs/design/ps.md#server-loop)."""
        self.begin()
        while not self.all_done():
            self._poll_stop()
            try:
                push = self.transport.recv_push()
                if self.on_header is not None:
                    self.on_header(push)
            except WorkerFailed as exc:
                self._lose(exc.ranks)
                continue
            self.dispatch(push)
        if self.grow_back:          # a death the last wait saw may still ask for a stop
            self._poll_stop()
        return self.end()

    def begin(self) -> None:
        """:meth:`serve`'s start: every worker still training gets its first reply."""
        done = self._done
        for w in range(self.transport.num_workers):
            done[w] = self.finished[w] or w in self.failed
            if not done[w]:
                reply = self.rule.initial_reply(w)
                self._send(w, reply.params, reply.version, True, reply.scalars)

    def all_done(self) -> bool:
        """Every worker has sent its last push (or finished, or died)."""
        return all(self._done)

    def serve_waiting(self) -> bool:
        """One message, if one has arrived (never waits): the loop of :func:`hpcasync.serve`,
        which serves several servers in turn. Returns whether there was one."""
        self._poll_stop()
        try:
            got = self.transport.poll_header()
            if got is None:
                return False
            push = self.transport.complete_push(*got)
            if self.on_header is not None:
                self.on_header(push)
        except WorkerFailed as exc:
            self._lose(exc.ranks)
            return True
        self.dispatch(push)
        return True

    def _poll_stop(self) -> None:
        if not self.stopping and self.stop_requested is not None and self.stop_requested():
            self._begin_stop("a signal at the PS")

    def dispatch(self, push) -> None:
        """One message of the loop: a push applied and answered, a PEEK answered, a stop, a
        worker's finish."""
        done = self._done
        if push.worker in self.failed:          # sent before it died: dropped
            return
        if push.kind == KIND_PEEK:
            self.peeks += 1
            self._send(push.worker, self.rule.theta, self.rule.version, True,
                       (0.0,) * self.rule.reply_scalars)
            return
        if push.kind == KIND_STOP:              # from a worker that has finished
            self._begin_stop(f"a signal at worker {push.worker}")
            return
        if push.kind == KIND_FINISH:            # no more pushes from it (a user's loop ended)
            self.finished[push.worker] = done[push.worker] = True
            return
        if push.kind != KIND_PUSH:
            raise RuntimeError(f"PS: unknown message kind {push.kind} from worker "
                               f"{push.worker}")
        if push.stop and not self.stopping:
            self._begin_stop(f"a signal at worker {push.worker}")
        self.handle(push)
        self.finished[push.worker] |= push.last
        if push.last or self.stopping:
            done[push.worker] = True

    def end(self) -> PushStats:
        """:meth:`serve`'s end, once :meth:`all_done`: the epochs no push crossed (rejected
        pushes), ``on_served``."""
        if all(f or w in self.failed for w, f in enumerate(self.finished)) and not (
                self.grow and any(not self.finished[w] for w in self.failed)):
            if self.stopping:
                log.info("PS: every worker had finished; completing the run instead of stopping")
            self.stopping = False
            while self.epochs is not None and self.next_epoch <= self.epochs:
                self._cross_epoch()                    # epochs not crossed (rejected pushes)
        if self.on_served is not None:
            self.on_served()
        return self.stats

    def start_at(self, position) -> None:
        """Start the epoch clock where every worker resumes, at its ``position``-th push (or
        worker w at its ``position[w]``-th; a worker took over from a dead server): positions,
        accepted pushes and the next epoch to cross as if the pushes before had been served
        here."""
        self.stats.start_at(position, self.pushes_per_epoch)
        self.positions = list(self.stats.per_worker)
        if self.pushes_per_epoch:
            self.next_epoch = self.stats.accepted // self.pushes_per_epoch + 1

    def _begin_stop(self, reason: str) -> None:
        if not self.stopping:
            self.stopping, self.stop_reason = True, reason
            log.warning("PS: stopping after %d accepted pushes (%s); each worker's next push is "
                        "its last", self.stats.accepted, reason)

    def begin_grow(self) -> None:
        """Stop every worker after its current push for a grow-back (:mod:`.growth`): the end
        message then says :data:`~.wire.END_GROW`. A stop already under way for a preemption
        stays one (the run ends; the replacements are not taken in)."""
        if not self.stopping:
            self.grow = True
            self._begin_stop("grow-back: a replacement takes a dead worker's place")

    def finish(self) -> list[int]:
        """After :meth:`serve`: send every live worker the end message (with ``stopping``) and
        collect its ``KIND_DONE``; returns each worker's step count (its position, as the PS
        counted it; a dead worker's position). A ``KIND_STOP`` arriving now (the training is
        complete) is ignored."""
        t = self.transport
        for w in range(t.num_workers):
            if w not in self.failed:
                try:
                    t.send_end(w, END_GROW if self.grow else self.stopping)
                except WorkerFailed as exc:
                    self._lose(exc.ranks)
        steps: list[int | None] = [self.positions[w] if w in self.failed else None
                                   for w in range(t.num_workers)]
        while any(s is None and w not in self.failed for w, s in enumerate(steps)):
            try:
                push = t.recv_push()
            except WorkerFailed as exc:
                self._lose(exc.ranks)
                continue
            if push.worker in self.failed:
                continue
            if push.kind == KIND_DONE:
                steps[push.worker] = push.version
            elif push.kind not in (KIND_STOP, KIND_FINISH):
                raise RuntimeError(f"PS: unexpected message kind {push.kind} from worker "
                                   f"{push.worker} after the end")
        steps = [self.positions[w] if s is None else s for w, s in enumerate(steps)]
        if steps != self.positions:
            log.warning("PS: workers report %s steps, the PS counted %s", steps, self.positions)
        return steps

    def _send(self, w: int, *args) -> None:
        """``transport.send_reply`` to worker ``w``; a dead ``w`` is retired instead."""
        try:
            self.transport.send_reply(w, *args)
        except WorkerFailed as exc:
            self._lose(exc.ranks)

    def _lose(self, workers: list[int]) -> None:
        """Workers found dead: retire each (once), record it, stop waiting for it."""
        for w in workers:
            if w in self.failed:
                continue
            self.rule.retire(w)
            self._done[w] = True
            rank = self.worker_ranks[w]
            record = {"worker": w, "rank": rank, "ps_version": self.rule.version,
                      "pushes": self.positions[w], "finished": self.finished[w]}
            self.failed[w] = record
            alive = self.transport.num_workers - len(self.failed)
            log.warning("worker %d (rank %d) died at PS version %d; continuing with %d workers "
                        "(its in-flight push is dropped; it had %d pushes answered, %s)", w, rank,
                        self.rule.version, alive, self.positions[w],
                        "its replacement trains the rest of its shard" if self.grow_back else
                        "the rest of its shard is not trained")
            if self.on_failure is not None:
                self.on_failure(record)

    # -- checkpoint state ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything the PS needs to continue: the rule (θ and per-worker state), counters,
        epoch progress, worker positions, byte counters (plain data, cloned)."""
        t = self.transport
        return {"rule": self.rule.state_dict(), "stats": self.stats.state_dict(),
                "next_epoch": self.next_epoch, "positions": list(self.positions),
                "finished": [int(f) for f in self.finished], "peeks": self.peeks,
                "bytes": [t.bytes_in, t.bytes_out], "bytes_mark": list(self._bytes_mark),
                "failed_workers": self.failed_before + [dict(r, before_resume=True)
                                                        for r in self.failed.values()]}

    def replaced_workers(self) -> list[dict]:
        """The ``failed_workers`` records once a grow-back replaces this run's dead workers:
        the earlier ones, and this run's marked ``replaced``."""
        return self.failed_before + [dict(r, replaced=True) for r in self.failed.values()]

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict` into this server (built with the same arguments)."""
        W = self.transport.num_workers
        try:
            positions, finished = [int(p) for p in d["positions"]], [bool(f) for f in d["finished"]]
            if len(positions) != W or len(finished) != W:
                raise CheckpointError(f"PS checkpoint is for {len(positions)} workers, this run "
                                      f"has {W}")
            self.rule.load_state_dict(d["rule"])
            self.stats.load_state_dict(d["stats"])
            self.next_epoch, self.peeks = int(d["next_epoch"]), int(d["peeks"])
            self.transport.bytes_in, self.transport.bytes_out = (int(x) for x in d["bytes"])
            self._bytes_mark = tuple(int(x) for x in d["bytes_mark"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"PS checkpoint state is incomplete ({exc})") from None
        self.positions, self.finished = positions, finished
        # deaths before the checkpoint, kept for the summary (the resumed job has every worker)
        self.failed_before = [dict(r, before_resume=True) for r in d.get("failed_workers", [])]

    def handle(self, push) -> None:
        """Validate and apply one push, answer its worker, cross an epoch if due."""
        rule, w = self.rule, push.worker
        meta = PushMeta(version=push.version, loss=push.loss, oracle_loss=push.oracle_loss)
        t0 = time.perf_counter()
        reason = None
        if push.numel != self.transport.numel:
            reason = f"gradient has {push.numel} elements, expected {self.transport.numel}"
        reason = reason or rule.validate(w, push.grad, meta)
        self.positions[w] += 1
        if reason is not None:
            self.stats.reject(w, push.version, reason, push.loss)
            reply = rule.initial_reply(w)
            self.apply_time += time.perf_counter() - t0
            self._send(w, reply.params, reply.version, False, reply.scalars, self.stopping)
            return
        if self.on_frozen is not None and push.frozen:
            self.on_frozen(push.frozen)
        lr = push.lr if _finite(push.lr) else self.base_lr
        if self.lr_factor is not None and self.pushes_per_epoch:
            f = self.lr_factor(self.stats.accepted / self.pushes_per_epoch)
            lr = tuple(x * f for x in lr) if isinstance(lr, tuple) else lr * f
        rule.lr = lr                                    # one per param group (rules.base)
        if _finite(push.weight_decay):
            rule.weight_decay = push.weight_decay
        if math.isfinite(push.momentum):
            rule.momentum = push.momentum
        staleness = rule.staleness(meta)
        reply = rule.on_push(w, push.grad, meta)
        self.apply_time += time.perf_counter() - t0
        self.stats.accept(w, push.version, staleness, push.loss)
        if self.on_buffers is not None and push.extra.numel():
            self.on_buffers(w, push.extra)
        if self.on_accept is not None:
            self.on_accept(w, push.loss)
        self._send(w, reply.params, reply.version, True, reply.scalars, self.stopping)
        if self.on_push is not None:
            self.on_push(w, staleness, push.loss)
        crossed = (bool(self.pushes_per_epoch)
                   and (self.epochs is None or self.next_epoch <= self.epochs)
                   and self.stats.accepted >= self.next_epoch * self.pushes_per_epoch)
        if crossed:
            self._cross_epoch()
        if self.on_checkpoint is None or self.stopping:      # a stop writes its own checkpoint
            return
        if crossed:
            self.on_checkpoint("epoch")
        elif self.checkpoint_every and self.stats.accepted % self.checkpoint_every == 0:
            self.on_checkpoint("periodic")

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
