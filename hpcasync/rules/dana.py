"""DANA-Zero: asynchronous momentum SGD with one momentum buffer PER WORKER and a look-ahead reply
(Hakimi, Barkai, Gabel, Schuster, "Taming Momentum in a Distributed Asynchronous Environment",
2019; the baseline SMEGA2 compares its single buffer against).

On push(i, g)::

    g ← g + wd·θ
    v_i ← γ·v_i + g
    θ ← θ − η·v_i
    reply θ̂ = θ − ηγ·Σ_j v_j        (where θ would be if every worker's momentum were applied once)

PS memory: θ, the N buffers v_j and their running sum S = Σ_j v_j: N + 2 model copies, growing with
N (SMEGA2 holds 3 for any N).

Example::

    rule = DANAZero(theta0, num_workers=8, lr=0.1, momentum=0.9)
    reply = rule.on_push(3, grad, PushMeta(version=17))       # reply.params is θ̂

Design: docs/design/rules.md#dana-zero (sharding). Differences from the paper: :class:`DANAZero`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import (PushMeta, Reply, Rule, check_real, load_tensor, load_worker_tensors,
                   sub_scaled_, with_decay)


def dana_zero_update(theta: Tensor, grad: Tensor, v_i: Tensor, v_sum: Tensor, *,
                     lr: float | Tensor, momentum: float,
                     weight_decay: float | Tensor = 0.0) -> None:
    """One DANA-Zero push in place on θ, v_i and the running sum S (``grad`` not modified;
    ``lr``/``weight_decay`` floats or per-element tensors)."""
    g = with_decay(grad, theta, weight_decay)
    v_sum.sub_(v_i)
    v_i.mul_(momentum).add_(g)
    v_sum.add_(v_i)
    sub_scaled_(theta, v_i, lr)


def dana_zero_estimate(theta: Tensor, v_sum: Tensor, *, lr: float, momentum: float,
                       coef=None) -> Tensor:
    """θ̂ = θ − ηγ·Σ_j v_j (a new tensor). ``coef``: a rule's :meth:`~.base.Rule.coef`
    (param groups: ηγ per group, spread over θ); default ``lr * momentum``."""
    k = lr * momentum if coef is None else coef(lambda x: x * momentum)
    return sub_scaled_(theta.clone(), v_sum, k) if isinstance(k, Tensor) else theta.sub(v_sum, alpha=k)


class DANAZero(Rule):
    """DANA-Zero on the PS.

    Args:
        theta0, num_workers, lr, weight_decay: see :class:`~hpcasync.rules.base.Rule`.
        momentum: γ (default 0.9).

    Differences from the paper:
    * Σ_j v_j is kept as a running sum updated by ``S ← S − v_i(old) + v_i(new)`` (O(model) per
      push instead of O(N·model)); it equals the direct sum up to float rounding.
    * A worker's buffer is created as zeros on its first push; retiring a worker removes its
      buffer and its share of S (its momentum is no longer applied by anyone).
    """

    name = "dana"

    def __init__(self, theta0: Tensor, num_workers: int, *, lr: float, weight_decay: float = 0.0,
                 momentum: float = 0.9):
        super().__init__(theta0, num_workers, lr=lr, weight_decay=weight_decay)
        self.momentum = check_real("momentum", momentum, low=0.0, high=1.0, high_open=True)
        self._v: dict[int, Tensor] = {}
        self._sum = torch.zeros_like(self._theta)

    def _update(self, worker: int, grad: Tensor, meta: PushMeta) -> None:
        v_i = self._v.get(worker)
        if v_i is None:
            v_i = self._v[worker] = torch.zeros_like(self._theta)
        dana_zero_update(self._theta, grad, v_i, self._sum, lr=self.coef(), momentum=self.momentum,
                         weight_decay=self.wd)

    def _make_reply(self, worker: int, *, pushed: bool) -> Reply:
        return Reply(dana_zero_estimate(self._theta, self._sum, lr=self.lr,
                                        momentum=self.momentum, coef=self.coef), self._version)

    def _leave(self, worker: int) -> None:
        v = self._v.pop(worker, None)
        if v is not None:
            self._sum.sub_(v)

    def _state(self) -> dict:
        d = super()._state()
        d.update(v=self._v, v_sum=self._sum)
        return d

    def _load(self, d: dict) -> None:
        self._v = load_worker_tensors(d, "v", self._theta, self.num_workers)
        self._sum = load_tensor(d, "v_sum", self._theta)
