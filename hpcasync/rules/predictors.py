"""Loss predictors for LC-ASGD (see lcasgd.py): from a worker's history of (global step, loss) points
they forecast a loss curve f_i(t) for that worker.

Interface: ``observe(worker, step, loss)``, ``predict(worker, step) -> float`` (needs at least one
observed point), ``retire(worker)``, ``state_dict()`` / ``load_state_dict(d)``, ``state_bytes()``.

Example::

    p = make_predictor("linear", window=32)
    p.observe(0, 10, 2.0); p.observe(0, 14, 1.8)
    p.predict(0, 18)          # -> 1.6

Differences from the paper: LC-ASGD's predictor models are not described beyond "models that
predict each worker's loss from its loss history" (Li et al., ICPP 2020); these three are our design.
The LSTM is shared by all workers (it sees N times the data of per-worker models).

Design: docs/design/rules.md#loss-predictors (linear, ema, lstm).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from .base import check_choice, check_int, check_real, need, tree_bytes

PREDICTORS = ("linear", "ema", "lstm")


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares line through ``(t, L)`` points as ``(t_mean, L_mean, slope)``; slope 0 for
    fewer than two distinct steps. f(t) = L_mean + slope·(t − t_mean)."""
    n = len(points)
    t_mean = math.fsum(t for t, _ in points) / n
    l_mean = math.fsum(l for _, l in points) / n
    sxx = math.fsum((t - t_mean) ** 2 for t, _ in points)
    sxy = math.fsum((t - t_mean) * (l - l_mean) for t, l in points)
    return t_mean, l_mean, (sxy / sxx if sxx > 0 else 0.0)


class _Windowed:
    """Per-worker history of the last ``window`` (step, loss) points."""

    def __init__(self, window: int):
        self.window = check_int("window", window, low=1)
        self._hist: dict[int, list[tuple[float, float]]] = {}

    def _append(self, worker: int, step: int, loss: float) -> None:
        h = self._hist.setdefault(worker, [])
        h.append((float(step), float(loss)))
        del h[:-self.window]

    def retire(self, worker: int) -> None:
        self._hist.pop(worker, None)

    def _hist_state(self) -> dict:
        return {w: torch.tensor(h, dtype=torch.float64).reshape(-1, 2)
                for w, h in self._hist.items()}

    def _hist_load(self, d: dict) -> None:
        hist = need(d, "history")
        if not isinstance(hist, dict):
            raise CheckpointError("predictor state 'history' is not a per-worker mapping")
        self._hist = {int(w): [(float(t), float(l)) for t, l in h.tolist()]
                      for w, h in hist.items()}

    def state_bytes(self) -> int:
        return tree_bytes(self.state_dict())


class LinearPredictor(_Windowed):
    name = "linear"

    def observe(self, worker: int, step: int, loss: float) -> None:
        self._append(worker, step, loss)

    def predict(self, worker: int, step: int) -> float:
        t_mean, l_mean, slope = linear_fit(self._hist[worker])
        return l_mean + slope * (step - t_mean)

    def state_dict(self) -> dict:
        return {"history": self._hist_state()}

    def load_state_dict(self, d: dict) -> None:
        self._hist_load(d)


class EmaPredictor:
    """Holt's linear smoothing with irregular step gaps."""

    name = "ema"

    def __init__(self, beta: float = 0.9):
        self.beta = check_real("ema_beta", beta, low=0.0, high=1.0, high_open=True)
        self._s: dict[int, list[float]] = {}   # worker -> [level, slope, t_last]

    def observe(self, worker: int, step: int, loss: float) -> None:
        b, t, loss = self.beta, float(step), float(loss)
        s = self._s.get(worker)
        if s is None:
            self._s[worker] = [loss, 0.0, t]
            return
        level, slope, t_last = s
        dt = t - t_last
        if dt <= 0:                                # same step again: refresh the level only
            s[0] = b * level + (1 - b) * loss
            return
        new_level = b * (level + slope * dt) + (1 - b) * loss
        s[1] = b * slope + (1 - b) * (new_level - level) / dt
        s[0], s[2] = new_level, t

    def predict(self, worker: int, step: int) -> float:
        level, slope, t_last = self._s[worker]
        return level + slope * (step - t_last)

    def retire(self, worker: int) -> None:
        self._s.pop(worker, None)

    def state_dict(self) -> dict:
        return {"smooth": {w: torch.tensor(s, dtype=torch.float64) for w, s in self._s.items()}}

    def load_state_dict(self, d: dict) -> None:
        self._s = {int(w): [float(x) for x in s.tolist()] for w, s in need(d, "smooth").items()}

    def state_bytes(self) -> int:
        return tree_bytes(self.state_dict())


