"""Loss-plateau detection for DASO's adaptive schedule (pure, no MPI).

An epoch *improves* when its loss L beats the best loss seen so far by a relative margin:

    L < best · (1 − threshold)          (threshold 0.05: at least 5 % better)

and the detector reports a plateau after ``patience`` (3) consecutive epochs that do not improve.
After a plateau the count starts again, so the next plateau needs another ``patience`` epochs, and
``best`` is kept (a reset schedule must still beat the best loss to count as progress).

Example::

    det = PlateauDetector(patience=3, threshold=0.05)
    [det.update(x) for x in (1.0, 0.99, 0.98, 0.97)]    # -> [False, False, False, True]

Differences from the paper / Heat: Heat's ``DetectMetricPlateau`` (a copy of PyTorch's
``ReduceLROnPlateau`` logic) with ``patience=2`` triggers on the *third* epoch without improvement;
here ``patience`` is that count itself (3), as algorithms.md words it.
"""
from __future__ import annotations

import math

from ..errors import ConfigError


class PlateauDetector:
    """Counts consecutive non-improving epochs; ``update(loss)`` returns True on a plateau.

    Args:
        patience: non-improving epochs in a row that make a plateau (default 3, >= 1).
        threshold: relative improvement that counts as progress (default 0.05, in [0, 1)).
    """

    __slots__ = ("patience", "threshold", "best", "bad_epochs")

    def __init__(self, *, patience: int = 3, threshold: float = 0.05):
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ConfigError(f"plateau patience must be an integer >= 1, got {patience!r}")
        if not isinstance(threshold, (int, float)) or not 0.0 <= threshold < 1.0:
            raise ConfigError(f"plateau threshold must be in [0, 1), got {threshold!r}")
        self.patience, self.threshold = patience, float(threshold)
        self.best = math.inf
        self.bad_epochs = 0

    def update(self, loss: float) -> bool:
        """Feed one epoch's (rank-averaged) loss; True when it completes a plateau."""
        loss = float(loss)
        if not math.isfinite(loss):
            raise ValueError(f"epoch loss is not finite ({loss}): training diverged")
        if loss < self.best * (1.0 - self.threshold):
            self.best, self.bad_epochs = loss, 0
            return False
        self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            self.bad_epochs = 0
            return True
        return False

    def state_dict(self) -> dict:
        return {"best": self.best, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad_epochs = float(state["best"]), int(state["bad_epochs"])
