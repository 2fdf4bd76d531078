"""Divergence detection: stop a run whose loss explodes instead of training on NaN weights.

A run has diverged at step t when its loss ℓ_t is not finite, or when its smoothed loss

    m_t = mean(ℓ_{t-k+1} … ℓ_t),   k = min(t, window)

is both more than ``factor`` times the lowest smoothed loss seen so far and above the run's first
loss ℓ_1:

    diverged(t)  ⇔  ℓ_t ∉ ℝ  ∨  ( m_t > factor · min_{s ≤ t} m_s  ∧  m_t > ℓ_1 )

Example::

    guard = DivergenceGuard(factor=10.0, window=20)
    for step, (x, y) in enumerate(loader, start=1):
        loss = F.cross_entropy(model(x), y)
        guard.check(loss.item(), step=step)       # raises DivergedError
        ...
    guard.check_weights(model, where="epoch 3")

Design: docs/design/divergence.md#divergence (why the second condition, where weights are
checked, no collective). Args and differences from the literature: :class:`DivergenceGuard`.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any

from ..errors import ConfigError, DivergedError

__all__ = ["DEFAULT_FACTOR", "DEFAULT_WINDOW", "check_factor", "diverged", "first_nonfinite",
           "DivergenceGuard"]

DEFAULT_FACTOR = 10.0
DEFAULT_WINDOW = 20
ADVICE = "lower --lr (or raise --divergence-factor, 0 turns the ratio test off)"


def diverged(loss: float, *, smoothed: float, best: float, first: float, factor: float) -> bool:
    """The divergence test of the module doc for one step: ``loss`` this step's loss, ``smoothed``
    the running mean including it, ``best`` the lowest running mean so far (including this one),
    ``first`` the run's first loss; ``factor`` 0 leaves only the non-finite test."""
    if not math.isfinite(loss):
        return True
    return factor > 0 and smoothed > factor * best and smoothed > first


def check_factor(factor, flag: str = "--divergence-factor") -> None:
    """ConfigError unless ``factor`` is 0 (ratio test off) or a finite number > 1."""
    if (isinstance(factor, bool) or not isinstance(factor, (int, float))
            or not (factor == 0 or 1 < factor < math.inf)):
        raise ConfigError(f"{flag} must be 0 (off) or a finite number > 1, got {factor!r}")


def first_nonfinite(obj: Any, where: str = "") -> str | None:
    """The path (e.g. ``model['fc.weight']``) of the first floating tensor in ``obj`` — a module,
    a tensor, or dicts/lists/tuples of them — holding a NaN or an infinity; None when all are
    finite. One reduction per tensor."""
    import torch          # here: the option check above is made before any rank imports torch

    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel() and not bool(torch.isfinite(obj).all()):
            return where or "tensor"
        return None
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        found = first_nonfinite(value, f"{where}[{key!r}]")
        if found is not None:
            return found
    return None


class DivergenceGuard:
    """Watches one stream of losses (see the module doc); :meth:`check` raises DivergedError.

    Args:
        factor: the ratio above which a smoothed loss counts as diverged (default 10; 0 disables
            the ratio test, non-finite losses and weights still stop the run).
        window: the number of recent losses averaged (default 20).
        advice: the end of the message, what to change (default: lower ``--lr``).

    Differences from the literature: frameworks stop on a non-finite loss (Keras'
    ``TerminateOnNaN``) or skip the step (mixed-precision loss scaling). We stop, because an
    asynchronous or synchronous data-parallel run that produced one NaN has already spread it to
    every replica, and add the ratio test so a run that explodes without overflowing ends too.
    """

    def __init__(self, *, factor: float = DEFAULT_FACTOR, window: int = DEFAULT_WINDOW,
                 advice: str = ADVICE):
        check_factor(factor)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"divergence window must be a positive integer, got {window!r}")
        self.factor, self.window, self.advice = float(factor), window, advice
        self.recent: deque[float] = deque(maxlen=window)
        self.best = math.inf              # lowest running mean
        self.first: float | None = None   # first finite loss
        self.seen = 0

    def check(self, loss: float, *, step: int) -> None:
        """Record ``loss`` of step ``step``; raise DivergedError if the run has diverged."""
        loss = float(loss)
        self.seen += 1
        if not math.isfinite(loss):
            self._fail(f"step {step}: loss {loss} is not finite")
        if self.first is None:
            self.first = loss
        self.recent.append(loss)
        smoothed = math.fsum(self.recent) / len(self.recent)   # exact: no drift over a long run
        self.best = min(self.best, smoothed)
        if diverged(loss, smoothed=smoothed, best=self.best, first=self.first, factor=self.factor):
            self._fail(f"step {step}: mean loss of the last {len(self.recent)} steps "
                       f"{smoothed:.4g} > {self.factor:g} x best {self.best:.4g}")

    def state_dict(self) -> dict:
        """The reference a resumed run goes on from (the window, the best mean, the first loss),
        so ``--resume`` does not forget how low the loss had been."""
        return {"recent": list(self.recent), "best": self.best, "first": self.first,
                "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.recent = deque((float(x) for x in state["recent"]), maxlen=self.window)
        self.best = float(state["best"])
        self.first = None if state["first"] is None else float(state["first"])
        self.seen = int(state["seen"])

    def check_weights(self, obj: Any, *, where: str) -> None:
        """Raise DivergedError if ``obj`` (a module or state) holds a non-finite floating value."""
        bad = first_nonfinite(obj)
        if bad is not None:
            self._fail(f"{where}: non-finite values in {bad}")

    def _fail(self, what: str) -> None:
        raise DivergedError(f"training diverged at {what}; {self.advice}")
