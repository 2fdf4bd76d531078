"""The simulator's engines: N virtual workers in one process on a simulated clock.

Asynchronous algorithms (:class:`AsyncSim`): a heap of next-completion times. Worker w's step s
takes ``step_time · factor(w, s) + push_delay`` simulated seconds (``hetero.DelayModel``); the worker
whose step completes first pushes next. Its gradient is computed (lazily, at the push) on its own
parameter copy, which has not changed since its last reply, so the order of real computation does
not matter: only the simulated order does. The PS side is the very same rule object the MPI PS
drives; the per-push bookkeeping is the same ``PushStats``. Ties are broken by worker index, so
homogeneous workers push round robin and a run is bit-reproducible. A rule that stops stale
computations (``stop_stale``: Ringmaster's variant, Rennala's broadcast) has them stopped after
each step of θ: the worker starts again from θ at that time, the stopped run's heap entry is
skipped when it comes up.

Synchronous algorithms (:class:`SyncSim`, ``ssgd``): rounds; every worker computes a gradient on the
shared parameters, the mean is applied with the SSGD optimizer (momentum SGD), and the round takes
as long as its slowest worker.

Example::

    sim = AsyncSim(rule, worker_rule, model, train, delay, num_workers=32, epochs=2,
                   batch_size=64, seed=0, step_time=0.01, on_epoch=cb)
    stats = sim.run()

Design: docs/design/sim.md#engines (the server's service time and K shard servers).
"""
from __future__ import annotations

import heapq
import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from ..comm import FlatModel
from ..data import batches, num_batches, shard_indices
from ..rules import PushMeta
from ..ps.stats import PushStats


