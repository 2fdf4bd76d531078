"""Param groups and frozen elements in the eleven parameter-server rules (one process, the rule
objects directly).

* per-element lr / weight decay (``Rule.set_groups``) gives each group's slice bitwise what a rule
  built with that group's scalars gives on that slice alone, push for push (every rule's math is
  elementwise; the order-dependent scalars -- SMEGA2's cycle, SHAT's counters, LC-ASGD's factor --
  are shared and see the same pushes);
* elements of no group (-1: ``requires_grad=False`` or outside the optimizer) stay bitwise equal
  to their initial values in θ, in every reply and in SHAT's worker copy, over many pushes, even
  with huge gradients there;
* one group over every element equals the scalar (no-groups) code bitwise.
"""
from __future__ import annotations

import pytest
import torch

from hpcasync.rules import RULES, PushMeta, make_rule

NAMES = list(RULES)
W = 3


def _hyper(name, lr=0.1, wd=0.0):
    h = {"lr": lr, "weight_decay": wd}
    if name in ("asgd", "dcasgd", "dcasgd-a", "lcasgd", "shat"):
        h["momentum"] = 0.5           # the optional shared buffer, exercised too
    return h


def _layout():
    """A group index with interleaved segments: group 0, group 1, frozen, group 0, group 1."""
    sizes = [(0, 7), (1, 5), (-1, 6), (0, 4), (1, 3), (-1, 2)]
    return torch.cat([torch.full((n,), g, dtype=torch.int64) for g, n in sizes])


