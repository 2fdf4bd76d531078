"""DC-ASGD (constant and adaptive λ) and LC-ASGD (compensation formula, predictors) against numbers
computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from hpcasync.errors import ConfigError
from hpcasync.rules import PushMeta, make_rule
from hpcasync.rules.dcasgd import dc_compensated, dcasgd_adaptive_lambda
from hpcasync.rules.lcasgd import lc_factor
from hpcasync.rules.predictors import (EmaPredictor, LinearPredictor, LstmPredictor, linear_fit,
                                       make_predictor)

f32 = torch.float32
f64 = torch.float64


def T(*xs, dtype=f32):
    return torch.tensor(xs, dtype=dtype)


def test_dcasgd_constant_hand_numbers():
    rule = make_rule("dcasgd", T(1.0, 2.0, -1.0), 2, lr=0.5, lam=0.25)
    for w in (0, 1):
        rule.initial_reply(w)                                   # θ_bak(w) = θ0
    # worker 1 is fresh: θ − θ_bak(1) = 0, so g̃ = g
    r1 = rule.on_push(1, T(1.0, 0.0, 2.0), PushMeta(version=0))
    assert torch.equal(r1.params, T(0.5, 2.0, -2.0)) and r1.version == 1
    # worker 0 is one step stale: θ − θ_bak(0) = (-0.5, 0, -1)
    # g̃ = (2, 1, -1) + 0.25·(4, 1, 1)·(-0.5, 0, -1) = (1.5, 1, -1.25)
    r0 = rule.on_push(0, T(2.0, 1.0, -1.0), PushMeta(version=0))
    assert torch.equal(r0.params, T(-0.25, 1.5, -1.375))
    state = rule.state_dict()
    assert torch.equal(state["backup"][0], T(-0.25, 1.5, -1.375))   # θ_bak(0) ← θ after its push
    assert torch.equal(state["backup"][1], T(0.5, 2.0, -2.0))
    # worker 1 again: θ − θ_bak(1) = (-0.75, -0.5, 0.625); g = (1, 2, 0)
    # g̃ = (1 + 0.25·1·-0.75, 2 + 0.25·4·-0.5, 0) = (0.8125, 1.5, 0)
    r1 = rule.on_push(1, T(1.0, 2.0, 0.0), PushMeta(version=1))
    assert torch.equal(r1.params, T(-0.25 - 0.40625, 1.5 - 0.75, -1.375))


def test_dcasgd_weight_decay_and_momentum_hand_numbers():
    rule = make_rule("dcasgd", T(2.0), 2, lr=0.5, lam=0.5, weight_decay=0.25, momentum=0.5)
    rule.initial_reply(0)
    rule.initial_reply(1)
    rule.on_push(1, T(1.0), PushMeta(version=0))        # d = 1 + 0.5 = 1.5; v = 1.5; θ = 1.25
    assert torch.equal(rule.theta, T(1.25))
    # worker 0: diff = -0.75, g = 2: g̃ = 2 + 0.5·4·(-0.75) = 0.5; d = 0.5 + 0.25·1.25 = 0.8125
    # v = 0.75 + 0.8125 = 1.5625; θ = 1.25 − 0.78125 = 0.46875
    rule.on_push(0, T(2.0), PushMeta(version=0))
    assert torch.equal(rule.theta, T(0.46875))


def test_dcasgd_adaptive_hand_numbers():
    rule = make_rule("dcasgd-a", T(1.0, 2.0, dtype=f64), 2, lr=0.5)   # λ0 2, m 0.95, ε 1e-7
    rule.initial_reply(0)
    rule.initial_reply(1)
    rule.on_push(1, T(1.0, 0.0, dtype=f64), PushMeta(version=0))    # no delay: plain step
    assert torch.equal(rule.theta, T(0.5, 2.0, dtype=f64))
    g = (2.0, -1.0)
    ms = [0.05 * 4.0, 0.05 * 1.0]                                   # (1 − m)·g², MS(0) started at 0
    lam = [2.0 / math.sqrt(ms[0] + 1e-7), 2.0 / math.sqrt(ms[1] + 1e-7)]
    diff = (-0.5, 0.0)
    g_tilde = [g[k] + lam[k] * g[k] * g[k] * diff[k] for k in range(2)]
    rule.on_push(0, T(*g, dtype=f64), PushMeta(version=0))
    expected = [0.5 - 0.5 * g_tilde[0], 2.0 - 0.5 * g_tilde[1]]
    assert torch.allclose(rule.theta, T(*expected, dtype=f64), rtol=1e-14, atol=0)
    state = rule.state_dict()
    assert torch.allclose(state["ms"][0], T(*ms, dtype=f64), rtol=1e-15)
    assert torch.allclose(state["ms"][1], T(0.05, 0.0, dtype=f64), rtol=1e-15)   # MS(1): its own g
    # second push of worker 0: MS(0) ← 0.95·MS(0) + 0.05·g²
    rule.on_push(0, T(1.0, 1.0, dtype=f64), PushMeta(version=2))
    ms2 = [0.95 * ms[0] + 0.05, 0.95 * ms[1] + 0.05]
    assert torch.allclose(rule.state_dict()["ms"][0], T(*ms2, dtype=f64), rtol=1e-15)


def test_dc_pure_functions():
    ms = torch.zeros(2, dtype=f64)
    lam = dcasgd_adaptive_lambda(ms, T(2.0, 1.0, dtype=f64), lam0=1.0, ms_momentum=0.5, eps=1e-7)
    assert torch.equal(ms, T(2.0, 0.5, dtype=f64))
    assert torch.allclose(lam, T(1 / math.sqrt(2 + 1e-7), 1 / math.sqrt(0.5 + 1e-7), dtype=f64))
    out = dc_compensated(T(1.0, 1.0), T(2.0, -2.0), T(0.0, 2.0), 0.5)
    assert torch.equal(out, T(2.0 + 0.5 * 4 * 1, -2.0 + 0.5 * 4 * -1))


def test_dcasgd_push_without_initial_reply_is_uncompensated():
    rule = make_rule("dcasgd", T(1.0), 2, lr=1.0, lam=1.0)
    rule.on_push(0, T(1.0), PushMeta(version=0))                     # θ = 0
    rule.on_push(1, T(1.0), PushMeta(version=0))                     # no backup: g̃ = g
    assert torch.equal(rule.theta, T(-1.0))


# ---------------------------------------------------------------------------------------------
# LC-ASGD

def test_lc_factor_formula():
    assert lc_factor(1.0, 1.0, lam=1.0) == 1.0
    assert lc_factor(0.8, 1.0, lam=1.0) == pytest.approx(0.8)
    assert lc_factor(0.8, 1.0, lam=2.0) == pytest.approx(0.6)
    assert lc_factor(1.25, 1.0, lam=2.0) == 1.0                          # bounded by 1 (default)
    assert lc_factor(1.25, 1.0, lam=2.0, max_factor=math.inf) == pytest.approx(1.5)
    assert lc_factor(1.25, 1.0, lam=2.0, max_factor=1.2) == pytest.approx(1.2)
    assert lc_factor(0.0, 2.0, lam=1.0) == 0.0                           # clamped at 0


def test_lcasgd_rising_loss_never_amplifies_a_stale_gradient():
    """The default bound: a loss predicted to have RISEN since the worker read θ leaves the
    gradient as it is (plain ASGD step), never scales it up (the positive feedback of the
    unbounded first version)."""
    rule = make_rule("lcasgd", T(1.0, -1.0), 2, lr=0.5, predictor="oracle", lam=2.0)
    rule.on_push(0, T(1.0, 2.0), PushMeta(version=0, loss=1.0, oracle_loss=3.0))
    assert rule.last_factor == 1.0 and torch.equal(rule.theta, T(0.5, -2.0))
    free = make_rule("lcasgd", T(1.0, -1.0), 2, lr=0.5, predictor="oracle", lam=2.0,
                     max_factor=math.inf)
    free.on_push(0, T(1.0, 2.0), PushMeta(version=0, loss=1.0, oracle_loss=3.0))
    assert free.last_factor == 5.0                                       # 1 + 2·(3 − 1)
    with pytest.raises(ConfigError, match="max_factor"):
        make_rule("lcasgd", T(1.0), 2, lr=0.5, max_factor=0.0)


def test_lcasgd_oracle_applies_the_formula():
    rule = make_rule("lcasgd", T(1.0, -1.0), 2, lr=0.5, predictor="oracle", lam=2.0)
    rule.on_push(0, T(1.0, 2.0), PushMeta(version=0, loss=1.0, oracle_loss=0.75))
    assert rule.last_factor == 0.5                                       # 1 + 2·(0.75 − 1)
    assert torch.equal(rule.theta, T(0.75, -1.5))                        # θ − 0.5·0.5·g
    rule.on_push(1, T(1.0, 2.0), PushMeta(version=0, loss=1.0, oracle_loss=0.25))
    assert rule.last_factor == 0.0 and torch.equal(rule.theta, T(0.75, -1.5))


def test_lcasgd_linear_anchored_and_fit():
    rule = make_rule("lcasgd", T(0.0, dtype=f64), 2, lr=1.0, lam=1.0)
    fit = make_rule("lcasgd", T(0.0, dtype=f64), 2, lr=1.0, lam=1.0, anchor="fit")
    g = T(1.0, dtype=f64)
    # worker 0 history: (0, 2.0), then (4, 1.6) -> slope -0.1 per step
    for r in (rule, fit):
        r.on_push(0, g, PushMeta(version=0, loss=2.0))
        for _ in range(3):
            r.on_push(1, g, PushMeta(version=r.version, loss=5.0))
        r.on_push(0, g, PushMeta(version=4, loss=1.6))
    assert rule.last_factor == 1.0          # τ = 0 (pushed at the current version): no change
    for r in (rule, fit):
        for _ in range(4):
            r.on_push(1, g, PushMeta(version=r.version, loss=5.0))
        assert r.version == 9
    # worker 0 pushes a loss above its line: (8, 1.3); the fit through (0,2),(4,1.6),(8,1.3):
    # slope = Σ(t−4)(L−L̄)/Σ(t−4)² = (−4·0.3667 + 4·(−0.3333))/32 = −0.0875, t_now = 9
    rule.on_push(0, g, PushMeta(version=8, loss=1.3))
    assert rule.last_prediction == pytest.approx(1.3 - 0.0875)           # anchored: L + slope·τ
    assert rule.last_factor == pytest.approx(1 - 0.0875)
    fit.on_push(0, g, PushMeta(version=8, loss=1.3))
    level = (2.0 + 1.6 + 1.3) / 3 - 0.0875 * (9 - 4)
    assert fit.last_prediction == pytest.approx(level)                   # literal: f(t_now)
    assert fit.last_factor == pytest.approx(1 + level - 1.3)


def test_lcasgd_anchor_push_no_compensation_without_delay_or_trend():
    for predictor in ("linear", "ema", "lstm"):
        rule = make_rule("lcasgd", torch.zeros(3), 2, lr=0.1, predictor=predictor)
        for k in range(6):
            rule.on_push(k % 2, torch.ones(3), PushMeta(version=rule.version, loss=1.0 + k % 3))
            assert rule.last_factor == 1.0                               # τ = 0 every time
    rule = make_rule("lcasgd", torch.zeros(3), 2, lr=0.1, predictor="ema")
    for k in range(6):                                                   # flat loss, stale pushes
        rule.on_push(0, torch.ones(3), PushMeta(version=max(0, rule.version - 3), loss=0.7))
        assert rule.last_factor == 1.0


def test_linear_predictor():
    assert linear_fit([(0, 1.0), (2, 2.0), (4, 3.0)]) == (2.0, 2.0, 0.5)
    assert linear_fit([(3, 1.0)]) == (3.0, 1.0, 0.0)
    p = LinearPredictor(window=2)
    p.observe(0, 10, 2.0)
    assert p.predict(0, 50) == 2.0
    p.observe(0, 14, 1.8)
    assert p.predict(0, 18) == pytest.approx(1.6)
    p.observe(0, 16, 1.8)                                                # window 2: (14,1.8),(16,1.8)
    assert p.predict(0, 100) == pytest.approx(1.8)
    p.retire(0)
    with pytest.raises(KeyError):
        p.predict(0, 1)


def test_ema_predictor_hand_numbers():
    p = EmaPredictor(beta=0.5)
    p.observe(0, 0, 2.0)
    assert p.predict(0, 10) == 2.0
    p.observe(0, 2, 1.0)        # pred 2.0, level 0.5·2 + 0.5·1 = 1.5, slope 0.5·0 + 0.5·(−0.5/2)
    assert p.predict(0, 2) == 1.5
    assert p.predict(0, 6) == 1.5 - 0.125 * 4


def test_lstm_predictor_is_seeded_and_learns_a_trend():
    rng_before = torch.random.get_rng_state()
    preds = []
    for seed in (0, 0, 1):
        p = make_predictor("lstm", window=8, time_scale=4.0, seed=seed)
        for t in range(0, 400, 4):
            p.observe(0, t, 3.0 - 0.005 * t)
        preds.append(p.predict(0, 404))
    assert torch.equal(torch.random.get_rng_state(), rng_before)        # global RNG untouched
    assert preds[0] == preds[1] != preds[2]
    assert isinstance(p, LstmPredictor) and p.predict(0, 396) == 3.0 - 0.005 * 396
    # the true next value is 3 − 0.005·404 = 0.98, i.e. 0.02 below the last point
    assert 0.96 < preds[0] < 0.995
