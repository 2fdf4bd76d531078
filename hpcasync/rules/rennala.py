"""Rennala SGD: the server steps with the mean of B gradients all computed at its current θ, and
drops a gradient computed at an older one (Tyurin, Richtárik, "Optimal time complexities of
parallel stochastic optimization methods under a fixed computation model", NeurIPS 2023).

Math, on push(i, g) computed at version v (the server at version k, holding a sum s of b
gradients)::

    if v < k:   g is dropped (computed at an older θ)
    else:       s ← s + g;  b ← b + 1
                if b = B:  d ← s/B + wd·θ;  θ ← θ − B·η·d  (through the momentum buffer
                           when μ > 0);  s ← 0;  b ← 0;  k ← k + 1
    reply θ     (θ_k: a worker whose gradient did not complete the batch computes another one
                 at the same θ; a fast worker gives several gradients to one step)

Example::

    rule = Rennala(theta0, num_workers=8, lr=0.1, batch=8)
    reply = rule.on_push(3, grad, PushMeta(version=rule.version))   # the 8th fresh one steps:
    # θ ← θ − 8·0.1·(mean of the 8)

Design: docs/design/rules.md#rennala-sgd. Differences from the paper: :class:`Rennala`.
"""
from __future__ import annotations

from torch import Tensor

from ..errors import ConfigError
from .asgd import ASGD, asgd_update
from .base import PushMeta, StopsStale, check_int, noise_over_target, load_tensor, need


def theorem_batch(sigma2: float, epsilon: float) -> int:
    """The paper's choice of B: ``max(1, ⌈σ²/ε⌉)`` for gradient noise σ² and target ε (the
    squared gradient norm to reach); its step size is then ``min(1/L, εB/(2Lσ²))``."""
    return noise_over_target(sigma2, epsilon)


class Rennala(StopsStale, ASGD):
    """Asynchronous collection of ``batch`` fresh gradients, then one SGD step with their mean.

    Args:
        theta0, num_workers, lr, weight_decay: see :class:`~hpcasync.rules.base.Rule`.
        batch: B >= 1, the fresh gradients per step (default: the number of workers, below).
        momentum: γ of one momentum buffer over the steps (default 0: none, as in the paper).
        stop_stale: when θ steps, stop every computation at the old θ and start it again at the
            new one (the paper's broadcast; :class:`~hpcasync.rules.base.StopsStale`): the
            simulator only.

    Default B = N: one step per N fresh gradients, the batch of synchronous SGD over N workers,
    but taken from whichever workers deliver first, so a slow worker delays no step. The paper
    sets B = max(1, ⌈σ²/ε⌉) (:func:`theorem_batch`); ``batch=`` takes that value or any other.

    The lr η is per gradient, as in every rule of the server (ASGD moves θ by η·g for each
    gradient): the step on the mean of B gradients is γ = B·η (θ − η·Σg without weight decay
    and momentum), the linear scaling of synchronous SGD's large batches; the paper's step size
    min(1/L, εB/(2Lσ²)) grows with B as well. With the mean at η alone, the CLI's defaults (lr
    0.05, 3 workers, B 3, 2 epochs of the learning bars) reached 38-48 % instead of 59-69 %.

    Differences from the paper: in the paper the server hands a new θ to every worker when it
    steps and ignores what they were computing at the old one; the simulator does so with
    ``stop_stale=True`` (``--rennala-stop``). On MPI a worker gets θ with the
    reply to its push, so its computation at the old θ is finished, sent and dropped on arrival
    (the server counts them: ``discarded``, in the run's summary under ``rule_workers``). A
    dropped push still uses the worker's batch (it counts toward the epoch). The sum is kept in
    θ's dtype (float32), as an allreduce of the gradients would be.
    """

    name = "rennala"

    def __init__(self, theta0: Tensor, num_workers: int, *, lr: float, weight_decay: float = 0.0,
                 batch: int | None = None, momentum: float = 0.0, stop_stale: bool = False):
        super().__init__(theta0, num_workers, lr=lr, weight_decay=weight_decay, momentum=momentum)
        self.batch = check_int("batch", self.num_workers if batch is None else batch, low=1)
        self._sum = self._theta.new_zeros(self._theta.shape)
        self.collected = 0          # b: fresh gradients in the sum
        self.discarded = 0
        self.set_stop_stale(stop_stale)

    def check_run_length(self, pushes: int) -> None:
        """B more than every push of the run: θ would never step (the model at the end would be
        the initial one)."""
        if pushes < self.batch:
            raise ConfigError(f"rennala: batch (--rennala-batch) {self.batch} is more than the "
                              f"run's {pushes} pushes in all: θ would never step and the model at "
                              f"the end would be the initial one; lower it to at most {pushes} "
                              "or train longer")

    def is_stale(self, version: int) -> bool:
        """A gradient computed at ``version`` would be dropped if it arrived now (θ has moved)."""
        return int(version) < self._version

    def _update(self, worker: int, grad: Tensor, meta: PushMeta) -> bool:
        if self.is_stale(meta.version):
            self.discarded += 1
            return False
        self._sum.add_(grad)
        self.collected += 1
        if self.collected < self.batch:
            return False
        mean = self._sum.div_(self.batch)
        B = self.batch
        asgd_update(self._theta, mean, self._momentum_buffer(),
                    lr=self.coef(lambda lr: B * lr), momentum=self.momentum, weight_decay=self.wd)
        self._sum.zero_()
        self.collected = 0
        return True

    def _state(self) -> dict:
        return {**super()._state(), "sum": self._sum, "collected": self.collected,
                "discarded": self.discarded, **self._stop_state()}

    def _summary(self) -> dict:
        return {**super()._summary(), "discarded": self.discarded}    # gradients dropped

    def _load(self, d: dict) -> None:
        super()._load(d)
        self._sum = load_tensor(d, "sum", self._theta)
        self.collected = int(need(d, "collected"))
        self.discarded = int(need(d, "discarded"))
        self._load_stop(d)
