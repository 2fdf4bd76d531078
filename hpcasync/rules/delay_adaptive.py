"""Delay-adaptive ASGD: asynchronous SGD whose step shrinks with the delay of the gradient it
applies (Koloskova, Stich, Jaggi, "Sharper convergence guarantees for asynchronous SGD for
distributed and federated learning", NeurIPS 2022; Mishchenko, Bach, Even, Woodworth,
"Asynchronous SGD beats minibatch SGD under arbitrary delays", NeurIPS 2022). It is the baseline
Ringmaster ASGD's paper compares with.

Math, on push(i, g) computed at version v (δ = version − v updates since)::

    η_δ = η · min(1, τ_C / δ)        (η at δ ≤ τ_C; δ = 0 takes η)
    d ← g + wd·θ;  θ ← θ − η_δ·d     (through the shared momentum buffer when γ > 0)
    reply θ

Example::

    rule = DelayAdaptiveASGD(theta0, num_workers=8, lr=0.1)      # τ_C = 8
    reply = rule.on_push(3, grad, PushMeta(version=v))           # η·8/δ when δ > 8

Design: docs/design/rules.md#delay-adaptive-asgd. Differences from the papers:
:class:`DelayAdaptiveASGD`.
"""
from __future__ import annotations

from torch import Tensor

from .asgd import ASGD, asgd_update
from .base import PushMeta, check_int


def delay_factor(delay: int, tau_c: int) -> float:
    """``min(1, τ_C / δ)``: the factor of the lr at delay ``delay`` (1 at δ = 0)."""
    return 1.0 if delay <= tau_c else tau_c / delay


class DelayAdaptiveASGD(ASGD):
    """ASGD with the step of a gradient at delay δ scaled by ``min(1, τ_C/δ)``.

    Args:
        theta0, num_workers, lr, weight_decay: see :class:`~hpcasync.rules.base.Rule`.
        tau_c: τ_C >= 1, the delay up to which the full lr is used (default: the number of
            workers, below).
        momentum: γ of one shared momentum buffer over the applied gradients (default 0: none,
            as in the papers).

    The papers' step at delay δ is ``min(η, 1/(4Lδ))`` (Koloskova et al.: η itself at δ ≤ τ_C,
    the concurrency). L is rarely known; with η tuned for delays up to τ_C (η ≈ 1/(4Lτ_C)),
    ``1/(4Lδ) = η·τ_C/δ``: the rule here. Default τ_C = N, the concurrency of N workers: with
    workers of equal speed every delay is about N − 1 and the rule is ASGD; a slow worker's
    gradients are applied with a smaller step instead of being dropped (Ringmaster) or applied
    whole (ASGD).

    Differences from the papers: the step factor uses τ_C in place of 1/(4Lη) (above); the
    rest is ASGD's step (weight decay and momentum as options, 0 by default).
    """

    name = "asgd-da"

    def __init__(self, theta0: Tensor, num_workers: int, *, lr: float, weight_decay: float = 0.0,
                 tau_c: int | None = None, momentum: float = 0.0):
        super().__init__(theta0, num_workers, lr=lr, weight_decay=weight_decay, momentum=momentum)
        self.tau_c = check_int("tau_c", self.num_workers if tau_c is None else tau_c, low=1)

    def _update(self, worker: int, grad: Tensor, meta: PushMeta) -> None:
        factor = delay_factor(self.staleness(meta), self.tau_c)
        asgd_update(self._theta, grad, self._momentum_buffer(),
                    lr=self.coef(lambda lr: lr * factor), momentum=self.momentum,
                    weight_decay=self.wd)
