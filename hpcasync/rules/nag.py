"""NAG-ASGD: asynchronous SGD with ONE shared Nesterov momentum buffer on the PS (a baseline of the
SMEGA2 and DANA papers: Cohen, Hakimi, Schuster, ICPP 2022; Hakimi et al., "Taming momentum in a
distributed asynchronous environment", 2019).

Math, on push(i, g) (PyTorch's Nesterov form, ``torch.optim.SGD(nesterov=True)``)::

    d ← g + wd·θ
    v ← γ·v + d
    θ ← θ − η·(d + γ·v)
    reply θ

Example::

    rule = NAG(theta0, num_workers=8, lr=0.1, momentum=0.9)

Design: docs/design/rules.md#nag-asgd (sharding). Differences from the paper: :class:`NAG`.
"""
from __future__ import annotations

from torch import Tensor

from .asgd import ASGD
from ..errors import ConfigError


class NAG(ASGD):
    """ASGD with a shared Nesterov momentum buffer (default γ 0.9).

    Differences from the paper: the papers name the baseline without fixing the Nesterov
    formulation; we use PyTorch's (Sutskever) form (the module's math), so NAG-ASGD with one
    worker equals ``torch.optim.SGD(..., nesterov=True)`` step for step.
    """
    name = "nag"

    def __init__(self, theta0: Tensor, num_workers: int, *, lr: float, weight_decay: float = 0.0,
                 momentum: float = 0.9):
        super().__init__(theta0, num_workers, lr=lr, weight_decay=weight_decay,
                         momentum=momentum, nesterov=True)
        if self.momentum == 0:
            raise ConfigError("nag needs momentum > 0, got 0 (use asgd for plain SGD)")
