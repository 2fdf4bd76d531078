"""SSGD's optimizer: average gradients across ranks, then the user's optimizer step.

Every step, every rank averages its gradient with all the others' (one allreduce over the flat
gradient buffer) and applies the same local optimizer step, so replicas stay bitwise identical
(invariant 3). The gradient's path: ``loss.backward()`` writes into views of ``FlatModel.grads`` ->
``DistributedOptimizer.synchronize()`` allreduce-averages that one buffer in place ->
the user's ``optimizer.step()`` reads the averaged ``p.grad`` views.
"""
from __future__ import annotations

import logging
import time

import torch

from ..comm import allreduce
from ..comm.broadcast import broadcast
from ..errors import ConfigError
from ..optim import AlgorithmOptimizer, as_flat
from ..topology import init_mpi

log = logging.getLogger("hpcasync")


class DistributedOptimizer(AlgorithmOptimizer):
    """SSGD: wrap a torch optimizer so ``step()`` first averages gradients across ``comm``.

    Args:
        optimizer: the user's optimizer over the model's parameters (any torch optimizer).
        model: the model (an ``nn.Module``, flattened here; or its :class:`FlatModel`).
        comm: the communicator to average over (default: every rank, ``MPI.COMM_WORLD``).
        backward_passes_per_step: gradients of this many ``step()`` calls are accumulated locally
            before one allreduce and one optimizer step (as Horovod's option of the same name).
        compress: ``None``, ``"bf16"`` or ``"fp16"``: the wire format of the allreduce.
        average_buffers: average floating buffers (BatchNorm running statistics) in the same
            allreduce as the gradients, every step (default True: replicas stay bitwise identical,
            buffers included; the cost is the buffers' few bytes). False: only when
            :meth:`average_buffers` is called (the CLI did this at epoch ends before).

    It is a ``torch.optim.Optimizer`` whose ``param_groups``/``state`` are the wrapped optimizer's,
    so LR schedulers and ``state_dict`` work on it (:mod:`hpcasync.optim`).

    Example::

        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
        opt.broadcast_parameters(root=0)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    """

    algorithm = "ssgd"

    def __init__(self, optimizer: torch.optim.Optimizer, model, comm=None, *,
                 backward_passes_per_step: int = 1, compress: str | None = None,
                 average_buffers: bool = True):
        if backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if compress not in (None, "bf16", "fp16"):
            raise ConfigError(f"compress must be None, 'bf16' or 'fp16', got {compress!r}")
        self._wrap(as_flat(model), optimizer)
        if comm is None:
            comm = init_mpi().COMM_WORLD
        self.comm = comm
        self.backward_passes_per_step = backward_passes_per_step
        self.compress = compress
        self.sync_buffers = bool(average_buffers) and self.flat.buffer_numel > 0
        self.passes = 0            # backward passes accumulated since the last step
        self.steps = 0             # optimizer steps taken
        self.bytes_sent = 0        # payload bytes handed to allreduce by this rank
        self.comm_time = 0.0       # seconds spent in allreduce
        self._synchronized = False
        self._skip = False

    def broadcast_parameters(self, root: int = 0) -> None:
        """Make every replica start from ``root``'s parameters and buffers (not from seeds)."""
        for tensor in (self.flat.params, self.flat.buffers):
            if tensor.numel():
                broadcast(self.comm, tensor, root=root)

    def synchronize(self) -> None:
        """Average the flat gradient buffer (and the float buffers, with ``average_buffers``)
        across ranks, in place. Called by ``step()``."""
        self._collect()
        t0 = time.perf_counter()
        if self.sync_buffers:
            self.flat.buffer_wire.copy_(self.flat.buffers)
            wire = self.flat.grads_and_buffers
        else:
            wire = self.flat.grads
        allreduce(self.comm, wire, average=True, compress=self.compress)
        if self.sync_buffers:
            self.flat.buffers.copy_(self.flat.buffer_wire)
        self.comm_time += time.perf_counter() - t0
        self.bytes_sent += wire.numel() * (2 if self.compress else 4)
        self._synchronized = True

    def _check_skip(self) -> None:
        if not self._synchronized:
            log.warning("skip_synchronize() without synchronize(): gradients are not averaged")

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffer (the gradients stay its views whatever ``set_to_none``
        says); mid-accumulation (``backward_passes_per_step``) it keeps the partial sum."""
        if self.passes:
            return
        self.flat.zero_grad()

    def average_buffers(self) -> None:
        """Average floating-point module buffers (BatchNorm running statistics) across ranks."""
        if self.flat.buffers.numel():
            allreduce(self.comm, self.flat.buffers, average=True)

    def _extra_state(self) -> dict:
        return {"steps": self.steps}

    def _load_extra(self, extra: dict) -> None:
        self.steps = int(extra.get("steps", 0))
