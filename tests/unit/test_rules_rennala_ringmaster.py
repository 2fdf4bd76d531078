"""Ringmaster ASGD and Rennala SGD against hand-computed sequences (docs/design/rules.md).

Small integers and lr 0.5: every θ below is exact in float32, so each step is compared bitwise.
Planted bugs each of these catches: Ringmaster keeping a gradient at delay R (``>`` for ``>=``)
or dropping one at R − 1; Rennala keeping a stale gradient, stepping after B − 1 gradients, or
stepping with the sum instead of the mean or at η instead of B·η; the version moving on a
dropped gradient."""
from __future__ import annotations

import pytest
import torch

from hpcasync.errors import ConfigError
from hpcasync.rules import PushMeta, make_rule
from hpcasync.rules.rennala import theorem_batch
from hpcasync.rules.ringmaster import theorem_threshold

THETA0 = torch.tensor([4.0, -2.0, 8.0, 0.0])


def g(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def push(rule, w, grad, version):
    reply = rule.on_push(w, grad, PushMeta(version=version))
    assert torch.equal(reply.params, rule.theta) and reply.version == rule.version
    return reply


def test_ringmaster_drops_a_gradient_at_delay_r_and_keeps_one_at_r_minus_1():
    rule = make_rule("ringmaster", THETA0, 3, lr=0.5, threshold=2)
    push(rule, 0, g(2, 2, 2, 2), 0)                     # δ 0: θ − 0.5·g
    assert torch.equal(rule.theta, g(3, -3, 7, -1)) and rule.version == 1
    push(rule, 1, g(4, 0, -2, 2), 0)                    # δ 1 = R − 1: kept
    assert torch.equal(rule.theta, g(1, -3, 8, -2)) and rule.version == 2
    assert rule.moved
    reply = push(rule, 2, g(100, 100, 100, 100), 0)     # δ 2 = R: dropped
    assert torch.equal(rule.theta, g(1, -3, 8, -2)) and rule.version == 2 and not rule.moved
    assert reply.version == 2 and rule.discarded == 1   # the worker goes on from θ now
    push(rule, 0, g(2, 0, 0, 0), 1)                     # δ 1: kept
    assert torch.equal(rule.theta, g(0, -3, 8, -2)) and rule.version == 3
    push(rule, 2, g(0, 2, 0, 0), 2)                     # the dropped worker, fresh again
    assert torch.equal(rule.theta, g(0, -4, 8, -2)) and rule.version == 4
    assert rule.discarded == 1


def test_rennala_steps_with_the_mean_of_exactly_b_fresh_gradients_and_drops_stale_ones():
    rule = make_rule("rennala", THETA0, 3, lr=0.5, batch=2)
    push(rule, 0, g(2, 2, 2, 2), 0)                     # 1 of 2: θ stays
    assert torch.equal(rule.theta, THETA0) and rule.version == 0 and rule.collected == 1
    push(rule, 1, g(6, -2, 0, 2), 0)                    # 2 of 2: θ − (B·0.5)·(g0 + g1)/2
    assert torch.equal(rule.theta, g(0, -2, 7, -2)) and rule.version == 1
    assert rule.collected == 0
    push(rule, 2, g(100, 100, 100, 100), 0)             # computed at θ0: dropped
    push(rule, 0, g(100, 100, 100, 100), 0)             # (worker 0's second one at θ0 too)
    assert torch.equal(rule.theta, g(0, -2, 7, -2)) and rule.version == 1
    assert rule.discarded == 2 and rule.collected == 0
    push(rule, 1, g(4, 0, 0, 0), 1)                     # a fast worker gives both gradients
    assert torch.equal(rule.theta, g(0, -2, 7, -2)) and rule.collected == 1
    push(rule, 1, g(0, 4, 0, 0), 1)
    assert torch.equal(rule.theta, g(-2, -4, 7, -2)) and rule.version == 2
    assert rule.discarded == 2


def test_rennala_state_mid_batch_continues_bitwise():
    a = make_rule("rennala", THETA0, 2, lr=0.5, batch=3, momentum=0.5, weight_decay=0.25)
    push(a, 0, g(1, 2, 3, 4), 0)
    push(a, 1, g(4, 3, 2, 1), 0)
    b = make_rule("rennala", torch.zeros(4), 2, lr=0.5, batch=3, momentum=0.5,
                  weight_decay=0.25)
    b.load_state_dict(a.state_dict())
    for rule in (a, b):
        push(rule, 0, g(2, 2, 2, 2), 0)                 # the third: the step
        push(rule, 1, g(1, 1, 1, 1), 0)                 # stale: dropped
    assert torch.equal(a.theta, b.theta) and a.version == b.version == 1
    assert (a.discarded, a.collected) == (b.discarded, b.collected) == (1, 0)


@pytest.mark.parametrize("name,kw", [("ringmaster", {"threshold": 10 ** 6}),
                                     ("rennala", {"batch": 1})])
def test_with_nothing_to_drop_each_is_asgd_bitwise(name, kw):
    """Ringmaster with R beyond every delay, and Rennala with B = 1 and one worker, are ASGD
    (momentum and weight decay included)."""
    n = 1 if name == "rennala" else 3
    rule = make_rule(name, THETA0, n, lr=0.1, momentum=0.9, weight_decay=0.01, **kw)
    ref = make_rule("asgd", THETA0, n, lr=0.1, momentum=0.9, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    seen = [0] * n
    for k in range(20):
        w = k % n if name == "rennala" else int(torch.randint(n, (), generator=gen))
        grad = torch.randn(4, generator=gen)
        r1, r2 = rule.on_push(w, grad, PushMeta(seen[w])), ref.on_push(w, grad, PushMeta(seen[w]))
        assert torch.equal(r1.params, r2.params) and r1.version == r2.version
        seen[w] = r1.version
    assert rule.discarded == 0


def test_defaults_options_and_the_papers_choices():
    assert make_rule("ringmaster", THETA0, 5, lr=0.1).threshold == 5      # R = N
    assert make_rule("rennala", THETA0, 5, lr=0.1).batch == 5             # B = N
    assert theorem_threshold(0.9, 0.1) == 9 == theorem_batch(0.9, 0.1)    # ⌈σ²/ε⌉
    assert theorem_threshold(0.0, 0.1) == 1 == theorem_batch(0.01, 1.0)
    with pytest.raises(ConfigError, match="threshold must be >= 1"):
        make_rule("ringmaster", THETA0, 2, lr=0.1, threshold=0)
    with pytest.raises(ConfigError, match="batch must be an integer"):
        make_rule("rennala", THETA0, 2, lr=0.1, batch=2.5)
    with pytest.raises(ConfigError, match="epsilon must be > 0"):
        theorem_batch(1.0, 0.0)