class _RateNet(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.lstm = nn.LSTM(input_size=2, hidden_size=hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:       # (1, K, 2) -> (1,)
        out, _ = self.lstm(seq)
        return self.head(out[:, -1]).squeeze(-1)


class LstmPredictor(_Windowed):
    name = "lstm"

    def __init__(self, window: int = 32, *, hidden: int = 16, lr: float = 1e-2,
                 time_scale: float = 1.0, seed: int = 0):
        super().__init__(window)
        self.hidden = check_int("lstm_hidden", hidden, low=1)
        self.lr = check_real("lstm_lr", lr, low=0.0, low_open=True)
        self.time_scale = check_real("time_scale", time_scale, low=0.0, low_open=True)
        self.seed = check_int("seed", seed, low=0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.net = _RateNet(self.hidden)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=self.lr)
        self._rate: dict[int, float] = {}        # cached r for each worker's current sequence
        self.last_train_loss = math.nan

    def _features(self, hist: list[tuple[float, float]]) -> torch.Tensor:
        t_last, l_last = hist[-1]
        x = [[l - l_last, (t - t_last) / self.time_scale] for t, l in hist]
        return torch.tensor(x, dtype=torch.float32).unsqueeze(0)

    def observe(self, worker: int, step: int, loss: float) -> None:
        hist = self._hist.get(worker)
        if hist:
            t_prev, l_prev = hist[-1]
            horizon = (float(step) - t_prev) / self.time_scale
            target = float(loss) - l_prev
            with torch.enable_grad():
                self.opt.zero_grad(set_to_none=False)
                err = self.net(self._features(hist)) * horizon - target
                sq = (err * err).sum()
                sq.backward()
                nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
                self.opt.step()
            self.last_train_loss = float(sq.detach())
            self._rate.clear()                   # the net changed: every cached rate is stale
        self._append(worker, step, loss)
        self._rate.pop(worker, None)

    def predict(self, worker: int, step: int) -> float:
        hist = self._hist[worker]
        t_last, l_last = hist[-1]
        if step == t_last:
            return l_last
        rate = self._rate.get(worker)
        if rate is None:
            with torch.no_grad():
                rate = self._rate[worker] = float(self.net(self._features(hist)))
        return l_last + rate * (step - t_last) / self.time_scale

    def retire(self, worker: int) -> None:
        super().retire(worker)
        self._rate.pop(worker, None)

    def state_dict(self) -> dict:
        return {"history": self._hist_state(), "net": self.net.state_dict(),
                "opt": self.opt.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self._hist_load(d)
        try:
            self.net.load_state_dict(need(d, "net"))
            self.opt.load_state_dict(need(d, "opt"))
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"LSTM predictor state does not fit: {exc}") from None
        self._rate.clear()


def make_predictor(name: str, *, window: int = 32, ema_beta: float = 0.9, lstm_hidden: int = 16,
                   lstm_lr: float = 1e-2, time_scale: float = 1.0, seed: int = 0):
    """A fresh predictor by name (``linear``, ``ema``, ``lstm``)."""
    check_choice("predictor", name, PREDICTORS)
    if name == "linear":
        return LinearPredictor(window)
    if name == "ema":
        return EmaPredictor(ema_beta)
    if name == "lstm":
        return LstmPredictor(window, hidden=lstm_hidden, lr=lstm_lr, time_scale=time_scale,
                             seed=seed)
    raise ConfigError(f"unknown predictor {name!r}")  # pragma: no cover - check_choice covers it