def _pushes(n, steps, seed=0, frozen=None, big=0.0):
    """(worker, gradient, loss) for ``steps`` pushes, round robin with a skip (staleness)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        grad = torch.randn(n, generator=g)
        if frozen is not None and big:
            grad[frozen] = big
        out.append(((k * 2 + k // 4) % W, grad, 2.0 - 0.01 * k + 0.1 * float(torch.rand(1, generator=g))))
    return out


def _drive(rule, pushes, *, lr_of=None, worker_rule=None, locals_=None):
    """Run the pushes (initial replies first); returns the replies' params and the worker
    copies after each push (SHAT: through ``worker_rule.on_reply``)."""
    replies, copies = [], []
    version = [0] * W
    for w in range(W):
        r = rule.initial_reply(w)
        version[w] = r.version
        if worker_rule is not None:
            worker_rule.on_reply(locals_[w], r, None)
    for k, (w, grad, loss) in enumerate(pushes):
        if lr_of is not None:
            rule.lr = lr_of(k)
        meta = PushMeta(version=version[w], loss=loss)
        assert rule.validate(w, grad, meta) is None
        r = rule.on_push(w, grad, meta)
        version[w] = r.version
        replies.append(r.params.clone())
        if worker_rule is not None:
            worker_rule.on_reply(locals_[w], r, grad)
            copies.append(locals_[w].clone())
    return replies, copies


@pytest.mark.parametrize("name", NAMES)
def test_groups_equal_separate_rules_per_slice(name):
    index = _layout()
    n = index.numel()
    theta0 = torch.randn(n, generator=torch.Generator().manual_seed(1))
    lrs, wds = (0.1, 0.03), (1e-3, 0.0)
    factor = [1.0 / (1 + 0.1 * k) for k in range(40)]            # a schedule changing every push
    pushes = _pushes(n, 40)

    rule = make_rule(name, theta0, W, **_hyper(name, lrs[0], wds[0]))
    rule.set_groups(index)
    rule.weight_decay = wds
    worker = make_rule(name, theta0, W, **_hyper(name, lrs[0], wds[0]))
    worker.set_groups(index)
    locs = [torch.empty(n) for _ in range(W)]
    got, got_local = _drive(rule, pushes, lr_of=lambda k: tuple(x * factor[k] for x in lrs),
                            worker_rule=worker, locals_=locs)

    for g in (0, 1):
        idx = (index == g).nonzero().flatten()
        ref = make_rule(name, theta0[idx].clone(), W, **_hyper(name, lrs[g], wds[g]))
        ref_worker = make_rule(name, theta0[idx].clone(), W, **_hyper(name, lrs[g], wds[g]))
        ref_locs = [torch.empty(idx.numel()) for _ in range(W)]
        sliced = [(w, grad[idx], loss) for w, grad, loss in pushes]
        want, want_local = _drive(ref, sliced, lr_of=lambda k, g=g: lrs[g] * factor[k],
                                  worker_rule=ref_worker, locals_=ref_locs)
        for k, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a[idx], b), f"{name}: group {g} reply differs at push {k}"
        for k, (a, b) in enumerate(zip(got_local, want_local)):
            assert torch.equal(a[idx], b), f"{name}: group {g} worker copy differs at push {k}"
        assert torch.equal(rule.theta[idx], ref.theta)


@pytest.mark.parametrize("name", NAMES)
def test_frozen_elements_bitwise_unchanged(name):
    index = _layout()
    n = index.numel()
    frozen = index < 0
    theta0 = torch.randn(n, generator=torch.Generator().manual_seed(2))
    rule = make_rule(name, theta0, W, **_hyper(name, 0.2, 1e-2))
    rule.set_groups(index)
    worker = make_rule(name, theta0, W, **_hyper(name, 0.2, 1e-2))
    worker.set_groups(index)
    locs = [torch.empty(n) for _ in range(W)]
    # huge gradients on the frozen elements (their sums overflow float32): never inf·0 = NaN in θ
    replies, copies = _drive(rule, _pushes(n, 60, seed=3, frozen=frozen, big=3e38),
                             worker_rule=worker, locals_=locs)
    assert torch.equal(rule.theta[frozen], theta0[frozen])
    assert not torch.equal(rule.theta[~frozen], theta0[~frozen])       # the rest trained
    for k, r in enumerate(replies):
        assert torch.equal(r[frozen], theta0[frozen]), f"{name}: reply {k} moved a frozen element"
    for k, c in enumerate(copies):
        assert torch.equal(c[frozen], theta0[frozen]), f"{name}: worker copy {k} moved one"
    assert all(bool(torch.isfinite(r).all()) for r in replies)


@pytest.mark.parametrize("name", NAMES)
def test_one_group_equals_scalar_code(name):
    n = 29
    theta0 = torch.randn(n, generator=torch.Generator().manual_seed(4))
    pushes = _pushes(n, 30, seed=5)
    plain = make_rule(name, theta0, W, **_hyper(name, 0.1, 1e-3))
    grouped = make_rule(name, theta0, W, **_hyper(name, 0.1, 1e-3))
    grouped.set_groups(torch.zeros(n, dtype=torch.int64))
    a, _ = _drive(plain, pushes, lr_of=lambda k: 0.1 / (1 + k))
    b, _ = _drive(grouped, pushes, lr_of=lambda k: (0.1 / (1 + k),))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_momentum_turned_on_later_equals_built_with_it():
    """A schedule (OneCycleLR) may set momentum > 0 on a rule built without: the shared buffer
    starts then, as torch.optim.SGD's does at its first step with momentum."""
    theta0 = torch.randn(11)
    pushes = _pushes(11, 10, seed=6)
    late = make_rule("asgd", theta0, W, lr=0.1)
    late.momentum = 0.9
    built = make_rule("asgd", theta0, W, lr=0.1, momentum=0.9)
    assert all(torch.equal(x, y) for x, y in zip(_drive(late, pushes)[0], _drive(built, pushes)[0]))
    fresh = make_rule("asgd", theta0, W, lr=0.1, momentum=0.9)
    fresh.load_state_dict(late.state_dict())
    assert torch.equal(fresh.state_dict()["momentum_buf"], late.state_dict()["momentum_buf"])


def test_group_values_checked():
    rule = make_rule("asgd", torch.zeros(4), 2, lr=0.1)
    with pytest.raises(ValueError, match="without param groups"):
        rule.lr = (0.1, 0.2)
    rule.set_groups(torch.tensor([0, 1, -1, 1]))
    assert rule.lr == (0.1, 0.1) and rule.groups == 2
    with pytest.raises(ValueError, match="3 values for 2 param groups"):
        rule.lr = (0.1, 0.2, 0.3)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        rule.lr = (0.1, -1.0)
