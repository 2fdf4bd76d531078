"""SlowMo (Wang, Tantia, Ballas, Rabbat, ICLR 2020): local SGD with a slow momentum on the
averaged displacement, as fairscale's ``SlowMoDistributedDataParallel`` applies it (its base
algorithm local SGD; the update of ``_perform_local_optimization``).

Each rank steps its own optimizer on its own replica; after every H-th step (``period``,
fairscale's ``slowmo_frequency``) the replicas are averaged exactly, x̄ = (1/N)·Σ_i θ_i (divided
by N, then summed), and with x₀ the parameters after the previous sync, γ the parameter group's
current lr, β the slow momentum and α the slow lr::

    u ← β·u − x̄/γ + x₀/γ          (u.mul_(β).sub_(x̄, alpha=1/γ).add_(x₀, alpha=1/γ))
    x₀ ← x₀ − α·γ·u
    θ_i ← x₀ on every rank

With β = 0 and α = 1 this is local SGD (θ_i ← x̄). ``warmup_steps`` SSGD steps may come first
(post-local, as :class:`~hpcasync.ssgd.LocalSGD`; default 0). Tests: ``tests/mpi/test_slowmo.py``
against a one-process replay of the formula (fairscale is not installed here; it is the
formula's source, not run).

Example (a user's own loop)::

    opt = hpcasync.optimizer("slowmo", model, torch.optim.SGD(model.parameters(), lr=0.1,
                             momentum=0.9), period=48, slow_momentum=0.5, slow_lr=1.0)

Design: docs/design/ssgd.md, "SlowMo".
"""
from __future__ import annotations

import torch

from ..errors import ConfigError
from .localsgd import LocalSGD

__all__ = ["SlowMo"]

#: fairscale's defaults: slowmo_frequency, slowmo_momentum, slowmo_lr
DEFAULT_PERIOD, DEFAULT_MOMENTUM, DEFAULT_SLOW_LR = 48, 0.5, 1.0


class SlowMo(LocalSGD):
    """Local SGD with SlowMo's slow momentum at each sync (module doc).

    Args:
        optimizer, model, comm: as :class:`~hpcasync.ssgd.DistributedOptimizer`.
        period: H, local steps between two syncs (fairscale's ``slowmo_frequency``, 48).
        slow_momentum: β in [0, 1) (``slowmo_momentum``, 0.5).
        slow_lr: α > 0 (``slowmo_lr``, 1.0).
        warmup_steps: SSGD steps first (default 0).
    """

    algorithm = "slowmo"

    def __init__(self, optimizer: torch.optim.Optimizer, model, comm=None, *,
                 period: int = DEFAULT_PERIOD, slow_momentum: float = DEFAULT_MOMENTUM,
                 slow_lr: float = DEFAULT_SLOW_LR, warmup_steps: int = 0):
        check(slow_momentum, slow_lr)
        super().__init__(optimizer, model, comm, period=period, warmup_steps=warmup_steps)
        self.slow_momentum, self.slow_lr = float(slow_momentum), float(slow_lr)
        self.x0 = self.flat.params.detach().clone()
        #: each parameter's range of the flat buffer, by identity
        self._slices = {id(p): slice(lo, lo + p.numel())
                        for p, lo in zip(self.flat.parameters, self.flat.offsets)}
        self.u = torch.zeros_like(self.x0)

    @classmethod
    def cli_keywords(cls, given: dict, topo=None) -> dict:
        kw = super().cli_keywords(given, topo)
        check(kw.get("slow_momentum", DEFAULT_MOMENTUM), kw.get("slow_lr", DEFAULT_SLOW_LR))
        return kw

    def broadcast_parameters(self, root: int = 0) -> None:
        super().broadcast_parameters(root)
        self.x0.copy_(self.flat.params)

    def _syncs_after(self, k: int) -> bool:
        """Step k (0-based) ends with a sync: after every H-th step past the warm-up."""
        return k >= self.warmup_steps and (k + 1 - self.warmup_steps) % self.period == 0

    def step(self, closure=None):
        k = self.steps
        sync = self._syncs_after(k)
        with self._undone_on_failure(sync):
            result = super(LocalSGD, self).step(closure)
            if k == self.warmup_steps - 1:      # the warm-up's end: the replicas' common point
                self.x0.copy_(self.flat.params)
            if sync:
                self._slow_step()
        return result

    def _slow_step(self) -> None:
        self._average(only_with_grad=False)     # x̄, exact (the groups' parameters, buffers)
        with torch.no_grad():
            for g in self.param_groups:
                gamma = g["lr"]
                for p in g["params"]:
                    sl = self._slices.get(id(p))
                    if sl is None:
                        continue
                    u, x0 = self.u[sl], self.x0[sl]
                    u.mul_(self.slow_momentum).sub_(p.detach().reshape(-1), alpha=1 / gamma)
                    u.add_(x0, alpha=1 / gamma)
                    x0.add_(u, alpha=-gamma * self.slow_lr)
                    p.copy_(x0.view_as(p))

    def _counters(self) -> dict:
        return {**super()._counters(), "x0": self.x0.clone(), "u": self.u.clone()}

    def _set_counters(self, c: dict) -> None:
        super()._set_counters(c)
        self.x0.copy_(c["x0"])
        self.u.copy_(c["u"])

    def _extra_state(self) -> dict:
        return {**super()._extra_state(), "x0": self.x0.clone(), "u": self.u.clone()}

    def _load_extra(self, extra: dict) -> None:
        super()._load_extra(extra)
        if "x0" in extra:
            self.x0.copy_(extra["x0"])
            self.u.copy_(extra["u"])


def check(slow_momentum, slow_lr) -> None:
    """One-line errors for bad SlowMo options."""
    if not isinstance(slow_momentum, (int, float)) or not 0 <= slow_momentum < 1:
        raise ConfigError(f"slowmo slow_momentum must be in [0, 1), got {slow_momentum!r}")
    if not isinstance(slow_lr, (int, float)) or not 0 < slow_lr < float("inf"):
        raise ConfigError(f"slowmo slow_lr must be a number > 0, got {slow_lr!r}")
