"""Ringmaster ASGD: asynchronous SGD that applies a gradient only when its delay is below a
threshold R (Maranjyan, Tyurin, Richtárik, "Ringmaster ASGD: the first asynchronous SGD with
optimal time complexity", ICML 2025).

Math, on push(i, g) computed at version v (δ = version − v updates since)::

    if δ < R:   d ← g + wd·θ;  θ ← θ − η·d  (through the shared momentum buffer when γ > 0);
                version ← version + 1
    else:       g is dropped: θ and the version stay
    reply θ     (the worker goes on from the current θ either way)

Example::

    rule = Ringmaster(theta0, num_workers=8, lr=0.1, threshold=8)
    reply = rule.on_push(3, grad, PushMeta(version=v))    # dropped when rule.version - v >= 8

Design: docs/design/rules.md#ringmaster-asgd. Differences from the paper: :class:`Ringmaster`.
"""
from __future__ import annotations

from torch import Tensor

from .asgd import ASGD, asgd_update
from .base import PushMeta, check_int, noise_over_target, need


def theorem_threshold(sigma2: float, epsilon: float) -> int:
    """The paper's choice of R: ``max(1, ⌈σ²/ε⌉)`` for gradient noise σ² and target ε (the
    squared gradient norm to reach); its step size is then ``min(1/(2RL), ε/(4Lσ²))``."""
    return noise_over_target(sigma2, epsilon)


class Ringmaster(ASGD):
    """ASGD that drops every gradient whose delay has reached ``threshold``.

    Args:
        theta0, num_workers, lr, weight_decay: see :class:`~hpcasync.rules.base.Rule`.
        threshold: R >= 1, the smallest delay that is dropped (default: the number of workers,
            below).
        momentum: γ of one shared momentum buffer over the applied gradients (default 0: none,
            as in the paper).

    Default R = N: with workers of equal speed the delays of ASGD are about N − 1, so nothing is
    dropped and the rule is ASGD; a worker slower than the others has its gradients dropped, and
    the fast ones set the pace. The paper sets R = max(1, ⌈σ²/ε⌉) (:func:`theorem_threshold`)
    from quantities a user rarely knows; ``threshold=`` takes that value or any other.

    Differences from the paper: the paper's variant that stops a computation as soon as it has
    become too stale is not built: a worker here computes between the server's reply and its next
    push and is not interrupted (MPI gives the server no way to reach into that step); its
    gradient is dropped when it arrives. The server counts the dropped gradients
    (``discarded``; the run's summary shows them under ``rule_workers``). A dropped push still
    uses the worker's batch (it counts toward the epoch), as computing it did in the paper.
    """

    name = "ringmaster"

    def __init__(self, theta0: Tensor, num_workers: int, *, lr: float, weight_decay: float = 0.0,
                 threshold: int | None = None, momentum: float = 0.0):
        super().__init__(theta0, num_workers, lr=lr, weight_decay=weight_decay, momentum=momentum)
        self.threshold = check_int("threshold", self.num_workers if threshold is None
                                   else threshold, low=1)
        self.discarded = 0

    def _update(self, worker: int, grad: Tensor, meta: PushMeta) -> bool:
        if self.staleness(meta) >= self.threshold:
            self.discarded += 1
            return False
        asgd_update(self._theta, grad, self._momentum_buffer(), lr=self.coef(),
                    momentum=self.momentum, weight_decay=self.wd)
        return True

    def _state(self) -> dict:
        return {**super()._state(), "discarded": self.discarded}

    def _load(self, d: dict) -> None:
        super()._load(d)
        self.discarded = int(need(d, "discarded"))
