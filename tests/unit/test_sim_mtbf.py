"""hpcasync.sim.mtbf: the closed forms against hand-computed cases and against the Monte-Carlo
simulation of the same model."""
import math

import pytest

from hpcasync.sim.mtbf import MODES, Costs, daly_interval, efficiency, simulate, table

COSTS = Costs(shrink_s=2.0, grow_s=10.0, restart_s=30.0, checkpoint_s=0.0,
              checkpoint_every_s=100.0)


@pytest.mark.parametrize("mode", MODES)
def test_no_failures_is_one(mode):
    kw = dict(ranks=512, node_mtbf_s=math.inf, job_s=86400.0, costs=COSTS)
    assert efficiency(mode, **kw) == 1.0
    assert simulate(mode, reps=3, **kw).efficiency == pytest.approx(1.0, abs=1e-12)


def test_grow_by_hand():
    # 100 ranks, node MTBF 1e5 s: the job fails once per 1000 s of work; 10 s per death:
    # E[T] = H (1 + 10 / 1000)
    kw = dict(ranks=100, node_mtbf_s=1e5, job_s=1e4, costs=COSTS)
    assert efficiency("grow", **kw) == pytest.approx(1 / 1.01, rel=1e-12)
    sim = simulate("grow", reps=2000, seed=3, **kw)
    assert sim.efficiency == pytest.approx(1 / 1.01, abs=4 * sim.stderr + 1e-4)
    assert sim.deaths == pytest.approx(10, rel=0.05)


def test_restart_by_hand():
    # Λ = 1e-3 /s, τ = 100 s, δ = 0, R = 0: a segment takes (e^0.1 - 1) / Λ = 105.17 s
    costs = Costs(restart_s=0.0, checkpoint_s=0.0, checkpoint_every_s=100.0)
    kw = dict(ranks=100, node_mtbf_s=1e5, job_s=1e4, costs=costs)
    assert efficiency("restart", **kw) == pytest.approx(100 / 105.1709181, rel=1e-8)
    # with R = 30 s and δ = 5 s: (e^0.105 - 1)(1000 + 30) per 100 s of work
    kw["costs"] = Costs(restart_s=30.0, checkpoint_s=5.0, checkpoint_every_s=100.0)
    expect = 100 / (math.expm1(0.105) * 1030)
    assert efficiency("restart", **kw) == pytest.approx(expect, rel=1e-12)
    sim = simulate("restart", reps=1000, seed=4, **kw)
    assert sim.efficiency == pytest.approx(expect, abs=4 * sim.stderr + 1e-4)


def test_restart_partial_last_segment():
    # 250 s of work, τ = 100 s, no failures, δ = 1 s: three checkpoints, 253 s
    costs = Costs(checkpoint_s=1.0, checkpoint_every_s=100.0)
    assert efficiency("restart", ranks=4, node_mtbf_s=math.inf, job_s=250.0,
                      costs=costs) == pytest.approx(250 / 253)


def test_shrink_by_hand():
    # 10 ranks, node MTBF 1000 s, 500 s of work: the live ranks fall as N e^{-t/M}, the work
    # done is M (1 - e^{-t/M}) = 500 at t = M ln 2; 5 deaths expected, 2 s each
    kw = dict(ranks=10, node_mtbf_s=1000.0, job_s=500.0, costs=COSTS)
    assert efficiency("shrink", **kw) == pytest.approx(500 / (1000 * math.log(2) + 10),
                                                       rel=1e-12)
    # fewer than min_ranks expected at the end: the job does not finish
    assert efficiency("shrink", min_ranks=6, **kw) == 0.0


def test_shrink_mean_field_matches_simulation_at_scale():
    # 1000 ranks, half the node MTBF of work: ~500 deaths, the mean field within 1 %
    kw = dict(ranks=1000, node_mtbf_s=2e4, job_s=1e4, costs=COSTS)
    sim = simulate("shrink", reps=200, seed=5, **kw)
    assert sim.finished == 1.0
    assert sim.deaths == pytest.approx(500, rel=0.02)
    assert sim.efficiency == pytest.approx(efficiency("shrink", **kw), rel=0.01)


def test_daly_interval():
    # δ = 10 s, job MTBF 1000 s: sqrt(2·10·1000)·(1 + sqrt(0.005)/3 + 0.005/9) - 10
    x = 10 / 2000
    assert daly_interval(10.0, 1000.0) == pytest.approx(
        math.sqrt(20000) * (1 + math.sqrt(x) / 3 + x / 9) - 10)
    assert daly_interval(3000.0, 1000.0) == 1000.0
    # the optimum is no worse than a factor 2 either side of it
    c = Costs(restart_s=30.0, checkpoint_s=10.0)
    kw = dict(ranks=100, node_mtbf_s=1e5, job_s=1e5)
    best = efficiency("restart", costs=c, **kw)
    for tau in (daly_interval(10.0, 1000.0) / 2, daly_interval(10.0, 1000.0) * 2):
        other = Costs(restart_s=30.0, checkpoint_s=10.0, checkpoint_every_s=tau)
        assert efficiency("restart", costs=other, **kw) <= best + 1e-9


def test_bad_input_names_it():
    with pytest.raises(ValueError, match="mode"):
        efficiency("elastic", ranks=4, node_mtbf_s=1.0, job_s=1.0, costs=COSTS)
    with pytest.raises(ValueError, match="grow_s"):
        Costs(grow_s=-1.0)
    with pytest.raises(ValueError, match="min_ranks"):
        efficiency("shrink", ranks=4, node_mtbf_s=1.0, job_s=1.0, costs=COSTS, min_ranks=5)


def test_table_rows():
    text = table(COSTS, ranks=(64,), node_mtbf=(("1 day", 86400.0),))
    assert text.count("\n") == 2 and "| 64 | 1 day |" in text
