"""Ringmaster ASGD, Rennala SGD and delay-adaptive ASGD against hand-computed sequences
(docs/design/rules.md), and Ringmaster's stopping variant in the simulator against a
hand-computed timeline.

Small integers and lr 0.5: every θ below is exact in float32, so each step is compared bitwise.
Planted bugs each of these catches: Ringmaster keeping a gradient at delay R (``>`` for ``>=``)
or dropping one at R − 1; Rennala keeping a stale gradient, stepping after B − 1 gradients, or
stepping with the sum instead of the mean or at η instead of B·η; the version moving on a
dropped gradient; delay-adaptive ASGD applying the full step (ASGD), the inverse factor, or
τ_C = N − 1 by default; the simulator not stopping a stale computation, or running a stopped
one to its end."""
from __future__ import annotations

import pytest
import torch

from hpcasync.data import load_dataset
from hpcasync.errors import ConfigError
from hpcasync.hetero import DelayModel
from hpcasync.models import build_model
from hpcasync.rules import PushMeta, make_rule
from hpcasync.rules.rennala import theorem_batch
from hpcasync.rules.ringmaster import theorem_threshold
from hpcasync.sim.engine import AsyncSim

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


def test_rennala_refuses_a_batch_larger_than_every_push_of_the_run():
    """B pushes are the first step's (none is stale before θ steps): a run of fewer pushes in all
    would end on the initial θ. The simulator makes the check too."""
    rule = make_rule("rennala", THETA0, 2, lr=0.5, batch=5)
    rule.check_run_length(5)                            # exactly one step: trains
    with pytest.raises(ConfigError, match=r"batch \(--rennala-batch\) 5 is more than the run's 4 "
                       r"pushes in all: θ would never step"):
        rule.check_run_length(4)
    make_rule("ringmaster", THETA0, 2, lr=0.5).check_run_length(1)      # (the default: nothing)


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


def test_delay_adaptive_scales_the_step_by_tau_c_over_the_delay_beyond_tau_c():
    rule = make_rule("asgd-da", THETA0, 3, lr=0.5, tau_c=2)
    push(rule, 0, g(2, 2, 2, 2), 0)                     # δ 0: η
    assert torch.equal(rule.theta, g(3, -3, 7, -1))
    push(rule, 1, g(4, 0, -2, 2), 0)                    # δ 1: η
    assert torch.equal(rule.theta, g(1, -3, 8, -2))
    push(rule, 2, g(4, 4, 4, 4), 0)                     # δ 2 = τ_C: η
    assert torch.equal(rule.theta, g(-1, -5, 6, -4))
    push(rule, 0, g(0, 2, 0, 0), 1)                     # δ 2: η
    assert torch.equal(rule.theta, g(-1, -6, 6, -4))
    push(rule, 1, g(4, 4, -4, 8), 0)                    # δ 4: η·2/4
    assert torch.equal(rule.theta, g(-2, -7, 7, -6)) and rule.version == 5
    dflt = make_rule("asgd-da", THETA0, 3, lr=0.5)      # τ_C = N = 3
    assert dflt.tau_c == 3
    for k in range(3):
        push(dflt, 0, g(0, 0, 0, 0), k)
    push(dflt, 1, g(8, 8, 8, 8), 0)                     # δ 3: η
    assert torch.equal(dflt.theta, THETA0 - 4)
    push(dflt, 2, g(8, 8, 8, 8), 0)                     # δ 4: η·3/4
    assert torch.equal(dflt.theta, THETA0 - 7)
    with pytest.raises(ConfigError, match="tau_c must be >= 1"):
        make_rule("asgd-da", THETA0, 2, lr=0.1, tau_c=0)


def _stop_sim(stop: bool, name: str = "ringmaster", **kw):
    """3 workers of 2 steps each, worker 2 2.5x slower (hand-computed timelines below)."""
    train, _ = load_dataset("fashion-mnist-mini", train_limit=96, test_limit=10)
    torch.manual_seed(0)
    model = build_model("mlp", (1, 28, 28), 10)
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rules = [make_rule(name, theta0, 3, lr=0.01, stop_stale=stop, **kw) for _ in range(2)]
    sim = AsyncSim(*rules, model, train, DelayModel(factors={2: 2.5}), num_workers=3, epochs=1,
                   batch_size=16, seed=0, step_time=1.0)
    return sim, sim.run()


def test_the_simulator_stops_a_computation_once_its_delay_reaches_r():
    """t=1: w0 (δ 0) and w1 (δ 1) step; worker 2, at version 0, is at delay 2: stopped, it starts
    again at t=1 (due 3.5). t=2: w0 and w1 step again (δ 1 each); worker 2, now at version 2,
    reaches delay 2 again: stopped, due 4.5. Then it pushes twice alone (δ 0), the last at
    t=7. A stopped computation uses no batch, and no gradient is ever dropped on arrival."""
    sim, stats = _stop_sim(True, threshold=2)
    assert sim.rule.stopped == 2 and sim.rule.discarded == 0 and sim.rule.version == 6
    assert stats.accepted == 6 and dict(stats.histogram) == {0: 3, 1: 3}
    assert sim.sim_time == pytest.approx(7.0)
    sim, stats = _stop_sim(False, threshold=2)  # without stopping: dropped on arrival at t=2.5
    assert sim.rule.stopped == 0 and sim.rule.discarded == 1 and sim.rule.version == 5
    assert sim.sim_time == pytest.approx(5.0)


def test_the_simulator_stops_rennalas_computations_at_the_old_theta_when_it_steps():
    """B = 2. t=1: w0's gradient is the first of the batch (θ stays: w0 goes on at version 0),
    w1's completes it: θ steps; worker 2 and worker 0, both at version 0, are stopped and start
    again (due 3.5 and 2). t=2: w0 and w1 (version 1) step θ again; worker 2 (version 1) is
    stopped again (due 4.5). It then gives both gradients of the last step alone (t=4.5, 7)."""
    sim, stats = _stop_sim(True, "rennala", batch=2)
    assert sim.rule.stopped == 3 and sim.rule.discarded == 0 and sim.rule.version == 3
    assert stats.accepted == 6 and sim.sim_time == pytest.approx(7.0)
    sim, stats = _stop_sim(False, "rennala", batch=2)   # w0 at t=2 and w2 at t=2.5: dropped
    assert sim.rule.stopped == 0 and sim.rule.discarded == 2 and sim.rule.version == 2
    assert sim.sim_time == pytest.approx(5.0)


def test_stopping_is_the_simulators_only():
    from hpcasync.ps.optimizer import ParameterServer

    model = build_model("mlp", (1, 28, 28), 10)
    with pytest.raises(ConfigError, match="runs in the simulator only"):
        ParameterServer(model, "ringmaster", lr=0.1, stop_stale=True, start=False)
    with pytest.raises(ConfigError, match="runs in the simulator only"):
        ParameterServer(model, "rennala", lr=0.1, stop_stale=True, start=False)
    with pytest.raises(ConfigError, match="stop_stale must be True or False"):
        make_rule("ringmaster", THETA0, 2, lr=0.1, stop_stale=1)
