"""``ODSGD``: OD-SGD (Xu et al., arXiv 2005.06728) as an optimizer for a user's own loop.

It owns its hyperparameters (there is no user optimizer: the global step is momentum SGD on the
mean gradient, the local step is LocalOpt, see :mod:`.core`). After ``step()`` the model holds the
*local* weights W^l_{t+1} the next gradient is computed on, while round t is in flight; use
:meth:`ODSGD.global_weights` to evaluate the global model and :meth:`ODSGD.finish` at the end::

    opt = hpcasync.ODSGD(model, lr=0.05, momentum=0.9)      # collective
    for epoch in range(epochs):
        for x, y in loader:
            opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
        with opt.global_weights():                          # collective: BN buffers averaged too
            evaluate(model)
    opt.finish()                                            # the model holds the global W

An LR scheduler drives ``param_groups[0]["lr"]`` (the global lr); ``"lr_local"``, ``"momentum"``
and ``"weight_decay"`` are read from the same group at every step. Forgetting :meth:`finish`
does not hang: the round in flight is completed at interpreter exit (with a warning).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import weakref

import torch

from ..errors import CheckpointError, ConfigError
from ..optim import AlgorithmOptimizer, as_flat
from ..topology import default_topology
from .checkpoint import global_state, load_state, local_state
from .core import ODSGDHyper
from .pipeline import ODSGDWorker

log = logging.getLogger("hpcasync")

_GROUP_KEYS = ("lr", "momentum", "weight_decay", "lr_local")


class ODSGD(AlgorithmOptimizer):
    """OD-SGD on every rank of ``comm``.

    Args:
        model: the model (flattened here; the same architecture on every rank).
        lr, momentum, weight_decay: the global momentum-SGD step.
        local_opt: ``"sgd"``, ``"dc"`` or ``"dc-adaptive"`` (default); lr_local (η_l), lam (λ/λ₀),
            delta (``"last-step"``/``"gap"``), ms_momentum, eps: see :class:`ODSGDHyper`.
        warmup_iters: the first N steps are plain SSGD (200).
        comm: the communicator (default: the job's world).
        progress: how the round in flight progresses: ``"thread"`` (default), ``"hooks"``,
            ``"none"`` (:mod:`hpcasync.odsgd.runtime` has the measurements).
        broadcast: start every rank from rank 0's parameters (default True).
    """

    algorithm = "odsgd"

    def __init__(self, model, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 local_opt: str = "dc-adaptive", lr_local: float = 0.5, lam: float | None = None,
                 delta: str = "last-step", ms_momentum: float = 0.0, eps: float = 1e-7,
                 warmup_iters: int = 200, comm=None, progress: str = "thread",
                 broadcast: bool = True):
        hp = ODSGDHyper(lr=lr, momentum=momentum, weight_decay=weight_decay, local_opt=local_opt,
                        lr_local=lr_local, lam=lam, delta=delta, ms_momentum=ms_momentum, eps=eps,
                        warmup_iters=warmup_iters)
        flat = as_flat(model)
        self._own(flat, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                         "lr_local": lr_local})
        comm = default_topology().world if comm is None else comm
        self.comm = comm
        self.worker = ODSGDWorker(flat, comm, hp=hp, progress=progress)
        if broadcast:
            self.worker.broadcast_parameters(root=0)
        self._finished = False
        atexit.register(_at_exit, weakref.ref(self))

    @property
    def hp(self) -> ODSGDHyper:
        return self.worker.hp

    @property
    def steps(self) -> int:
        return self.worker.steps

    def step(self, closure=None):
        """After backward: round t starts with this gradient (warm-up: a blocking SSGD step); the
        model then holds the local weights the next gradient is computed on."""
        if closure is not None:
            raise ConfigError("ODSGD.step does not take a closure")
        if self._finished:
            raise ConfigError("ODSGD: step() after finish()")
        if len(self.param_groups) != 1:
            raise ConfigError("ODSGD has one param group (its lr applies to the whole model)")
        self._collect()
        group = self.param_groups[0]
        hp = self.worker.hp
        if any(float(group[k]) != getattr(hp, k) for k in _GROUP_KEYS):
            self.worker.hp = dataclasses.replace(hp, **{k: float(group[k]) for k in _GROUP_KEYS})
        self.worker.step()

    def synchronize(self) -> None:
        """Complete and apply the round in flight (the global W then has every gradient)."""
        self.worker.synchronize()

    @contextlib.contextmanager
    def global_weights(self, *, average_buffers: bool = True):
        """Collective. Inside: the model holds the global W (and, ``average_buffers``, the
        rank-averaged BatchNorm buffers, which it keeps); after: the local weights again."""
        if average_buffers:
            self.worker.average_buffers()
        with self.worker.global_weights() as W:
            yield W

    def average_buffers(self) -> None:
        """Collective: average the float buffers (BatchNorm statistics) over the ranks."""
        self.worker.average_buffers()

    def finish(self, *, average_buffers: bool = True):
        """Collective: complete the pipeline; the model keeps the global W (and averaged buffers).
        Returns the model."""
        if not self._finished:
            if average_buffers:
                self.worker.average_buffers()
            self.worker.finish()
            self._finished = True
        return self.flat.module

    def broadcast_parameters(self, root: int = 0) -> None:
        self.worker.broadcast_parameters(root=root)

    def set_comm(self, comm) -> None:
        """Run over ``comm`` from now on (after a ULFM recovery shrank the world; see
        :meth:`ODSGDWorker.set_comm`)."""
        self.comm = comm
        self.worker.set_comm(comm)

    # -- state ------------------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        """This rank's view: the global state (identical on every rank) and its own local
        weights, mean square and buffers (a user checkpoint written by rank 0 resumes every rank
        from rank 0's local state: a valid OD-SGD state, not a bitwise replay)."""
        self.worker.synchronize()
        return {"global": global_state(self.worker), "local": local_state(self.worker)}

    def _load_extra(self, extra: dict) -> None:
        load_state(self.worker, extra["global"], extra["local"])

    def _load_plain(self, base: dict, *, ours: bool) -> None:
        """A plain torch optimizer's state (e.g. ``torch.optim.SGD``): its lr, momentum and weight
        decay, and its momentum buffers as the global momentum buffer v."""
        state = base.get("state") or {}
        bufs = [state.get(i, {}).get("momentum_buffer") for i in base["param_groups"][0]["params"]]
        super()._load_plain({**base, "state": {}} if ours or any(b is not None for b in bufs)
                            else base, ours=ours)
        if not ours and any(b is not None for b in bufs):
            if len(bufs) != len(self.flat.shapes) or any(
                    b is not None and tuple(b.shape) != s for b, s in zip(bufs, self.flat.shapes)):
                raise CheckpointError("ODSGD: the optimizer state's momentum buffers do not fit "
                                      "this model")
            with torch.no_grad():
                for (offset, shape), b in zip(zip(self.flat.offsets, self.flat.shapes), bufs):
                    n = int(torch.Size(shape).numel())
                    view = self.worker.glob.buf[offset: offset + n]
                    view.copy_(b.reshape(-1) if b is not None else torch.zeros(n))


def _at_exit(ref) -> None:
    opt = ref()
    if opt is not None and not opt._finished and opt.worker.round is not None:
        log.warning("ODSGD: finish() was not called; completing the round in flight at exit "
                    "(the model holds this rank's local weights)")
        opt.worker.synchronize()
