"""ASGD: asynchronous parameter-server SGD (the baseline every other rule is compared with).

Math, on push(i, g) (PyTorch ``SGD`` semantics, dampening 0)::

    d ← g + wd·θ
    with momentum γ > 0 (ONE buffer shared by all workers):  v ← γ·v + d
        d ← v                (heavy ball, default)
        d ← d + γ·v          (Nesterov, ``nesterov=True``: see NAG-ASGD in nag.py)
    θ ← θ − η·d
    reply θ

The worker replaces its copy with θ and computes its next gradient there.

Example::

    rule = ASGD(theta0, num_workers=4, lr=0.1, momentum=0.9, weight_decay=1e-4)
    reply = rule.on_push(0, grad, PushMeta(version=0))

Design: docs/design/rules.md#asgd (sharding). Differences from the paper: :class:`ASGD`.
"""
from __future__ import annotations

from torch import Tensor

from .base import PushMeta, Rule, check_real, sub_scaled_, with_decay


def asgd_update(theta: Tensor, grad: Tensor, momentum_buf: Tensor | None = None, *,
                lr: float | Tensor, momentum: float = 0.0, weight_decay: float | Tensor = 0.0,
                nesterov: bool = False) -> None:
    """One SGD step in place on ``theta`` (and ``momentum_buf`` when momentum > 0).

    ``grad`` is not modified. ``momentum_buf`` must be given (zeros at the start) when
    ``momentum > 0``. ``lr`` and ``weight_decay``: floats, or per-element tensors (param groups).
    """
    d = with_decay(grad, theta, weight_decay)
    if momentum != 0:
        if momentum_buf is None:
            raise ValueError("asgd_update: momentum > 0 needs a momentum buffer")
        momentum_buf.mul_(momentum).add_(d)
        d = d.add(momentum_buf, alpha=momentum) if nesterov else momentum_buf
    sub_scaled_(theta, d, lr)


class ASGD(Rule):
    """Asynchronous SGD on the PS, optional single shared momentum buffer.

    Args:
        theta0, num_workers, lr, weight_decay: see :class:`~hpcasync.rules.base.Rule`.
        momentum: γ of the one shared buffer (default 0: none).
        nesterov: Nesterov form of the shared momentum (default False).

    Differences from the paper: none (the spec's plain baseline). The momentum buffer is created
    lazily as zeros on the first push, like ``torch.optim.SGD``'s, so the first step is ``v =
    d``.
    """

    name = "asgd"

    def __init__(self, theta0: Tensor, num_workers: int, *, lr: float, weight_decay: float = 0.0,
                 momentum: float = 0.0, nesterov: bool = False):
        super().__init__(theta0, num_workers, lr=lr, weight_decay=weight_decay)
        self.momentum = check_real("momentum", momentum, low=0.0, high=1.0, high_open=True)
        self.nesterov = bool(nesterov)
        self._buf = self._theta.new_zeros(self._theta.shape) if self.momentum else None

    def _update(self, worker: int, grad: Tensor, meta: PushMeta) -> None:
        asgd_update(self._theta, grad, self._momentum_buffer(), lr=self.coef(),
                    momentum=self.momentum, weight_decay=self.wd, nesterov=self.nesterov)

    def _state(self) -> dict:
        d = super()._state()
        if self._buf is not None:
            d["momentum_buf"] = self._buf
        return d

    def _load(self, d: dict) -> None:
        self._load_buffer(d)
