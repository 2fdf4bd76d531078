"""SMEGA2 (cycle = synchronous momentum step, advanced estimate = N zero pushes ahead, constant
memory), DANA-Zero (hand numbers, running sum, memory grows with N), NAG-ASGD and ASGD momentum
against torch.optim.SGD."""
from __future__ import annotations

import pytest
import torch

from hpcasync.rules import PushMeta, make_rule, smega2_estimate
from hpcasync.rules.smega2 import smega2_update

f64 = torch.float64
D = 11


def push(rule, w, g):
    return rule.on_push(w, g, PushMeta(version=rule.version))


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_smega2_cycle_is_one_synchronous_momentum_step(n):
    """A cycle of N pushes from c = 0 (wd = 0) equals, to rounding, PyTorch's momentum SGD
    (dampening 0): v ← γv + ḡ ; θ ← θ − (Nη)·v, ḡ the mean of the cycle's gradients."""
    lr, gamma = 0.05, 0.9
    gen = torch.Generator().manual_seed(n)
    theta0 = torch.randn(D, dtype=f64, generator=gen)
    rule = make_rule("smega2", theta0, n, lr=lr, momentum=gamma)
    ref = theta0.clone().requires_grad_(True)
    sgd = torch.optim.SGD([ref], lr=n * lr, momentum=gamma)
    v = torch.zeros(D, dtype=f64)
    theta = theta0.clone()
    for cycle in range(4):
        grads = [torch.randn(D, dtype=f64, generator=gen) for _ in range(n)]
        for k, g in enumerate(grads):
            push(rule, (k * 3 + cycle) % n, g)           # any worker order
        g_mean = torch.stack(grads).mean(0)
        v = gamma * v + g_mean
        theta = theta - n * lr * v
        ref.grad = g_mean.clone()
        sgd.step()
        assert rule.cycle == (0, n)
        assert torch.allclose(rule.theta, theta, rtol=1e-12, atol=1e-12)
        assert torch.allclose(rule.theta, ref.detach(), rtol=1e-12, atol=1e-12)
        assert torch.allclose(rule.state_dict()["v"], v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_smega2_advanced_estimate_is_n_zero_pushes_ahead(n):
    gen = torch.Generator().manual_seed(10 + n)
    for c in range(n):
        rule = make_rule("smega2", torch.randn(D, dtype=f64, generator=gen), n, lr=0.1,
                         momentum=0.9)
        for _ in range(2 * n + c):                         # v ≠ 0 and, for c > 0, a ≠ 0
            push(rule, 0, torch.randn(D, dtype=f64, generator=gen))
        assert rule.cycle == (c, n)
        hat = rule.theta_hat()
        naive = make_rule("smega2", torch.zeros(D, dtype=f64), n, lr=0.1, momentum=0.9,
                          estimate="naive")
        naive.load_state_dict(rule.state_dict())
        for _ in range(n):
            push(rule, 0, torch.zeros(D, dtype=f64))
        assert torch.allclose(rule.theta, hat, rtol=1e-12, atol=1e-12), c
        if c == 0:                                         # a = 0: both estimates agree
            assert torch.allclose(naive.theta_hat(), hat, rtol=1e-12, atol=1e-12)
        elif n > 1:
            assert not torch.allclose(naive.theta_hat(), hat)


def test_smega2_replies_theta_hat_and_hand_numbers():
    # N = 2, γ = 0.5, η = 1, θ0 = 1
    rule = make_rule("smega2", torch.tensor([1.0], dtype=f64), 2, lr=1.0, momentum=0.5)
    assert torch.equal(rule.initial_reply(0).params, rule.theta)      # v = a = 0: θ̂ = θ
    r = push(rule, 0, torch.tensor([1.0], dtype=f64))    # c=1, a=1, θ=0; θ̂ = 0 − 0.5·(0 + 0.5·1)
    assert rule.theta.item() == 0.0 and r.params.item() == -0.25
    r = push(rule, 1, torch.tensor([3.0], dtype=f64))    # c=0, θ=−3, v=2, a=0; θ̂ = −3 − 0.5·2·2
    assert rule.theta.item() == -3.0 and r.params.item() == -5.0
    r = push(rule, 1, torch.tensor([0.0], dtype=f64))    # c=1, θ = −3 − 0.5·2 = −4;
    assert rule.theta.item() == -4.0                     # θ̂ = −4 − 0.5·(2 + 1·(−0.5))·2 = −5.5
    assert r.params.item() == -5.5
    assert smega2_estimate(rule.theta, rule.state_dict()["v"], rule.state_dict()["a"], 1, lr=1.0,
                           momentum=0.5, n=2, mode="naive").item() == -6.0


def test_smega2_weight_decay_enters_the_gradient():
    theta, v, a = (torch.tensor([2.0]), torch.zeros(1), torch.zeros(1))
    c = smega2_update(theta, torch.tensor([1.0]), v, a, 0, lr=0.5, momentum=0.9, n=1,
                      weight_decay=0.25)
    assert c == 0 and theta.item() == 1.25 and v.item() == 1.5 and a.item() == 0.0


def test_smega2_retire_shrinks_the_cycle():
    rule = make_rule("smega2", torch.zeros(2, dtype=f64), 4, lr=0.1, momentum=0.5)
    gs = [torch.tensor([1.0, 2.0], dtype=f64), torch.tensor([3.0, 0.0], dtype=f64),
          torch.tensor([2.0, 1.0], dtype=f64)]
    for w, g in enumerate(gs):
        push(rule, w, g)
    rule.retire(3)                                       # c = 3 >= N' = 3: close the cycle now
    assert rule.cycle == (0, 3)
    assert torch.allclose(rule.state_dict()["v"], torch.stack(gs).mean(0))
    push(rule, 0, gs[0])
    rule.retire(2)                                       # c = 1 < 2: the cycle goes on
    assert rule.cycle == (1, 2)
    rule.initial_reply(2)
    assert rule.cycle == (1, 3)


def test_ps_state_memory_smega2_constant_dana_grows():
    sizes = {}
    for name in ("smega2", "dana"):
        for n in (2, 8, 32):
            rule = make_rule(name, torch.zeros(D), n, lr=0.1)
            for w in range(n):
                rule.initial_reply(w)
                push(rule, w, torch.ones(D))
            sizes[name, n] = rule.state_bytes()
    model = D * 4
    assert sizes["smega2", 2] == sizes["smega2", 8] == sizes["smega2", 32]
    assert 3 * model <= sizes["smega2", 2] < 4 * model               # θ, v, a (+ a few scalars)
    assert sizes["dana", 8] - sizes["dana", 2] == 6 * model           # one buffer per worker
    assert sizes["dana", 32] - sizes["dana", 8] == 24 * model
    assert sizes["dana", 2] - sizes["smega2", 2] == model             # θ, S, v_1, v_2 vs θ, v, a


def test_dana_zero_hand_numbers_and_running_sum():
    rule = make_rule("dana", torch.tensor([1.0], dtype=f64), 2, lr=1.0, momentum=0.5)
    r = push(rule, 0, torch.tensor([1.0], dtype=f64))     # v0 = 1, θ = 0, Σv = 1
    assert rule.theta.item() == 0.0 and r.params.item() == -0.5
    r = push(rule, 1, torch.tensor([2.0], dtype=f64))     # v1 = 2, θ = −2, Σv = 3
    assert rule.theta.item() == -2.0 and r.params.item() == -3.5
    r = push(rule, 0, torch.tensor([1.0], dtype=f64))     # v0 = 1.5, θ = −3.5, Σv = 3.5
    assert rule.theta.item() == -3.5 and r.params.item() == -5.25
    rule.retire(1)                                        # v1 leaves the look-ahead
    assert rule.initial_reply(0).params.item() == -3.5 - 0.75
    # running sum == direct sum after many random pushes
    gen = torch.Generator().manual_seed(5)
    rule = make_rule("dana", torch.zeros(D, dtype=f64), 4, lr=0.1, weight_decay=1e-3)
    for k in range(40):
        push(rule, int(torch.randint(4, (1,), generator=gen)), torch.randn(D, dtype=f64,
                                                                             generator=gen))
    state = rule.state_dict()
    assert torch.allclose(state["v_sum"], sum(state["v"].values()), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,nesterov", [("nag", True), ("asgd", False)])
def test_shared_momentum_matches_torch_sgd(name, nesterov):
    gen = torch.Generator().manual_seed(3)
    theta0 = torch.randn(D, generator=gen)
    rule = make_rule(name, theta0, 3, lr=0.05, momentum=0.9, weight_decay=1e-3,
                     **({} if name == "nag" else {"nesterov": False}))
    ref = theta0.clone().requires_grad_(True)
    sgd = torch.optim.SGD([ref], lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=nesterov)
    for k in range(10):
        g = torch.randn(D, generator=gen)
        push(rule, k % 3, g)
        ref.grad = g.clone()
        sgd.step()
        assert torch.allclose(rule.theta, ref.detach(), rtol=1e-6, atol=1e-7)
