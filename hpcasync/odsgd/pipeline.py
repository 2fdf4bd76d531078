"""OD-SGD's MPI pipeline on one rank: the round in flight and the local weights computed on.

See :mod:`hpcasync.odsgd.runtime` for the algorithm, the measurements behind the progress modes and
the differences from the paper; the pure math is :mod:`.core` / :mod:`.steps`.
"""
from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..comm import FlatModel, allreduce, iallreduce
from ..comm.broadcast import broadcast
from ..rules.base import check_choice
from .core import GlobalState, ODSGDHyper, WorkerState, global_update, local_update

log = logging.getLogger("hpcasync")

PROGRESS_MODES = ("hooks", "thread", "none")
POLL_S = 2e-4                     # thread mode: seconds between tests of the round in flight


@dataclass
class _Round:
    """A round in flight: its handle, its index t, when it started and when it was seen done."""
    handle: object
    index: int
    started: float
    done_at: float | None = None
    future: object = None


@dataclass
class StepTimes:
    """Seconds this rank spent blocked on rounds (``wait``, including warm-up's blocking rounds),
    updating weights (``update``), and rounds' start-to-completion time (``in_flight``)."""
    wait: float = 0.0
    update: float = 0.0
    in_flight: float = 0.0

    def overlap(self) -> float:
        """Share of the rounds' in-flight time hidden behind compute (1 = never waited)."""
        return 1.0 - self.wait / self.in_flight if self.in_flight > 0 else 0.0


