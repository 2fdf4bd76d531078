"""SSGD's optimizer: average gradients across ranks, then the user's optimizer step.

Every step, every rank averages its gradient with all the others' (one allreduce over the flat
gradient buffer) and applies the same local optimizer step, so replicas stay bitwise identical
(invariant 3). The gradient's path: ``loss.backward()`` writes into views of ``FlatModel.grads`` ->
``DistributedOptimizer.synchronize()`` allreduce-averages that one buffer in place ->
the user's ``optimizer.step()`` reads the averaged ``p.grad`` views.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from ..comm import FlatModel, allreduce
from ..comm.broadcast import broadcast
from ..errors import ConfigError

log = logging.getLogger("hpcasync")


class DistributedOptimizer:
    """Wrap a torch optimizer so ``step()`` first averages gradients across ``comm``.

    Args:
        optimizer: the user's optimizer over the parameters of ``flat``'s module.
        flat: the :class:`~hpcasync.comm.FlatModel` whose ``grads`` buffer backs every ``p.grad``.
        comm: the communicator to average over (all data-parallel ranks).
        backward_passes_per_step: gradients of this many ``step()`` calls are accumulated locally
            before one allreduce and one optimizer step (as Horovod's option of the same name).
        compress: ``None``, ``"bf16"`` or ``"fp16"``: the wire format of the allreduce.

    The wrapper forwards ``param_groups`` and ``state``, so LR schedulers work on it unchanged.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, flat: FlatModel, comm, *,
                 backward_passes_per_step: int = 1, compress: str | None = None):
        if backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self.optimizer = optimizer
        self.flat = flat
        self.comm = comm
        self.backward_passes_per_step = backward_passes_per_step
        self.compress = compress
        self.passes = 0            # backward passes accumulated since the last step
        self.steps = 0             # optimizer steps taken
        self.bytes_sent = 0        # payload bytes handed to allreduce by this rank
        self.comm_time = 0.0       # seconds spent in allreduce
        self._synchronized = False
        self._skip = False

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def broadcast_parameters(self, root: int = 0) -> None:
        """Make every replica start from ``root``'s parameters and buffers (not from seeds)."""
        for tensor in (self.flat.params, self.flat.buffers):
            if tensor.numel():
                broadcast(self.comm, tensor, root=root)

    def synchronize(self) -> None:
        """Average the flat gradient buffer across ranks, in place. Called by ``step()``."""
        t0 = time.perf_counter()
        allreduce(self.comm, self.flat.grads, average=True, compress=self.compress)
        self.comm_time += time.perf_counter() - t0
        self.bytes_sent += self.flat.grads.numel() * (2 if self.compress else 4)
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use after an explicit ``synchronize()`` (e.g. to clip averaged gradients) before step."""
        if not self._synchronized:
            log.warning("skip_synchronize() without synchronize(): gradients are not averaged")
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        if closure is not None:
            raise ConfigError("DistributedOptimizer.step does not take a closure")
        self.passes += 1
        if self.passes < self.backward_passes_per_step:
            return None          # keep accumulating into the flat gradient buffer
        if not self._skip:
            self.synchronize()
        self.passes = 0
        self._synchronized = False
        self.steps += 1
        return self.optimizer.step()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient buffer (``set_to_none`` would detach ``p.grad`` from it)."""
        if self.passes:
            return               # mid-accumulation: keep the partial sum
        self.flat.grads.zero_()

    def average_buffers(self) -> None:
        """Average floating-point module buffers (BatchNorm running statistics) across ranks."""
        if self.flat.buffers.numel():
            allreduce(self.comm, self.flat.buffers, average=True)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
