"""OD-SGD's pure parts against hand numbers: local_step sgd / dc / dc-adaptive, the global momentum
step, the Δ helpers."""
from __future__ import annotations

import math

import pytest
import torch

from hpcasync.errors import ConfigError
from hpcasync.odsgd.steps import delta_gap, delta_last_step, global_step, local_step

f64 = torch.float64


def T(*xs, dtype=torch.float32):
    return torch.tensor(xs, dtype=dtype)


def test_local_step_sgd():
    W, g = T(1.0, 2.0), T(2.0, -1.0)
    out = local_step(W, g, mode="sgd", lr_local=0.5, wd=0.5)       # d = g + 0.5·W = (2.5, 0)
    assert torch.equal(out, T(-0.25, 2.0))
    assert torch.equal(W, T(1.0, 2.0)) and torch.equal(g, T(2.0, -1.0))
    assert torch.equal(local_step(W, g, lr_local=0.5), T(0.0, 2.5))


def test_local_step_dc():
    W, g, delta = T(1.0, 2.0), T(2.0, -1.0), T(1.0, -2.0)
    # λ·g²·Δ = 0.25·(4, 1)·(1, −2) = (1, −0.5); d = (2.5, 0) + (1, −0.5) = (3.5, −0.5)
    out = local_step(W, g, mode="dc", lr_local=0.5, wd=0.5, lam=0.25, delta=delta)
    assert torch.equal(out, T(-0.75, 2.25))
    # default λ = 0.04
    out = local_step(W, g, mode="dc", lr_local=1.0, delta=delta, out=torch.empty(2))
    assert torch.allclose(out, T(1.0 - (2.0 + 0.04 * 4), 2.0 - (-1.0 - 0.04 * 2)))


def test_local_step_dc_adaptive():
    W, g, delta = T(1.0, 2.0, dtype=f64), T(2.0, -1.0, dtype=f64), T(1.0, -2.0, dtype=f64)
    ms = torch.zeros(2, dtype=f64)
    out = local_step(W, g, mode="dc-adaptive", lr_local=0.5, lam=1.0, delta=delta, ms=ms,
                     ms_momentum=0.5, eps=1e-7)
    assert torch.equal(ms, T(2.0, 0.5, dtype=f64))                   # 0.5·g²
    lam = (1 / math.sqrt(2 + 1e-7), 1 / math.sqrt(0.5 + 1e-7))
    d = (2.0 + lam[0] * 4 * 1.0, -1.0 + lam[1] * 1 * -2.0)
    assert torch.allclose(out, T(1.0 - 0.5 * d[0], 2.0 - 0.5 * d[1], dtype=f64), rtol=1e-15)
    # second call: MS keeps averaging (λ0 = 2, m = 0.95)
    local_step(W, g, mode="dc-adaptive", lr_local=0.5, delta=delta, ms=ms, ms_momentum=0.95)
    assert torch.allclose(ms, T(0.95 * 2 + 0.05 * 4, 0.95 * 0.5 + 0.05 * 1, dtype=f64))
    # default m = 0 (the authors' CADCASGD local rule): MS is the current g⊙g alone
    local_step(W, g, mode="dc-adaptive", lr_local=0.5, delta=delta, ms=ms)
    assert torch.equal(ms, g * g)


def test_local_step_rescales_the_gradient_by_one_over_n():
    """OD-SGD's local step takes ĝ = g/N everywhere g appears (the authors' rescale_grad =
    1/(batch·N)), weight decay on W unscaled: W^l = W − η_l·(ĝ + wd·W + λ·ĝ⊙ĝ⊙Δ)."""
    W, g, delta = T(1.0, 2.0, dtype=f64), T(2.0, -1.0, dtype=f64), T(1.0, -2.0, dtype=f64)
    n = 4
    out = local_step(W, g, mode="dc", lr_local=0.5, grad_scale=1 / n, wd=0.5, lam=0.25,
                     delta=delta)
    gh = g / n
    ref = W - 0.5 * (gh + 0.5 * W + 0.25 * gh * gh * delta)
    assert torch.allclose(out, ref, rtol=1e-15)
    assert not torch.allclose(out, local_step(W, g, mode="dc", lr_local=0.5, wd=0.5, lam=0.25,
                                              delta=delta))
    ms = torch.zeros(2, dtype=f64)
    local_step(W, g, mode="dc-adaptive", lr_local=0.5, grad_scale=1 / n, delta=delta, ms=ms)
    assert torch.equal(ms, gh * gh)
    with pytest.raises(ConfigError, match="grad_scale"):
        local_step(W, g, lr_local=0.5, grad_scale=0.0)


def test_local_step_errors():
    W = torch.zeros(2)
    with pytest.raises(ConfigError, match="local optimizer must be one of"):
        local_step(W, W, mode="adam", lr_local=0.1)
    with pytest.raises(ConfigError, match="needs delta"):
        local_step(W, W, mode="dc", lr_local=0.1)
    with pytest.raises(ConfigError, match="needs its mean-square buffer"):
        local_step(W, W, mode="dc-adaptive", lr_local=0.1, delta=W)
    with pytest.raises(ConfigError, match="lr_local"):
        local_step(W, W, lr_local=-1.0)


def test_global_step_and_deltas():
    W, buf = T(1.0, 2.0, dtype=f64), torch.zeros(2, dtype=f64)
    global_step(W, T(1.0, 1.0, dtype=f64), buf, lr=0.1, momentum=0.9)
    assert torch.allclose(W, T(0.9, 1.9, dtype=f64)) and torch.equal(buf, T(1.0, 1.0, dtype=f64))
    global_step(W, T(1.0, 1.0, dtype=f64), buf, lr=0.1, momentum=0.9)
    assert torch.allclose(W, T(0.71, 1.71, dtype=f64), rtol=1e-14)
    assert torch.equal(delta_last_step(T(3.0), T(1.0)), T(2.0))
    assert torch.equal(delta_gap(T(3.0), T(3.5)), T(-0.5))
