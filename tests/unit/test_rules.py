"""Properties every update rule must have: registry and hyperparameter checks, validation, staleness,
bitwise state_dict continuation (through torch.save / weights_only load), determinism, retire.
No MPI: under mpiexec every rank runs these independently."""
from __future__ import annotations

import io
import math

import pytest
import torch

from hpcasync.errors import CheckpointError, ConfigError
from hpcasync.rules import RULES, PushMeta, make_rule, rule_hyperparameters
from hpcasync.rules.base import smega2_lr, step_decay_lr, warmup_lr

D = 13
N = 3

# every registered rule, plus the other LC-ASGD predictors and momentum variants
VARIANTS = [(name, {}) for name in RULES] + [
    ("lcasgd", {"predictor": "ema"}), ("lcasgd", {"predictor": "lstm"}),
    ("lcasgd", {"predictor": "oracle"}), ("lcasgd", {"anchor": "fit", "momentum": 0.5}),
    ("asgd", {"momentum": 0.9, "nesterov": True}), ("dcasgd", {"momentum": 0.9}),
    ("shat", {"momentum": 0.9}),
]
IDS = [name + "".join(f"-{k}={v}" for k, v in kw.items()) for name, kw in VARIANTS]


def build(name, kw, theta0=None, n=N):
    theta0 = torch.linspace(-1, 1, D) if theta0 is None else theta0
    return make_rule(name, theta0, n, lr=0.05, weight_decay=1e-3, **kw)


def drive(rule, order, seed=0, locals_=None):
    """Push from the workers in ``order``; each worker's gradient is computed 'at' the version of
    its last reply. Returns the list of (reply params, version, scalars) and the worker copies."""
    gen = torch.Generator().manual_seed(seed)
    if locals_ is None:
        locals_ = {}
        for w in range(rule.num_workers):
            loc = torch.empty(rule.numel, dtype=rule.theta.dtype)
            rule.on_reply(loc, rule.initial_reply(w), None)
            locals_[w] = [loc, rule.version]
    out = []
    for w in order:
        loc, ver = locals_[w]
        g = (torch.randn(rule.numel, generator=gen) + 0.1 * loc).to(rule.theta.dtype)
        loss = 2.0 / (1.0 + 0.05 * ver) + 0.01 * float(torch.rand((), generator=gen))
        meta = PushMeta(version=ver, loss=loss, oracle_loss=loss - 0.01 * rule.staleness(
            PushMeta(version=ver)))
        assert rule.validate(w, g, meta) is None
        g_before = g.clone()
        reply = rule.on_push(w, g, meta)
        assert torch.equal(g, g_before), "on_push must not modify the gradient"
        out.append((reply.params.clone(), reply.version, reply.scalars))
        rule.on_reply(loc, reply, g)
        locals_[w][1] = reply.version
    return out, locals_


ORDER = [0, 1, 2, 2, 0, 1, 1, 1, 0, 2, 0, 1]


