"""A parameter-server worker: train on its shard, push each gradient, take the reply.

Worker i of W (i counts the non-PS ranks in rank order) trains ``shard_indices(L, shard_index=i,
num_shards=W, seed, epoch)`` for each epoch. Per batch::

    g, L ← ∇loss, loss at the local parameters w (its version v: the last reply's)
    [heterogeneity: sleep natural · (factor − 1); push delay]
        (natural: the median of the last 15 steps' CPU times on a CPU device, wall times on a GPU)
    [LC-ASGD oracle: PEEK the current θ, L_oracle ← loss(θ, same batch)]
    push (g, L, v) ; reply ← wait ; rule.on_reply(w, reply, g if accepted else None)

The push and the reply are :meth:`hpcasync.ps.ParameterServer.push` — the same call a user's
``opt.step()`` makes; ``on_reply`` (SHAT mixes, the others copy) is the worker-side rule's.

Example (inside a PS job, see ``hpcasync.ps.runtime.run``)::

    stats = run_worker(opt, model, train_set, epochs=2, batch_size=64, seed=0)

Design: docs/design/ps.md#worker-loop (preemption, resume, worker-local models).
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .. import inject
from ..data import batches, num_batches, shard_indices

log = logging.getLogger("hpcasync")


@dataclass
class WorkerStats:
    steps: int = 0
    rejected: int = 0
    compute_time: float = 0.0     # forward + backward, wall clock
    cpu_time: float = 0.0         # forward + backward, CPU time of the process
    sleep_time: float = 0.0       # heterogeneity: extra step time and push delays
    loss_sum: float = 0.0
    start_step: int = 0           # resumed at this position (``steps`` counts from it)
    stopped: bool = False         # the PS answered a push with the stop flag
    stop_sent: bool = False       # a push of this worker carried a stop request


def run_worker(opt, model: torch.nn.Module, train, *, epochs: int,
               batch_size: int, seed: int, device: str = "cpu", delay=None,
               oracle: bool = False, after_step: Callable[[], None] | None = None,
               start_step: int = 0,
               stop_requested: Callable[[], bool] | None = None,
               loss_fn: Callable = F.cross_entropy) -> WorkerStats:
    """Run worker ``opt.worker`` (a :class:`~hpcasync.ps.ParameterServer`) to the end of its budget (``epochs`` passes over its
    shard) or until the PS answers with the stop flag; its last push carries the ``last`` flag.
    ``start_step``: resume at this position (a spent budget: no initial reply, nothing to do).
    ``stop_requested()``: this rank's preemption flag, sent with each push. Returns the counters."""
    w, W, flat = opt.worker, opt.num_workers, opt.flat
    stats = WorkerStats(steps=start_step, start_step=start_step)
    opt.steps = start_step                 # what finish() reports: the position, as the PS counts
    per_epoch = num_batches(len(train) // W, batch_size)
    if start_step >= epochs * per_epoch:
        return stats
    opt.start()                                                  # the initial reply
    first_epoch, first_batch = divmod(start_step, per_epoch)
    model.train()
    cpu_clock = torch.device(device).type == "cpu"
    recent: deque[float] = deque(maxlen=15)
    if delay is not None:
        _warm_up(model, flat, train, batch_size, device)
    for epoch in range(first_epoch + 1, epochs + 1):
        indices = shard_indices(len(train), shard_index=w, num_shards=W, seed=seed, epoch=epoch)
        start = first_batch if epoch == first_epoch + 1 else 0
        for b, (x, y) in enumerate(batches(train, indices, batch_size, start_batch=start),
                                   start=start):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            loss_value = loss.item()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            stats.compute_time += wall
            stats.cpu_time += cpu
            natural = cpu if cpu_clock else wall   # a rank the OS kept waiting is not slow
            grad = flat.grads
            inject.point("gradient", step=stats.steps, grad=grad)
            if delay is not None:      # the median of recent steps: one-off spikes do not count
                recent.append(natural)
                stats.sleep_time += delay.sleep_extra(w, stats.steps, statistics.median(recent))
            oracle_loss = math.nan
            if oracle:
                oracle_loss = _oracle_loss(opt, model, x, y, loss_fn)
            if delay is not None and delay.push_delay_s:
                delay.sleep_push()
                stats.sleep_time += delay.push_delay_s
            last = epoch == epochs and b == per_epoch - 1
            stop = stop_requested is not None and stop_requested()
            stats.stop_sent |= stop
            head = opt.push(grad, loss=loss_value, oracle_loss=oracle_loss, last=last, stop=stop)
            stats.steps += 1
            stats.rejected += not head.accepted
            stats.loss_sum += loss_value
            if after_step is not None:
                after_step()
            if head.stop and not last:
                stats.stopped = True
                return stats
    return stats


@torch.no_grad()
def _oracle_loss(opt, model, x, y, loss_fn) -> float:
    """LC-ASGD's oracle: the loss at the PS's current θ on this batch (θ fetched by a PEEK)."""
    flat = opt.flat
    theta = torch.empty(flat.numel)
    opt.peek(theta)                         # every shard's slice
    params, buffers = flat.params.clone(), flat.buffers.clone()
    flat.params.copy_(theta)
    loss = loss_fn(model(x), y).item()
    flat.params.copy_(params)
    flat.buffers.copy_(buffers)
    return loss


def _warm_up(model, flat, train, batch_size: int, device: str) -> None:
    """One untimed forward/backward (then undone), so that the first timed step's "natural" time
    is not dominated by one-off allocations: a straggler sleeps factor × a typical step."""
    buffers = flat.buffers.clone()                  # BatchNorm statistics move in a forward
    x, y = train.images[:batch_size].to(device), train.labels[:batch_size].to(device)
    F.cross_entropy(model(x), y).backward()
    flat.buffers.copy_(buffers)
    flat.zero_grad()


class Patience:
    """A wait's poll callback that logs ``message % seconds`` once, after ``after`` seconds."""

    def __init__(self, message: str, after: float = 30.0):
        self.message, self.after = message, after
        self.t0, self.said = time.monotonic(), False

    def __call__(self) -> None:
        waited = time.monotonic() - self.t0
        if not self.said and waited > self.after:
            self.said = True
            log.warning(self.message, waited)


# -- worker-local models at a stop (rules with ``keeps_local``: SHAT, SHAT-root, ENSEMBLE) -------

_TAG_LOCAL = 4190          # the transport's tags are 4101-4106


def send_local(opt) -> None:
    """Worker, after a stop's end message: send its model (``opt.local_model()``) to the PS."""
    from mpi4py import MPI

    opt.comm.Send([opt.local_model().numpy(), MPI.FLOAT], dest=opt.ps_rank, tag=_TAG_LOCAL)


def collect_locals(opt, failed=()) -> list:
    """Server, after a stop's :meth:`~hpcasync.ps.server.PSServer.finish`: every worker's model
    (:func:`send_local`; None for the dead workers in ``failed``), in worker order. Holds W model
    copies until the checkpoint is written."""
    from mpi4py import MPI

    out = []
    for w, rank in enumerate(opt.worker_ranks):          # world ranks
        local = None
        if w not in failed:
            local = torch.empty(opt.flat.numel)
            opt.comm.Recv([local.numpy(), MPI.FLOAT], source=rank, tag=_TAG_LOCAL)
        out.append(local)
    return out
