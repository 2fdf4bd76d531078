"""SHAT: α for given (n, c_i) and its guards, counters over an interleaving, the worker step,
α = 1 is ASGD bitwise, α = 0 never reads θ."""
from __future__ import annotations

import math

import pytest
import torch

from hpcasync.rules import PushMeta, make_rule, shat_alpha
from hpcasync.rules.shat import shat_worker_step


def test_alpha_values():
    assert shat_alpha(4, 3, "log") == pytest.approx(1 - (4 / 3) / math.log(4))      # 0.0382
    assert shat_alpha(4, 100, "log") == pytest.approx(1 - 0.04 / math.log(4))
    assert shat_alpha(16, 64, "log") == pytest.approx(1 - 0.25 / math.log(16))
    assert shat_alpha(16, 8, "root") == 0.5                                          # 1 − 2/4
    assert shat_alpha(4, 3, "root") == pytest.approx(1 / 3)
    assert shat_alpha(4, 2, "log") == 0.0                   # 1 − 2/ln 4 < 0: clamped
    assert shat_alpha(2, 1, "root") == 0.0                  # 1 − 2/√2 < 0: clamped
    assert 0.0 < shat_alpha(8, 1000, "log") < 1.0


def test_alpha_guards():
    for mode in ("log", "root"):
        assert shat_alpha(4, 0, mode) == 1.0                # c_i = 0 → α = 1
        assert shat_alpha(1, 0, mode) == 1.0
        assert shat_alpha(1, 5, mode) == 1.0                # n = 1 → α = 1 (log 1 = 0)
    for n, c in [(1, 0), (4, 0), (4, 3), (16, 1000)]:
        assert shat_alpha(n, c, "ensemble") == 0.0
        assert shat_alpha(n, c, "asp") == 1.0
    with pytest.raises(ValueError):
        shat_alpha(4, 3, "cube")


def test_counters_after_an_interleaving():
    rule = make_rule("shat", torch.zeros(2), 3, lr=0.1)
    sent = []
    for w in [0, 1, 1, 2, 0]:
        reply = rule.on_push(w, torch.ones(2), PushMeta(version=rule.version))
        sent.append(reply.scalars)
    assert [s[0] for s in sent] == [0.0, 1.0, 0.0, 3.0, 3.0]
    assert all(s[1:] == (3.0, 0.1) for s in sent)           # (n, η) ride along
    assert rule.counts == [0, 2, 1]
    rule.retire(1)                                          # retired: not counted, n shrinks
    reply = rule.on_push(2, torch.ones(2), PushMeta(version=rule.version))
    assert reply.scalars == (1.0, 2.0, 0.1) and rule.counts == [1, 0, 0]
    assert rule.initial_reply(1).scalars == (0.0, 3.0, 0.1)


def test_worker_step_hand_numbers():
    local = torch.tensor([1.0, 1.0])
    shat_worker_step(local, torch.tensor([1.0, -1.0]), torch.tensor([0.0, 2.0]), lr=0.5, alpha=0.5)
    assert torch.equal(local, torch.tensor([0.25, 1.75]))   # w − ηg = (0.5, 1.5), then halfway to θ
    rule = make_rule("shat-root", torch.tensor([0.0, 2.0]), 16, lr=0.5)
    reply = rule.initial_reply(0)
    reply.scalars = (8.0, 16.0, 0.5)                        # α = 1 − (16/8)/√16 = 0.5
    local = torch.tensor([1.0, 1.0])
    rule.on_reply(local, reply, torch.tensor([1.0, -1.0]))
    assert torch.equal(local, torch.tensor([0.25, 1.75]))


def _run(name, order, seed=0, **kw):
    rule = make_rule(name, torch.linspace(-1, 1, 7), 3, lr=0.05, weight_decay=1e-2, **kw)
    locs = {}
    for w in range(3):
        locs[w] = torch.empty(7)
        rule.on_reply(locs[w], rule.initial_reply(w), None)
    vers = {w: 0 for w in range(3)}
    gen = torch.Generator().manual_seed(seed)
    history = []
    for w in order:
        g = torch.randn(7, generator=gen) + locs[w]
        reply = rule.on_push(w, g, PushMeta(version=vers[w]))
        vers[w] = reply.version
        rule.on_reply(locs[w], reply, g)
        history.append((rule.theta.clone(), {k: v.clone() for k, v in locs.items()}))
    return history


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_alpha_one_is_asgd_bitwise(momentum):
    order = [0, 1, 2, 2, 1, 0, 0, 0, 2, 1, 2, 0, 1, 1]
    asgd = _run("asgd", order, momentum=momentum)
    asp = _run("asp", order, momentum=momentum)
    for (ta, la), (tb, lb) in zip(asgd, asp):
        assert torch.equal(ta, tb)
        assert all(torch.equal(la[w], lb[w]) for w in la)
    shat = _run("shat", order, momentum=momentum)            # α < 1 for some replies: differs
    assert any(not torch.equal(a[1][w], b[1][w]) for a, b in zip(asgd, shat) for w in range(3))


def test_alpha_zero_never_reads_theta():
    rule = make_rule("ensemble", torch.zeros(3), 4, lr=0.5)
    local = torch.empty(3)
    rule.on_reply(local, rule.initial_reply(0), None)       # the start copies θ
    assert torch.equal(local, torch.zeros(3))
    g = torch.tensor([1.0, 2.0, -2.0])
    reply = rule.on_push(0, g, PushMeta(version=0))
    reply.params = torch.full((3,), math.nan)               # θ poisoned: must not matter
    rule.on_reply(local, reply, g)
    assert torch.equal(local, torch.tensor([-0.5, -1.0, 1.0]))
