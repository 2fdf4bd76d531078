"""DC-ASGD: asynchronous SGD with delay compensation (Zheng et al., "Asynchronous Stochastic Gradient
Descent with Delay Compensation", ICML 2017; elementwise form as in MXNet's ``dcasgd`` optimizer,
per-worker state as in Microsoft Multiverso's DC-ASGD updater).

The PS keeps, per worker i, a backup θ_bak(i) = the parameters last sent to worker i. On push(i, g)::

    g̃ ← g + λ ⊙ g ⊙ g ⊙ (θ − θ_bak(i))          (first-order Taylor correction of the stale g)
    θ ← θ − η·(g̃ + wd·θ)                          (optionally through one shared momentum buffer)
    θ_bak(i) ← θ ; reply θ

λ is either a constant (``mode="constant"``, DC-ASGD-c, λ = 0.04) or per element
(``mode="adaptive"``, DC-ASGD-a)::

    MS(i) ← m·MS(i) + (1 − m)·g ⊙ g ;   λ = λ₀ / √(MS(i) + ε)      (λ₀ = 2, m = 0.95, ε = 1e-7)

Example::

    rule = DCASGD(theta0, num_workers=4, lr=0.1, mode="adaptive")
    w0 = rule.initial_reply(0).params.clone()        # records θ_bak(0)
    reply = rule.on_push(0, grad, PushMeta(version=0))

Design: docs/design/rules.md#dc-asgd (memory, sharding). Differences from the paper:
:class:`DCASGD`.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor

from .asgd import asgd_update
from .base import PushMeta, Rule, check_choice, check_real, load_worker_tensors

log = logging.getLogger(__name__)

DEFAULT_LAMBDA = {"constant": 0.04, "adaptive": 2.0}


def dcasgd_adaptive_lambda(ms: Tensor, grad: Tensor, *, lam0: float = 2.0,
                           ms_momentum: float = 0.95, eps: float = 1e-7) -> Tensor:
    """Update the mean square ``ms`` in place, ``ms ← m·ms + (1−m)·g⊙g``, and return the
    per-element ``λ = lam0 / √(ms + eps)`` (a new tensor)."""
    ms.mul_(ms_momentum).addcmul_(grad, grad, value=1.0 - ms_momentum)
    return ms.add(eps).rsqrt_().mul_(lam0)


def dc_compensated(theta: Tensor, grad: Tensor, backup: Tensor, lam: float | Tensor) -> Tensor:
    """``g + λ·g⊙g⊙(θ − backup)`` as a new tensor (λ a float or a per-element tensor)."""
    comp = theta.sub(backup).mul_(grad).mul_(grad).mul_(lam)
    return comp.add_(grad)


def dcasgd_update(theta: Tensor, grad: Tensor, backup: Tensor, *, lr: float | Tensor,
                  lam: float | Tensor, weight_decay: float | Tensor = 0.0,
                  momentum_buf: Tensor | None = None,
                  momentum: float = 0.0) -> None:
    """One DC-ASGD step in place on ``theta`` (and ``momentum_buf``); then ``backup ← θ``."""
    g_tilde = dc_compensated(theta, grad, backup, lam)
    asgd_update(theta, g_tilde, momentum_buf, lr=lr, momentum=momentum, weight_decay=weight_decay)
    backup.copy_(theta)


class DCASGD(Rule):
    """DC-ASGD, constant (``mode="constant"``) or adaptive (``mode="adaptive"``) λ.

    Args:
        theta0, num_workers, lr, weight_decay: see :class:`~hpcasync.rules.base.Rule`.
        mode: ``"constant"`` (DC-ASGD-c) or ``"adaptive"`` (DC-ASGD-a).
        lam: λ for constant mode (default 0.04) or λ₀ for adaptive mode (default 2.0).
        ms_momentum: m of the mean square (adaptive; default 0.95).
        eps: ε under the square root (adaptive; default 1e-7).
        momentum: γ of one shared momentum buffer (default 0: none, as in the paper).

    Differences from the paper:
    * Decision (spec): MS is kept per worker, as Multiverso does (the paper's formula has one
      MS). MS is updated with the current g before λ is computed; it starts at zero.
    * Weight decay enters as ``+ wd·θ`` after compensation (MXNet's form); the compensation uses
      the raw gradient g.
    * Backups are created by ``initial_reply`` (what was sent). A push from a worker that never
      got an ``initial_reply`` is applied without compensation (logged once) and starts its
      backup.
    """

    name = "dcasgd"

    def __init__(self, theta0: Tensor, num_workers: int, *, lr: float, weight_decay: float = 0.0,
                 mode: str = "constant", lam: float | None = None, ms_momentum: float = 0.95,
                 eps: float = 1e-7, momentum: float = 0.0):
        super().__init__(theta0, num_workers, lr=lr, weight_decay=weight_decay)
        self.mode = check_choice("mode", mode, DEFAULT_LAMBDA)
        self.lam = check_real("lam", DEFAULT_LAMBDA[mode] if lam is None else lam, low=0.0)
        self.ms_momentum = check_real("ms_momentum", ms_momentum, low=0.0, high=1.0, high_open=True)
        self.eps = check_real("eps", eps, low=0.0, low_open=True)
        self.momentum = check_real("momentum", momentum, low=0.0, high=1.0, high_open=True)
        if self.mode == "adaptive":
            self.name = "dcasgd-a"
        self._buf = self._theta.new_zeros(self._theta.shape) if self.momentum else None
        self._backup: dict[int, Tensor] = {}
        self._ms: dict[int, Tensor] = {}
        self._warned = False

    def _join(self, worker: int) -> None:
        b = self._backup.get(worker)
        if b is None:
            self._backup[worker] = self._theta.clone()
        else:
            b.copy_(self._theta)

    def _leave(self, worker: int) -> None:
        self._backup.pop(worker, None)
        self._ms.pop(worker, None)

    def _update(self, worker: int, grad: Tensor, meta: PushMeta) -> None:
        backup = self._backup.get(worker)
        if backup is None:
            if not self._warned:
                log.warning("%s: worker %d pushed before initial_reply; its first push is not "
                            "compensated", self.name, worker)
                self._warned = True
            backup = self._backup[worker] = self._theta.clone()
        if self.mode == "adaptive":
            ms = self._ms.get(worker)
            if ms is None:
                ms = self._ms[worker] = torch.zeros_like(self._theta)
            lam = dcasgd_adaptive_lambda(ms, grad, lam0=self.lam, ms_momentum=self.ms_momentum,
                                         eps=self.eps)
        else:
            lam = self.lam
        dcasgd_update(self._theta, grad, backup, lr=self.coef(), lam=lam,
                      weight_decay=self.wd, momentum_buf=self._momentum_buffer(),
                      momentum=self.momentum)

    def _state(self) -> dict:
        d = super()._state()
        d["backup"] = self._backup
        d["ms"] = self._ms
        if self._buf is not None:
            d["momentum_buf"] = self._buf
        return d

    def _summary(self) -> dict:
        return {"dc_backups": sorted(int(w) for w in self._backup)}

    def _load(self, d: dict) -> None:
        self._backup = load_worker_tensors(d, "backup", self._theta, self.num_workers)
        self._ms = load_worker_tensors(d, "ms", self._theta, self.num_workers)
        self._load_buffer(d)
