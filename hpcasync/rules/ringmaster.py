"""Ringmaster ASGD: asynchronous SGD that applies a gradient only when its delay is below a
threshold R (Maranjyan, Tyurin, Richtárik, "Ringmaster ASGD: the first asynchronous SGD with
optimal time complexity", ICML 2025).

Math, on push(i, g) computed at version v (δ = version − v updates since)::

    if δ < R:   d ← g + wd·θ;  θ ← θ − η·d  (through the shared momentum buffer when γ > 0);
                version ← version + 1
    else:       g is dropped: θ and the version stay
    reply θ     (the worker goes on from the current θ either way)

With ``stop_stale=True`` (the paper's variant that stops stale computations; the simulator
only): when θ's version reaches v + R for a worker still computing at version v, that
computation is stopped and the worker starts again at the current θ (:meth:`Ringmaster.stop`).

Example::

    rule = Ringmaster(theta0, num_workers=8, lr=0.1, threshold=8)
    reply = rule.on_push(3, grad, PushMeta(version=v))    # dropped when rule.version - v >= 8

Design: docs/design/rules.md#ringmaster-asgd. Differences from the paper: :class:`Ringmaster`.
"""
from __future__ import annotations

from torch import Tensor

from .asgd import ASGD, asgd_update
from .base import PushMeta, StopsStale, check_int, noise_over_target, need


def theorem_threshold(sigma2: float, epsilon: float) -> int:
    """The paper's choice of R: ``max(1, ⌈σ²/ε⌉)`` for gradient noise σ² and target ε (the
    squared gradient norm to reach); its step size is then ``min(1/(2RL), ε/(4Lσ²))``."""
    return noise_over_target(sigma2, epsilon)


class Ringmaster(StopsStale, ASGD):
    """ASGD that drops every gradient whose delay has reached ``threshold``.

    Args:
        theta0, num_workers, lr, weight_decay: see :class:`~hpcasync.rules.base.Rule`.
        threshold: R >= 1, the smallest delay that is dropped (default: the number of workers,
            below).
        momentum: γ of one shared momentum buffer over the applied gradients (default 0: none,
            as in the paper).
        stop_stale: stop a computation as soon as its delay reaches R (the paper's second
            variant; :class:`~hpcasync.rules.base.StopsStale`): the simulator only.

    Default R = N: with workers of equal speed the delays of ASGD are about N − 1, so nothing is
    dropped and the rule is ASGD; a worker slower than the others has its gradients dropped, and
    the fast ones set the pace. The paper sets R = max(1, ⌈σ²/ε⌉) (:func:`theorem_threshold`)
    from quantities a user rarely knows; ``threshold=`` takes that value or any other.

    Differences from the paper: the variant that stops a computation as soon as it has become too
    stale runs in the simulator only (``--ringmaster-stop``): an MPI worker computes between the
    server's reply and its next push and is not interrupted (the server has no way to reach into
    that step without a message the worker would have to poll for inside its forward and
    backward); there its gradient is dropped when it arrives. In the simulator a stopped
    computation costs the time it ran and uses no batch (the restarted one takes it). The server
    counts the dropped gradients
    (``discarded``; the run's summary shows them under ``rule_workers``). A dropped push still
    uses the worker's batch (it counts toward the epoch), as computing it did in the paper.
    """

    name = "ringmaster"

    def __init__(self, theta0: Tensor, num_workers: int, *, lr: float, weight_decay: float = 0.0,
                 threshold: int | None = None, momentum: float = 0.0, stop_stale: bool = False):
        super().__init__(theta0, num_workers, lr=lr, weight_decay=weight_decay, momentum=momentum)
        self.threshold = check_int("threshold", self.num_workers if threshold is None
                                   else threshold, low=1)
        self.set_stop_stale(stop_stale)
        self.discarded = 0

    def is_stale(self, version: int) -> bool:
        """A gradient computed at ``version`` would be dropped if it arrived now (delay ≥ R)."""
        return self._version - int(version) >= self.threshold

    def _update(self, worker: int, grad: Tensor, meta: PushMeta) -> bool:
        if self.is_stale(meta.version):
            self.discarded += 1
            return False
        asgd_update(self._theta, grad, self._momentum_buffer(), lr=self.coef(),
                    momentum=self.momentum, weight_decay=self.wd)
        return True

    def _state(self) -> dict:
        return {**super()._state(), "discarded": self.discarded, **self._stop_state()}

    def _summary(self) -> dict:
        return {**super()._summary(), "discarded": self.discarded}    # gradients dropped

    def _load(self, d: dict) -> None:
        super()._load(d)
        self.discarded = int(need(d, "discarded"))
        self._load_stop(d)
