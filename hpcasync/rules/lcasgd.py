"""LC-ASGD: asynchronous SGD with loss-prediction compensation (after Li, He, Ren, Mao, "LC-ASGD",
ICPP 2020). Only the paper's abstract was available: the PS holds models that predict each worker's
loss from that worker's loss history and uses the prediction to compensate the delayed gradient.
Everything below is OUR DESIGN on that idea (hpcasync spec, algorithms.md).

A worker pushes (g, L, v): its gradient, its mini-batch loss at the parameters it used, their version.
The PS keeps per-worker (step, loss) histories; a predictor (predictors.py: ``linear`` over the last
K = 32 points (default), ``ema``, ``lstm``) forecasts L̂, the loss the worker would see now, at
t_now = the PS version. First-order Taylor, gᵀ(θ_now − θ_old) ≈ L(θ_now) − L(θ_old), motivates::

    g̃ ← g · clamp(1 + λ·(L̂ − L), 0, F)    (λ default 1.0, F = ``max_factor`` default 1)
    then the ASGD step: θ ← θ − η·(g̃ + wd·θ)  (optional shared momentum) ; reply θ

Example::

    rule = LCASGD(theta0, num_workers=4, lr=0.1, predictor="linear")
    reply = rule.on_push(2, grad, PushMeta(version=5, loss=1.37))
    rule.last_factor                  # the multiplier applied to that gradient

Design: docs/design/rules.md#lc-asgd (the bound F, the forecast's anchor, the LSTM's clock,
memory, sharding). Differences from the paper: :class:`LCASGD`.
"""
from __future__ import annotations

import math

from torch import Tensor

from .asgd import asgd_update
from .base import PushMeta, Rule, check_choice, check_int, check_real, need
from .predictors import PREDICTORS, make_predictor


def lc_factor(loss_pred: float, loss: float, *, lam: float = 1.0,
              max_factor: float = 1.0) -> float:
    """The compensation multiplier ``clamp(1 + λ·(L̂ − L), 0, max_factor)``."""
    return min(max_factor, max(0.0, 1.0 + lam * (loss_pred - loss)))


def lcasgd_update(theta: Tensor, grad: Tensor, momentum_buf: Tensor | None = None, *,
                  factor: float, lr: float | Tensor, momentum: float = 0.0,
                  weight_decay: float | Tensor = 0.0) -> None:
    """ASGD step on ``factor · grad`` in place on ``theta`` (``grad`` is not modified)."""
    g = grad if factor == 1.0 else grad.mul(factor)
    asgd_update(theta, g, momentum_buf, lr=lr, momentum=momentum, weight_decay=weight_decay)


class LCASGD(Rule):
    """LC-ASGD with a pluggable loss predictor.

    Args:
        theta0, num_workers, lr, weight_decay: see :class:`~hpcasync.rules.base.Rule`.
        predictor: ``"linear"`` (default), ``"ema"``, ``"lstm"`` or ``"oracle"``.
        lam: λ of the compensation (default 1.0).
        max_factor: upper bound F of the factor (default 1.0: only damping; ``math.inf`` gives
            the unbounded first version).
        anchor: ``"push"`` (default) or ``"fit"``; see docs/design/rules.md#lc-asgd.
        window: K, history points per worker (linear, lstm; default 32).
        ema_beta: smoothing weight on the old estimate (ema; default 0.9).
        lstm_hidden, lstm_lr: LSTM size (16) and Adam learning rate (1e-2).
        seed: LSTM initialisation seed (default 0).
        momentum: γ of one shared momentum buffer (default 0).

    Differences from the paper: the whole compensation scheme (the formula, predictors,
    anchoring) is our design (docs/design/rules.md#lc-asgd). Decision: a push's (v, L) point is
    observed before predicting.
    """

    name = "lcasgd"

    def __init__(self, theta0: Tensor, num_workers: int, *, lr: float, weight_decay: float = 0.0,
                 predictor: str = "linear", lam: float = 1.0, anchor: str = "push",
                 window: int = 32, ema_beta: float = 0.9, lstm_hidden: int = 16,
                 lstm_lr: float = 1e-2, seed: int = 0, momentum: float = 0.0,
                 max_factor: float = 1.0):
        super().__init__(theta0, num_workers, lr=lr, weight_decay=weight_decay)
        self.predictor_name = check_choice("predictor", predictor, PREDICTORS + ("oracle",))
        self.lam = check_real("lam", lam, low=0.0)
        if max_factor != math.inf:                  # inf: the unbounded first version
            check_real("max_factor", max_factor, low=0.0, low_open=True)
        self.max_factor = float(max_factor)
        self.anchor = check_choice("anchor", anchor, ("push", "fit"))
        self.momentum = check_real("momentum", momentum, low=0.0, high=1.0, high_open=True)
        check_int("window", window, low=1)
        self.predictor = None if predictor == "oracle" else make_predictor(
            predictor, window=window, ema_beta=ema_beta, lstm_hidden=lstm_hidden,
            lstm_lr=lstm_lr, time_scale=float(self.num_workers), seed=seed)
        self._buf = self._theta.new_zeros(self._theta.shape) if self.momentum else None
        self.last_factor = 1.0            # for metrics: the multiplier of the last push
        self.last_prediction = math.nan   # and its L̂

    def predict_loss(self, worker: int, meta: PushMeta) -> float:
        """L̂ for this push (observes (meta.version, meta.loss) first, except for the oracle)."""
        if self.predictor is None:
            return float(meta.oracle_loss)
        p, v, t_now = self.predictor, int(meta.version), self._version
        p.observe(worker, v, float(meta.loss))
        if self.anchor == "fit":
            return p.predict(worker, t_now)
        if t_now == v:
            return float(meta.loss)
        return float(meta.loss) + (p.predict(worker, t_now) - p.predict(worker, v))

    def _validate_meta(self, meta: PushMeta) -> str | None:
        if not math.isfinite(meta.loss):
            return f"lcasgd needs a finite loss with every push, got {meta.loss!r}"
        if self.predictor is None and not math.isfinite(meta.oracle_loss):
            return f"the oracle predictor needs a finite oracle_loss, got {meta.oracle_loss!r}"
        return None

    def _update(self, worker: int, grad: Tensor, meta: PushMeta) -> None:
        loss_hat = self.predict_loss(worker, meta)
        factor = lc_factor(loss_hat, float(meta.loss), lam=self.lam, max_factor=self.max_factor)
        lcasgd_update(self._theta, grad, self._momentum_buffer(), factor=factor, lr=self.coef(),
                      momentum=self.momentum, weight_decay=self.wd)
        self.last_factor, self.last_prediction = factor, loss_hat

    def _leave(self, worker: int) -> None:
        if self.predictor is not None:
            self.predictor.retire(worker)

    def _state(self) -> dict:
        d = super()._state()
        if self.predictor is not None:
            d["predictor"] = self.predictor.state_dict()
        if self._buf is not None:
            d["momentum_buf"] = self._buf
        return d

    def _load(self, d: dict) -> None:
        if self.predictor is not None:
            self.predictor.load_state_dict(need(d, "predictor"))
        self._load_buffer(d)
