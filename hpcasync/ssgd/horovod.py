"""``--backend horovod``: the SSGD loop driven by Horovod's own ``DistributedOptimizer``.

Presents the same small surface as :class:`hpcasync.ssgd.DistributedOptimizer` (step,
zero_grad, broadcast_parameters, average_buffers, counters) so the training loop is shared and the
two backends are compared on identical work. Horovod is initialised on the given communicator.
"""
from __future__ import annotations

import time

import torch


def check_backend(backend: str) -> None:
    """Pre-MPI check of ``--backend``: ``horovod`` needs an importable Horovod (ssgd, daso)."""
    if backend != "horovod":
        return
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        from ..errors import ConfigError

        raise ConfigError("--backend horovod: Horovod is not installed; "
                          "run scripts/install-horovod.sh") from None


class HorovodOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, comm, *,
                 compression: str | None = None):
        import horovod.torch as hvd

        if not hvd.is_initialized():
            hvd.init(comm=comm)
        self.hvd = hvd
        self.model = model
        comp = hvd.Compression.fp16 if compression in ("fp16", "bf16") else hvd.Compression.none
        self.optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                  compression=comp)
        self.numel = sum(p.numel() for p in model.parameters())
        self.steps = 0
        self.bytes_sent = 0
        self.comm_time = 0.0     # Horovod overlaps allreduce with backward: this is the wait in step()

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def broadcast_parameters(self, root: int = 0) -> None:
        self.hvd.broadcast_parameters(self.model.state_dict(), root_rank=root)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self):
        t0 = time.perf_counter()
        self.optimizer.synchronize()
        self.comm_time += time.perf_counter() - t0
        self.bytes_sent += self.numel * 4
        self.steps += 1
        with self.optimizer.skip_synchronize():
            return self.optimizer.step()

    def average_buffers(self) -> None:
        for name, buf in self.model.named_buffers():
            if buf.dtype.is_floating_point:
                buf.copy_(self.hvd.allreduce(buf, op=self.hvd.Average, name=f"buffer.{name}"))

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