class ODSGDWorker:
    """This rank's OD-SGD pipeline over the flat model ``flat`` and communicator ``comm``.

    Args:
        flat: the :class:`~hpcasync.comm.FlatModel`; its ``params`` are the weights computed on.
        comm: the communicator of all workers. Rounds run on a private duplicate (freed by
            :meth:`finish`, collective), so the caller may use ``comm`` while a round is in flight.
        hp: :class:`ODSGDHyper`.
        groups: None (``hp`` over all of θ) or the ranges of :func:`~.core.group_ranges` (param
            groups; held parameters). Set by :class:`~hpcasync.odsgd.ODSGD` before each step.
        progress: ``"thread"`` (default), ``"hooks"`` or ``"none"`` (docs/design/odsgd.md#runtime).

    Attributes: ``glob`` (:class:`GlobalState`), ``ws`` (:class:`WorkerState`), ``steps`` (step
    calls), ``rounds`` (rounds applied = t of W_t), ``times`` (:class:`StepTimes`), ``bytes_sent``.
    """

    def __init__(self, flat: FlatModel, comm, *, hp: ODSGDHyper, progress: str = "thread"):
        from mpi4py import MPI

        self.flat, self.comm, self.hp = flat, comm, hp
        self.groups = None
        self.progress = check_choice("progress", progress, PROGRESS_MODES)
        if progress == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            log.warning("odsgd: MPI is not THREAD_MULTIPLE; progress by hooks instead of a thread")
            self.progress = progress = "hooks"
        self.round_comm = comm.Dup()
        self.glob = GlobalState.create(flat.params)
        self.ws = WorkerState.create(flat.params, hp)
        self.send = torch.empty_like(flat.grads)
        self.steps = self.rounds = self.bytes_sent = 0
        self.times = StepTimes()
        self.round: _Round | None = None
        self._hooks = []
        self._pool = ThreadPoolExecutor(1, "odsgd-progress") if progress == "thread" else None
        if progress == "hooks":
            for m in flat.module.modules():
                if not any(True for _ in m.children()):
                    self._hooks.append(m.register_forward_pre_hook(self._poke))
            for p in flat.module.parameters():
                self._hooks.append(p.register_post_accumulate_grad_hook(self._poke))

    def broadcast_parameters(self, root: int = 0) -> None:
        """Start every replica from ``root``'s parameters and buffers; W_0 = W_{−1} = them."""
        for tensor in (self.flat.params, self.flat.buffers):
            if tensor.numel():
                broadcast(self.comm, tensor, root=root)
        self.glob.W.copy_(self.flat.params)
        self.glob.W_prev.copy_(self.flat.params)

    @property
    def in_warmup(self) -> bool:
        return self.steps < self.hp.warmup_iters

    def step(self) -> None:
        """After backward (gradient g_t in ``flat.grads``, computed on ``flat.params``): in warm-up
        a blocking SSGD step; else complete round t−1, start round t, load W^l_{t+1} into params."""
        t0 = time.perf_counter()
        g = self.flat.grads
        if self.in_warmup:
            allreduce(self.comm, g, average=True)
            t1 = time.perf_counter()
            self.times.wait += t1 - t0
            self.times.in_flight += t1 - t0
            global_update(self.glob, g, hp=self.hp, groups=self.groups)
            self.flat.params.copy_(self.glob.W)
            self.rounds += 1
        else:
            self.synchronize()
            t1 = time.perf_counter()
            self.send.copy_(g)
            handle = iallreduce(self.round_comm, self.send, average=True, name="odsgd",
                                step=self.rounds)
            self.round = _Round(handle, self.rounds, time.perf_counter())
            if self._pool is not None:
                self.round.future = self._pool.submit(_drive, handle)
            local_update(self.glob, self.ws, g, hp=self.hp, num_workers=self.comm.Get_size(),
                         groups=self.groups)
        self.bytes_sent += g.numel() * g.element_size()
        self.steps += 1
        self.times.update += time.perf_counter() - t1

    def synchronize(self) -> None:
        """Complete and apply the round in flight, if any (W_t → W_{t+1}); the time blocked here
        counts as wait. Afterwards ``glob.W`` includes every gradient passed to :meth:`step`."""
        r = self.round
        if r is None:
            return
        t0 = time.perf_counter()
        done_at = r.future.result() if r.future is not None else None
        r.handle.wait()
        t1 = time.perf_counter()
        done_at = done_at or r.done_at
        end = done_at if done_at is not None and done_at <= t0 else t1   # seen done before waiting?
        self.times.wait += t1 - t0
        self.times.in_flight += max(end - r.started, t1 - t0)
        self.round = None
        global_update(self.glob, r.handle.tensor, hp=self.hp, groups=self.groups)
        self.rounds += 1
        self.times.update += time.perf_counter() - t1

    @contextlib.contextmanager
    def global_weights(self):
        """Inside: the model holds the global W (e.g. to evaluate); after: the local weights again."""
        self.synchronize()
        stash = self.flat.params.clone()
        self.flat.params.copy_(self.glob.W)
        try:
            yield self.glob.W
        finally:
            self.flat.params.copy_(stash)

    def finish(self) -> None:
        """Complete the pipeline: the model keeps the global W; hooks, thread and the private
        communicator are released (collective)."""
        self.synchronize()
        if self.round_comm is not None:
            self.round_comm.Free()
            self.round_comm = None
        self.flat.params.copy_(self.glob.W)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._pool is not None:
            self._pool.shutdown()

    def set_comm(self, comm) -> None:
        """Run over ``comm`` from now on (the survivors' world after a ULFM recovery): the round
        in flight on the old, revoked communicators is dropped (its gradients are lost) and
        rounds get a private duplicate of ``comm``."""
        r, self.round = self.round, None
        if r is not None and r.future is not None:
            r.future.exception(timeout=30)    # the progress thread has left the dead request
        self.comm, self.round_comm = comm, comm.Dup()

    def average_buffers(self) -> None:
        """Average BatchNorm running statistics across workers (blocking; no round in flight)."""
        if self.flat.buffers.numel():
            self.synchronize()
            allreduce(self.comm, self.flat.buffers, average=True)

    def _poke(self, *_args) -> None:
        r = self.round
        if r is not None and r.done_at is None and r.handle.test():
            r.done_at = time.perf_counter()


def _drive(handle) -> float:
    """Thread mode: test the round until it completes; returns when it did."""
    while not handle.test():
        time.sleep(POLL_S)
    return time.perf_counter()