@pytest.mark.parametrize("name,kw", VARIANTS, ids=IDS)
def test_state_dict_round_trip_continues_bitwise(name, kw):
    a = build(name, kw)
    _, locs = drive(a, ORDER[:7], seed=1)
    saved = io.BytesIO()
    torch.save(a.state_dict(), saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    b = build(name, kw, theta0=torch.zeros(D))
    b.load_state_dict(state)
    assert b.version == a.version and torch.equal(b.theta, a.theta)
    assert b.state_bytes() == a.state_bytes()
    locs_b = {w: [loc.clone(), v] for w, (loc, v) in locs.items()}
    out_a, locs_a = drive(a, ORDER, seed=2, locals_=locs)
    out_b, locs_b = drive(b, ORDER, seed=2, locals_=locs_b)
    for (pa, va, sa), (pb, vb, sb) in zip(out_a, out_b):
        assert torch.equal(pa, pb) and va == vb and sa == sb
    for w in locs_a:
        assert torch.equal(locs_a[w][0], locs_b[w][0])
    assert torch.equal(a.theta, b.theta)


@pytest.mark.parametrize("name,kw", VARIANTS, ids=IDS)
def test_deterministic(name, kw):
    runs = [drive(build(name, kw), ORDER, seed=3) for _ in range(2)]
    for (pa, va, sa), (pb, vb, sb) in zip(runs[0][0], runs[1][0]):
        assert torch.equal(pa, pb) and va == vb and sa == sb
    assert len(runs[0][0][-1][2]) == RULES[name].func.reply_scalars


@pytest.mark.parametrize("name,kw", VARIANTS, ids=IDS)
def test_validate_rejects_bad_pushes(name, kw):
    rule = build(name, kw)
    drive(rule, [0, 1, 2])
    ok = PushMeta(version=1, loss=1.0, oracle_loss=0.9)
    g = torch.ones(D)
    assert rule.validate(0, g, ok) is None
    bad_grad = g.clone()
    bad_grad[3] = math.nan
    assert "NaN" in rule.validate(0, bad_grad, ok)
    bad_grad[3] = math.inf
    assert "Inf" in rule.validate(0, bad_grad, ok)
    assert "shape" in rule.validate(0, torch.ones(D + 1), ok)
    assert "shape" in rule.validate(0, torch.ones(1, D), ok)
    assert "dtype" in rule.validate(0, torch.ones(D, dtype=torch.float64), ok)
    v = rule.version            # 3 (one per push), or 1 for Rennala (one step per 3 pushes)
    assert "future" in rule.validate(0, g, PushMeta(version=v + 1, loss=1.0, oracle_loss=1.0))
    assert rule.validate(0, g, PushMeta(version=v, loss=1.0, oracle_loss=1.0)) is None
    assert "negative" in rule.validate(0, g, PushMeta(version=-1, loss=1.0, oracle_loss=1.0))
    assert "unknown worker" in rule.validate(N, g, ok)
    assert "unknown worker" in rule.validate(-1, g, ok)
    assert "not an integer" in rule.validate("0", g, ok)
    assert "not a tensor" in rule.validate(0, [1.0] * D, ok)
    rule.retire(1)
    assert "retired" in rule.validate(1, g, ok)
    rule.initial_reply(1)
    assert rule.validate(1, g, ok) is None


def test_lcasgd_validate_needs_losses():
    rule = build("lcasgd", {})
    assert "finite loss" in rule.validate(0, torch.ones(D), PushMeta(version=0))
    oracle = build("lcasgd", {"predictor": "oracle"})
    assert "oracle_loss" in oracle.validate(0, torch.ones(D), PushMeta(version=0, loss=1.0))
    assert oracle.validate(0, torch.ones(D), PushMeta(0, 1.0, 0.5)) is None


def test_staleness_over_an_interleaving():
    rule = build("asgd", {})
    seen = {w: rule.initial_reply(w).version for w in range(N)}
    order = [0, 1, 2, 0, 0, 2, 1, 1]
    expected = [0, 1, 2, 2, 0, 2, 4, 0]
    got = []
    for w in order:
        meta = PushMeta(version=seen[w])
        got.append(rule.staleness(meta))
        seen[w] = rule.on_push(w, torch.ones(D), meta).version
    assert got == expected
    assert rule.version == len(order)


@pytest.mark.parametrize("name", ["dcasgd", "dcasgd-a", "dana", "lcasgd", "shat", "smega2"])
def test_retire_drops_per_worker_state(name):
    rule = build(name, {})
    drive(rule, [0, 1, 2, 0, 1, 2])
    before = rule.state_bytes()
    rule.retire(2)
    assert rule.num_active == N - 1 and not rule.is_alive(2)
    if name in ("dcasgd", "dcasgd-a", "dana"):        # model-sized per-worker buffers
        per_worker = {"dcasgd": 1, "dcasgd-a": 2, "dana": 1}[name] * D * 4
        assert before - rule.state_bytes() == per_worker
    if name == "lcasgd":
        assert rule.state_bytes() < before
    if name == "shat":
        assert rule.counts[2] == 0
    rule.retire(2)                                     # idempotent
    assert rule.num_active == N - 1
    reply = rule.initial_reply(2)                      # rejoin
    assert rule.is_alive(2) and reply.version == rule.version


def test_registry_and_make_rule_errors():
    t = torch.zeros(4)
    assert set(RULES) == {"asgd", "dcasgd", "dcasgd-a", "lcasgd", "shat", "shat-root", "ensemble",
                          "asp", "smega2", "dana", "nag", "rennala", "ringmaster",
                          "asgd-da"}
    assert make_rule("dcasgd-a", t, 2, lr=0.1).lam == 2.0
    assert make_rule("dcasgd", t, 2, lr=0.1).lam == 0.04
    assert make_rule("shat-root", t, 2, lr=0.1).alpha_mode == "root"
    assert "lr" in rule_hyperparameters("smega2")
    assert "mode" not in rule_hyperparameters("dcasgd")
    cases = [
        (dict(name="adam"), "unknown rule 'adam'"),
        (dict(name="asgd", lr=0.1, foo=1), "unknown hyperparameter 'foo'"),
        (dict(name="dcasgd", lr=0.1, mode="adaptive"), "fixes mode='constant'"),
        (dict(name="asgd"), "needs lr"),
        (dict(name="asgd", lr=-0.1), "lr must be > 0, got -0.1"),
        (dict(name="asgd", lr=math.nan), "lr must be a finite number, got nan"),
        (dict(name="asgd", lr="0.1"), "lr must be a finite number, got '0.1'"),
        (dict(name="asgd", lr=0.1, momentum=1.0), "momentum must be < 1, got 1.0"),
        (dict(name="asgd", lr=0.1, weight_decay=-1), "weight_decay must be >= 0, got -1.0"),
        (dict(name="lcasgd", lr=0.1, predictor="gru"), "predictor must be one of"),
        (dict(name="lcasgd", lr=0.1, window=0), "window must be >= 1, got 0"),
        (dict(name="smega2", lr=0.1, estimate="x"), "estimate must be one of advanced, naive"),
        (dict(name="nag", lr=0.1, momentum=0.0), "nag needs momentum > 0"),
        (dict(name="dcasgd-a", lr=0.1, eps=0.0), "eps must be > 0, got 0.0"),
    ]
    for kwargs, message in cases:
        name = kwargs.pop("name")
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            make_rule(name, t, 2, **kwargs)
    with pytest.raises(ConfigError, match="num_workers must be >= 1, got 0"):
        make_rule("asgd", t, 0, lr=0.1)
    with pytest.raises(ConfigError, match="flat"):
        make_rule("asgd", torch.zeros(2, 2), 2, lr=0.1)
    with pytest.raises(ConfigError, match="flat"):
        make_rule("asgd", torch.zeros(4, dtype=torch.int64), 2, lr=0.1)


def test_lr_is_settable_and_checked():
    rule = build("asgd", {})
    rule.lr = 0.5
    rule.on_push(0, torch.ones(D), PushMeta(version=0))
    assert rule.lr == 0.5
    with pytest.raises(ConfigError, match="lr"):
        rule.lr = -1.0


def test_load_state_dict_rejects_mismatch():
    a = build("dcasgd", {})
    drive(a, [0, 1])
    with pytest.raises(CheckpointError, match="shape"):
        build("dcasgd", {}, theta0=torch.zeros(D + 1)).load_state_dict(a.state_dict())
    with pytest.raises(CheckpointError, match="workers"):
        build("dcasgd", {}, n=N + 1).load_state_dict(a.state_dict())
    state = a.state_dict()
    del state["backup"]
    with pytest.raises(CheckpointError, match="backup"):
        build("dcasgd", {}).load_state_dict(state)


def test_schedules():
    assert warmup_lr(0.1, 0.0, 5, 0.025) == 0.025
    assert warmup_lr(0.1, 2.5, 5, 0.02) == pytest.approx(0.06)
    assert warmup_lr(0.1, 5.0, 5, 0.02) == 0.1
    assert warmup_lr(0.1, 0.0, 0, 0.02) == 0.1
    assert step_decay_lr(0.1, 79) == 0.1
    assert step_decay_lr(0.1, 80) == pytest.approx(0.01)
    assert step_decay_lr(0.1, 150) == pytest.approx(0.001)
    assert smega2_lr(0.0, base_lr=0.1, num_workers=8) == pytest.approx(0.0125)
    assert smega2_lr(5.0, base_lr=0.1, num_workers=8) == 0.1
    assert smega2_lr(80.5, base_lr=0.1, num_workers=8) == pytest.approx(0.01)
    assert smega2_lr(120.0, base_lr=0.1, num_workers=8) == pytest.approx(0.001)
