"""SMEGA2: asynchronous momentum SGD with a single momentum buffer (Cohen, Hakimi, Schuster,
"SMEGA2: Distributed Asynchronous Deep Neural Network Training With a Single Momentum Buffer",
ICPP 2022; reference code rafi-cohen/SMEGA2).

PS state: θ, ONE momentum buffer v, a cycle accumulator a, a counter c (mod N). Workers keep no
optimizer state. On push(i, g)::

    g ← g + wd·θ
    c ← (c + 1) mod N ;  a ← a + g ;  θ ← θ − η·(g + γ·v)
    if c == 0:  v ← γ·v + a/N ;  a ← 0

The reply is not θ but an estimate of θ N updates ahead, future gradients taken as zero::

    advanced (default):  θ̂ = θ − ηγ·[(N + c(γ − 1))·v + (c/N)·a]
    naive:               θ̂ = θ − ηγN·v

The worker sets its copy to θ̂ and computes its next gradient there; evaluate on θ, not θ̂.
PS memory: 3 model copies (θ, v, a) for any N.

Example::

    rule = SMEGA2(theta0, num_workers=8, lr=0.1, momentum=0.9, weight_decay=1e-4)
    rule.lr = smega2_lr(epoch + b / nb, base_lr=0.1, num_workers=8)   # schedule, each batch
    reply = rule.on_push(3, grad, PushMeta(version=17))                  # reply.params is θ̂

Design: docs/design/rules.md#smega2 (properties, sharding). Differences from the paper:
:class:`SMEGA2`.
"""
from __future__ import annotations

from torch import Tensor

from ..errors import CheckpointError
from .base import (PushMeta, Reply, Rule, check_choice, check_real, load_tensor, need,
                   smega2_lr, step_decay_lr, sub_scaled_, warmup_lr, with_decay)

__all__ = ["SMEGA2", "smega2_update", "smega2_estimate", "smega2_lr", "step_decay_lr",
           "warmup_lr"]


def smega2_update(theta: Tensor, grad: Tensor, v: Tensor, a: Tensor, c: int, *,
                  lr: float | Tensor, momentum: float, n: int,
                  weight_decay: float | Tensor = 0.0) -> int:
    """One SMEGA2 push in place on θ, v, a; returns the new counter c (``grad`` not modified;
    ``lr``/``weight_decay`` floats or per-element tensors)."""
    g = with_decay(grad, theta, weight_decay)
    c = (c + 1) % n
    a.add_(g)
    sub_scaled_(theta, g.add(v, alpha=momentum), lr)
    if c == 0:
        v.mul_(momentum).add_(a, alpha=1.0 / n)
        a.zero_()
    return c


def smega2_factors(lr: float, *, momentum: float, n: int, c: int,
                   mode: str = "advanced") -> tuple[float, float]:
    """The factors of v and a in θ̂ = θ − f_v·v − f_a·a (``naive``: f_a = 0)."""
    if mode == "naive":
        return lr * momentum * n, 0.0
    return lr * momentum * (n + c * (momentum - 1.0)), lr * momentum * c / n


def smega2_estimate(theta: Tensor, v: Tensor, a: Tensor, c: int, *, lr: float, momentum: float,
                    n: int, mode: str = "advanced", coef=None) -> Tensor:
    """θ̂, the position N zero-gradient pushes ahead (``advanced``) or ``θ − ηγN·v`` (``naive``);
    a new tensor. ``coef``: a rule's :meth:`~.base.Rule.coef` (param groups: the factors per
    group, spread over θ)."""
    if coef is None:
        v_factor, a_factor = smega2_factors(lr, momentum=momentum, n=n, c=c, mode=mode)
    else:
        v_factor = coef(lambda x: smega2_factors(x, momentum=momentum, n=n, c=c, mode=mode)[0])
        a_factor = coef(lambda x: smega2_factors(x, momentum=momentum, n=n, c=c, mode=mode)[1])
    if not isinstance(v_factor, Tensor):
        if mode == "naive":
            return theta.sub(v, alpha=v_factor)
        return theta.sub(v, alpha=v_factor).sub_(a, alpha=a_factor)
    out = sub_scaled_(theta.clone(), v, v_factor)
    return out if mode == "naive" else sub_scaled_(out, a, a_factor)


class SMEGA2(Rule):
    """SMEGA2 on the PS.

    Args:
        theta0, num_workers, lr, weight_decay: see :class:`~hpcasync.rules.base.Rule`.
        momentum: γ (default 0.9).
        estimate: ``"advanced"`` (default) or ``"naive"`` reply θ̂.

    Differences from the paper / reference code:
    * Retiring a worker shrinks N (never below 1). If the current cycle already holds c ≥ N_new
      pushes, it is closed at once with the mean of what it holds, v ← γ·v + a/c; otherwise it
      continues and closes after N_new pushes. A rejoining worker grows N again.
    * No dampening option (the reference code's default, 0).
    """

    name = "smega2"

    def __init__(self, theta0: Tensor, num_workers: int, *, lr: float, weight_decay: float = 0.0,
                 momentum: float = 0.9, estimate: str = "advanced"):
        super().__init__(theta0, num_workers, lr=lr, weight_decay=weight_decay)
        self.momentum = check_real("momentum", momentum, low=0.0, high=1.0, high_open=True)
        self.estimate = check_choice("estimate", estimate, ("advanced", "naive"))
        self._v = self._theta.new_zeros(self._theta.shape)
        self._a = self._theta.new_zeros(self._theta.shape)
        self._c = 0
        self._n = self.num_workers

    @property
    def cycle(self) -> tuple[int, int]:
        """(c, N): pushes in the current cycle and the cycle length."""
        return self._c, self._n

    def theta_hat(self) -> Tensor:
        """The current estimate θ̂ (a new tensor)."""
        return smega2_estimate(self._theta, self._v, self._a, self._c, lr=self.lr,
                               momentum=self.momentum, n=self._n, mode=self.estimate,
                               coef=self.coef)

    def _update(self, worker: int, grad: Tensor, meta: PushMeta) -> None:
        self._c = smega2_update(self._theta, grad, self._v, self._a, self._c, lr=self.coef(),
                                momentum=self.momentum, n=self._n, weight_decay=self.wd)

    def _make_reply(self, worker: int, *, pushed: bool) -> Reply:
        return Reply(self.theta_hat(), self._version)

    def _resize(self) -> None:
        n = max(1, self.num_active)
        if n < self._n and self._c >= n:           # the shrunk cycle is already complete
            self._v.mul_(self.momentum).add_(self._a, alpha=1.0 / self._c)
            self._a.zero_()
            self._c = 0
        self._n = n

    def _join(self, worker: int) -> None:
        self._resize()

    def _leave(self, worker: int) -> None:
        self._resize()

    def _state(self) -> dict:
        d = super()._state()
        d.update(v=self._v, a=self._a, c=self._c, n=self._n)
        return d

    def _summary(self) -> dict:
        return {"smega2_n": int(self._n)}       # the cycle length N (the workers alive)

    def _load(self, d: dict) -> None:
        self._v = load_tensor(d, "v", self._theta)
        self._a = load_tensor(d, "a", self._theta)
        self._c, self._n = int(need(d, "c")), int(need(d, "n"))
        if not 0 <= self._c < self._n <= self.num_workers:
            raise CheckpointError(f"rule state has cycle c={self._c}, N={self._n}")
