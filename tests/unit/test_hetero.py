"""The delay model: SHAT's settings, stragglers, seeded Gamma step times, push delay, validation;
and its effect in the simulator (the 10x slower worker pushes 10x less often)."""
import time

import numpy as np
import pytest

from hpcasync.errors import ConfigError
from hpcasync.hetero import DelayModel, check_options

WORKERS = [1, 2, 3]          # a 4-rank PS job: rank 0 serves


@pytest.mark.parametrize("setting, slow", [("HO", 1.0), ("HE0", 2.0), ("HE1", 10.0),
                                           ("HE2", 100.0)])
def test_shat_settings_slow_down_the_last_worker(setting, slow):
    d = DelayModel.from_options({"hetero": setting}, worker_ranks=WORKERS)
    for step in range(5):
        assert d.factor(0, step) == d.factor(1, step) == 1.0
        assert d.factor(2, step) == slow
        assert d.step_time(2, step, 0.01) == pytest.approx(0.01 * slow)
        assert d.extra(2, step, 0.01) == pytest.approx(0.01 * (slow - 1))
        assert d.extra(0, step, 0.01) == 0.0
    assert d.trivial == (setting == "HO")


def test_stragglers_by_rank_compose_with_hetero():
    d = DelayModel.from_options({"straggler": "1:3,3:2.5", "hetero": "HE1"}, worker_ranks=WORKERS)
    assert d.factors == {0: 3.0, 2: 25.0}          # rank 1 = worker 0, rank 3 = worker 2
    d = DelayModel.from_options({"straggler": "0:4"}, worker_ranks=[0, 1, 3])   # PS on rank 2
    assert d.factors == {0: 4.0}


def test_gamma_multiplier_is_seeded_per_worker_and_step_with_mean_one():
    d = DelayModel.from_options({"compute_time": "gamma:100"}, worker_ranks=WORKERS, seed=7)
    a = [d.multiplier(1, s) for s in range(2000)]
    assert a == [d.multiplier(1, s) for s in range(2000)]       # same (seed, w, s): same draw
    assert a != [d.multiplier(2, s) for s in range(2000)]
    assert abs(np.mean(a) - 1.0) < 0.01 and abs(np.std(a) - 0.1) < 0.01     # Gamma(100, 1/100)
    other = DelayModel.from_options({"compute_time": "gamma:100"}, worker_ranks=WORKERS, seed=8)
    assert other.multiplier(1, 0) != a[0]
    assert DelayModel().multiplier(1, 0) == 1.0


@pytest.mark.parametrize("spec", ["lognormal:1.5", "pareto:1.8"])
def test_heavy_tailed_multipliers_have_mean_one_and_a_heavy_tail(spec):
    """Log-normal σ 1.5 and Pareto α 1.8 (infinite variance): mean 1 (the median of 20
    batch means of 1000 draws, robust to the tail), seeded per (worker, step), and a tail far
    beyond Gamma's: the 99.9th percentile above 10x the mean (Gamma(1): ~6.9x)."""
    d = DelayModel.from_options({"compute_time": spec}, worker_ranks=WORKERS, seed=3)
    a = np.array([d.multiplier(0, s) for s in range(20_000)])
    assert a.min() > 0 and [d.multiplier(0, s) for s in range(5)] == list(a[:5])
    assert abs(np.median(a.reshape(20, -1).mean(axis=1)) - 1.0) < 0.15
    assert np.quantile(a, 0.999) > 10
    gamma = DelayModel.from_options({"compute_time": "gamma:1"}, worker_ranks=WORKERS, seed=3)
    assert np.quantile([gamma.multiplier(0, s) for s in range(20_000)], 0.999) < 8
    assert spec.split(":")[0] in d.describe() and d.to_record()["compute_time"] == spec


def test_real_runtime_sleeps_for_the_extra_time():
    d = DelayModel.from_options({"hetero": "HE1", "push_delay": 5.0}, worker_ranks=WORKERS)
    t0 = time.perf_counter()
    slept = d.sleep_extra(2, 0, natural=0.002)
    d.sleep_push()
    elapsed = time.perf_counter() - t0
    assert slept == pytest.approx(0.018) and d.push_delay_s == 0.005
    assert elapsed >= 0.023


@pytest.mark.parametrize("options, needle", [
    ({"hetero": "HE9"}, "--hetero 'HE9' is not one of"),
    ({"straggler": "1"}, "each entry must be RANK:FACTOR"),
    ({"straggler": "1:0"}, "FACTOR > 0"),
    ({"straggler": "1:2,1:3"}, "rank 1 is given twice"),
    ({"compute_time": "gamma:-1"}, "got 'gamma:-1'"),
    ({"compute_time": "normal:3"}, "must be 'fixed', 'gamma:SHAPE'"),
    ({"compute_time": "pareto:1"}, "or 'pareto:ALPHA' .ALPHA > 1., got 'pareto:1'"),
    ({"compute_time": "lognormal:0"}, "got 'lognormal:0'"),
    ({"push_delay": -1.0}, "--push-delay must be"),
])
def test_bad_options_one_line_errors(options, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("'", "'")) as e:
        check_options(options)
    assert "\n" not in str(e.value)


def test_straggler_must_be_a_worker():
    with pytest.raises(ConfigError, match="rank 0 is not a worker of this job"):
        DelayModel.from_options({"straggler": "0:2"}, worker_ranks=WORKERS)


@pytest.mark.rank0
def test_simulated_slow_worker_pushes_ten_times_less_often():
    import torch

    from hpcasync.data import load_dataset
    from hpcasync.models import build_model
    from hpcasync.rules import make_rule
    from hpcasync.sim.engine import AsyncSim

    train, _ = load_dataset("fashion-mnist-mini", train_limit=960, test_limit=10)
    torch.manual_seed(0)
    model = build_model("mlp", train.input_shape, train.num_classes)
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    delay = DelayModel.from_options({"hetero": "HE1"}, worker_ranks=WORKERS)
    times = {0: [], 1: [], 2: []}
    sim = AsyncSim(make_rule("asgd", theta0, 3, lr=0.01), make_rule("asgd", theta0, 3, lr=0.01),
                   model, train, delay, num_workers=3, epochs=1, batch_size=8, seed=0,
                   step_time=1.0, on_push=lambda w, tau, loss, t: times[w].append(t))
    stats = sim.run()
    assert stats.per_worker == [40, 40, 40]          # everyone trains its whole shard ...
    assert times[0][-1] == times[1][-1] == 40.0      # ... fast workers in 40 s
    assert times[2] == [10.0 * k for k in range(1, 41)]
    in_window = [sum(t <= 40.0 for t in times[w]) for w in range(3)]
    assert in_window == [40, 40, 4]                  # 10x fewer pushes while all are running
    assert stats.histogram[0] > 0 and max(stats.histogram) >= 8