def _worker_batches(train, w: int, W: int, epochs: int, batch_size: int, seed: int
                    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    for epoch in range(1, epochs + 1):
        idx = shard_indices(len(train), shard_index=w, num_shards=W, seed=seed, epoch=epoch)
        for x, y in batches(train, idx, batch_size):
            yield epoch, x, y


class AsyncSim:
    """Discrete-event simulation of a PS with ``num_workers`` asynchronous workers.

    Args:
        rule: the PS-side rule. worker_rule: a worker-side instance (its ``on_reply``).
        model: the network; one module computes every worker's gradients (parameters swapped in).
        train: the training set; worker w trains shard w of ``num_workers`` for ``epochs`` epochs.
        delay: a :class:`~hpcasync.hetero.DelayModel`.
        step_time: simulated seconds of a natural step (factor 1).
        on_epoch: ``on_epoch(epoch, record)`` when the accepted pushes reach e · W · batches;
            ``record`` has the PushStats epoch fields plus ``sim_time``.
        lr_factor: as in ``PSServer``: the rule's lr is ``base lr × lr_factor(epoch)`` (SMEGA2's
            warm-up), the same arithmetic as the MPI server's (a worker's lr is the base lr).
        oracle: LC-ASGD's oracle: also compute the loss at the current θ on the same batch.
        on_push: ``on_push(worker, staleness, loss, sim_time)`` after every push (progress).
        service_time: simulated seconds one server needs per push (default 0;
            docs/design/sim.md#engines).
        shards: K shard servers serving in parallel (default 1).
    """

    def __init__(self, rule, worker_rule, model, train, delay, *, num_workers: int, epochs: int,
                 batch_size: int, seed: int, step_time: float = 0.01,
                 on_epoch: Callable[[int, dict], None] | None = None,
                 lr_factor: Callable[[float], float] | None = None, oracle: bool = False,
                 on_push: Callable[[int, int, float, float], None] | None = None,
                 service_time: float = 0.0, shards: int = 1):
        self.rule, self.worker_rule, self.model = rule, worker_rule, model
        self.service = service_time / shards      # one shard's seconds per push
        self.ps_free, self.ps_busy, self.ps_wait = 0.0, 0.0, 0.0
        self._busy_mark, self._wait_mark, self._pushes_mark, self._time_mark = 0.0, 0.0, 0, 0.0
        self.train, self.delay = train, delay
        self.W, self.epochs, self.batch_size, self.seed = num_workers, epochs, batch_size, seed
        self.step_time = step_time
        self.on_epoch, self.lr_factor, self.oracle, self.on_push = on_epoch, lr_factor, oracle, on_push
        self.base_lr = rule.lr
        self.flat = FlatModel(model)
        self.per_worker = num_batches(len(train) // num_workers, batch_size)
        self.pushes_per_epoch = self.per_worker * num_workers
        self.stats = PushStats(num_workers)
        self.sim_time = 0.0

    def duration(self, w: int, step: int) -> float:
        return self.delay.step_time(w, step, self.step_time) + self.delay.push_delay_s

    def run(self) -> PushStats:
        flat, rule, W = self.flat, self.rule, self.W
        local, bufs, version = [], [], []
        for w in range(W):
            reply = rule.initial_reply(w)
            mine = torch.empty(flat.numel)
            self.worker_rule.on_reply(mine, reply, None)
            local.append(mine)
            bufs.append(flat.buffers.clone())
            version.append(reply.version)
        data = [_worker_batches(self.train, w, W, self.epochs, self.batch_size, self.seed)
                for w in range(W)]
        steps, draws, runs = [0] * W, [1] * W, [0] * W   # pushes; durations drawn; restarts
        total = self.per_worker * self.epochs
        heap = [(self.duration(w, 0), w, 0) for w in range(W)] if total else []
        heapq.heapify(heap)
        stops = getattr(rule, "stop_stale", False)
        next_epoch = 1
        self.model.train()
        while heap:
            t, w, run = heapq.heappop(heap)
            if run != runs[w]:                          # a computation stopped since
                continue
            self.sim_time = t
            _, x, y = next(data[w])
            grad, loss, oracle_loss = self._gradient(local[w], bufs[w], x, y)
            meta = PushMeta(version=version[w], loss=loss, oracle_loss=oracle_loss)
            reason = rule.validate(w, grad, meta)
            if reason is not None:                      # e.g. a diverged run: NaN gradients
                self.stats.reject(w, version[w], reason, loss)
                reply, pushed = rule.initial_reply(w), None
            else:
                if self.lr_factor is not None:
                    rule.lr = self.base_lr * self.lr_factor(self.stats.accepted
                                                            / self.pushes_per_epoch)
                tau = rule.staleness(meta)
                reply, pushed = rule.on_push(w, grad, meta), grad
                self.stats.accept(w, version[w], tau, loss)
                if self.on_push is not None:
                    self.on_push(w, tau, loss, t)
            self.worker_rule.on_reply(local[w], reply, pushed)
            version[w] = reply.version
            steps[w] += 1
            done = self.sim_time = self._serve(t)      # the push counts once its reply is back
            if steps[w] < total:
                heapq.heappush(heap, (done + self.duration(w, draws[w]), w, runs[w]))
                draws[w] += 1
            if stops and pushed is not None and rule.moved:
                self._stop_stale(done, w, steps, draws, runs, local, version, heap, total)
            while (next_epoch <= self.epochs and (not heap or self.stats.accepted
                                                   >= next_epoch * self.pushes_per_epoch)):
                self._epoch(next_epoch, bufs)
                next_epoch += 1
        return self.stats

    def _stop_stale(self, now, pusher, steps, draws, runs, local, version, heap, total) -> None:
        """Every computation the rule calls stale at ``now`` (``is_stale`` of the version it
        started at) is stopped and starts again at θ (a new duration; the batch is not used)."""
        rule = self.rule
        for u in range(self.W):
            if u != pusher and steps[u] < total and rule.is_stale(version[u]):
                reply = rule.stop(u)
                self.worker_rule.on_reply(local[u], reply, None)
                version[u] = reply.version
                runs[u] += 1
                heapq.heappush(heap, (now + self.duration(u, draws[u]), u, runs[u]))
                draws[u] += 1

    def _serve(self, t: float) -> float:
        """FIFO service of a push arriving at ``t``; returns when its reply is back."""
        if not self.service:
            return t
        start = max(t, self.ps_free)
        self.ps_wait += start - t
        self.ps_free = start + self.service
        self.ps_busy += self.service
        return self.ps_free

    def _gradient(self, params, bufs, x, y):
        flat = self.flat
        flat.params.copy_(params)
        flat.buffers.copy_(bufs)
        flat.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        bufs.copy_(flat.buffers)
        oracle_loss = math.nan
        if self.oracle:
            with torch.no_grad():
                flat.params.copy_(self.rule.theta)
                oracle_loss = F.cross_entropy(self.model(x), y).item()
            flat.buffers.copy_(bufs)
        return flat.grads, loss.item(), oracle_loss

    def load_theta(self, bufs=None) -> None:
        """Put θ (and the mean of the workers' float buffers) into the model, for evaluation."""
        self.flat.params.copy_(self.rule.theta)
        if bufs and self.flat.buffer_numel:
            self.flat.buffers.copy_(torch.stack(bufs).mean(0))

    def _epoch(self, epoch: int, bufs) -> None:
        record = self.stats.end_epoch()
        record["sim_time"] = self.sim_time
        if self.service:
            pushes = self.stats.accepted + self.stats.rejected
            span = max(self.sim_time - self._time_mark, 1e-12)
            record["ps_busy"] = min(1.0, (self.ps_busy - self._busy_mark) / span)
            record["ps_wait_s"] = (self.ps_wait - self._wait_mark) / max(
                1, pushes - self._pushes_mark)
            self._busy_mark, self._wait_mark, self._pushes_mark = self.ps_busy, self.ps_wait, pushes
            self._time_mark = self.sim_time
        record["ps_version"] = self.rule.version
        self.load_theta(bufs)
        if self.on_epoch is not None:
            self.on_epoch(epoch, record)


class SyncSim:
    """Synchronous rounds (SSGD): mean gradient of all workers, one momentum-SGD step; a round
    lasts as long as its slowest worker. Same arguments as :class:`AsyncSim` plus the optimizer
    settings ``lr``, ``momentum``, ``weight_decay``."""

    def __init__(self, model, train, delay, *, num_workers: int, epochs: int, batch_size: int,
                 seed: int, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 step_time: float = 0.01, on_epoch: Callable[[int, dict], None] | None = None,
                 on_round: Callable[[float, float], None] | None = None):
        self.model, self.train, self.delay = model, train, delay
        self.W, self.epochs, self.batch_size, self.seed = num_workers, epochs, batch_size, seed
        self.step_time, self.on_epoch, self.on_round = step_time, on_epoch, on_round
        self.flat = FlatModel(model)
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                                   weight_decay=weight_decay)
        self.per_worker = num_batches(len(train) // num_workers, batch_size)
        self.sim_time = 0.0
        self.rounds = 0

    def run(self) -> None:
        flat, W = self.flat, self.W
        acc = torch.zeros_like(flat.grads)
        for epoch in range(1, self.epochs + 1):
            data = [batches(self.train, shard_indices(len(self.train), shard_index=w,
                                                      num_shards=W, seed=self.seed, epoch=epoch),
                            self.batch_size) for w in range(W)]
            loss_sum = 0.0
            self.model.train()
            for _ in range(self.per_worker):
                acc.zero_()
                round_loss = 0.0
                for w in range(W):
                    x, y = next(data[w])
                    flat.zero_grad()
                    loss = F.cross_entropy(self.model(x), y)
                    loss.backward()
                    acc.add_(flat.grads)
                    round_loss += loss.item()
                flat.grads.copy_(acc.div_(W))
                self.opt.step()
                self.sim_time += max(self.delay.step_time(w, self.rounds, self.step_time)
                                     for w in range(W)) + self.delay.push_delay_s
                self.rounds += 1
                loss_sum += round_loss / W
                if self.on_round is not None:
                    self.on_round(round_loss / W, self.sim_time)
            if self.on_epoch is not None:
                self.on_epoch(epoch, {"train_loss": loss_sum / max(1, self.per_worker),
                                      "sim_time": self.sim_time, "rounds": self.rounds})
