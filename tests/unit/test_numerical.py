"""Numerical faults in one process: the divergence test by hand, the guard inside RunContext (no
epoch record and no checkpoint with NaN weights), and a diverging simulation that stops with one
line. (Diverging MPI runs and NaN gradients at the parameter server:
tests/mpi/reliability/test_numerical.py.)"""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch

from hpcasync.checkpoint import CheckpointManager
from hpcasync.config import TrainConfig
from hpcasync.errors import ConfigError, DivergedError, HpcasyncError
from hpcasync.metrics import MetricsWriter, read_metrics
from hpcasync.runtime.context import Progress, RunContext
from hpcasync.runtime.divergence import DivergenceGuard, check_factor, diverged, first_nonfinite
from tests.mpi_util import run_cli

MINI = ["--dataset", "fashion-mnist-mini", "--train-limit", "2048", "--test-limit", "200",
        "--epochs", "2", "--progress", "off"]


def _error_lines(stderr: str) -> list[str]:
    return [ln[ln.index("hpcasync: error"):] for ln in stderr.splitlines()
            if "hpcasync: error" in ln]


def test_diverged_core_cases():
    assert diverged(math.nan, smoothed=1.0, best=1.0, first=1.0, factor=10)
    assert diverged(math.inf, smoothed=1.0, best=1.0, first=1.0, factor=0)    # 0: NaN/Inf only
    assert not diverged(1e9, smoothed=1e9, best=1.0, first=2.0, factor=0)
    assert diverged(30.0, smoothed=25.0, best=2.0, first=2.3, factor=10)       # both bounds
    assert not diverged(30.0, smoothed=20.0, best=2.0, first=2.3, factor=10)   # = 10 x best
    assert not diverged(0.3, smoothed=0.2, best=0.01, first=2.3, factor=10)    # below the start


def test_guard_triggers_at_the_computed_step():
    g = DivergenceGuard(factor=10, window=4)
    for step, loss in enumerate([2.0, 1.0, 0.5, 0.25], start=1):
        g.check(loss, step=step)                  # means 2, 1.5, 1.1667, 0.9375
    assert g.best == pytest.approx(0.9375) and g.first == 2.0
    with pytest.raises(DivergedError) as info:
        g.check(100.0, step=5)                    # mean of (1, .5, .25, 100) = 25.4375 > 9.375
    msg = str(info.value)
    assert msg.startswith("training diverged at step 5: mean loss of the last 4 steps 25.44 > "
                          "10 x best 0.9375; lower --lr") and "\n" not in msg


def test_guard_lets_a_trained_run_wobble_and_stops_on_nan():
    g = DivergenceGuard(factor=10, window=5)
    losses = [2.3 * 0.9 ** i for i in range(60)] + [0.2] * 20      # best ~0.005, then 40x worse
    for step, loss in enumerate(losses, start=1):
        g.check(loss, step=step)                  # never above the first loss: no stop
    with pytest.raises(DivergedError, match=r"^training diverged at step 81: loss nan is not "
                                            r"finite; lower --lr"):
        g.check(float("nan"), step=81)
    off = DivergenceGuard(factor=0)
    for step, loss in enumerate([2.3, 1e6, 1e12], start=1):
        off.check(loss, step=step)                # ratio test off
    with pytest.raises(DivergedError, match="loss inf is not finite"):
        off.check(float("inf"), step=4)


def test_first_nonfinite_names_the_tensor():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    assert first_nonfinite(model) is None
    with torch.no_grad():
        model[1].weight[0, 1] = float("-inf")
    assert first_nonfinite(model) == "['1.weight']"
    state = {"model": model.state_dict(), "optimizer": {"state": {0: {"m": torch.zeros(2)}}},
             "loss_sum": float("nan"), "steps": torch.tensor(3)}   # floats/ints are not weights
    assert first_nonfinite(state) == "['model']['1.weight']"
    assert first_nonfinite({"x": [torch.ones(2), torch.tensor([1.0, float("nan")])]}) == \
        "['x'][1]"
    with pytest.raises(DivergedError, match=r"at the end of epoch 3: non-finite values in "
                                            r"\['1.weight'\]"):
        DivergenceGuard().check_weights(model, where="the end of epoch 3")


@pytest.mark.parametrize("bad", [0.5, 1, 1.0, -2, float("inf"), float("nan"), True, "10"])
def test_factor_validation(bad):
    with pytest.raises(ConfigError, match="--divergence-factor must be 0 .off. or a finite"):
        check_factor(bad)
    for good in (0, 0.0, 1.5, 10, 1e6):
        check_factor(good)
    with pytest.raises(ConfigError):
        TrainConfig(divergence_factor=bad).validate(("ssgd",))


def _ctx(tmp_path):
    from mpi4py import MPI

    cfg = TrainConfig(model="mlp", checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1)
    topo = SimpleNamespace(rank=0, size=1, world=MPI.COMM_SELF, device="cpu")
    test = SimpleNamespace(images=torch.zeros(4, 1, 28, 28),
                           labels=torch.zeros(4, dtype=torch.long))
    return RunContext(cfg=cfg, topo=topo, train=None, test=test, make_model=None,
                      metrics=MetricsWriter(tmp_path / "m.jsonl"), progress=Progress(False),
                      checkpoints=CheckpointManager(tmp_path / "ckpt"), checkpoint_every=1)


def test_context_refuses_nan_loss_weights_and_checkpoints(tmp_path):
    from mpi4py import MPI

    ctx = _ctx(tmp_path)
    model = torch.nn.Linear(784, 10)
    net = torch.nn.Sequential(torch.nn.Flatten(), model)
    assert ctx.step_done(1, 1, 2.3) == 2.3
    ctx.consistent_point(MPI.COMM_SELF, lambda: {"model": net.state_dict()}, epoch=1, step=1,
                         writer=True)                      # finite: written
    with torch.no_grad():
        model.bias[3] = float("nan")
    with pytest.raises(DivergedError, match=r"epoch 1, step 2 \(checkpoint not written\): "
                                            r"non-finite values in \['model'\]\['1.bias'\]"):
        ctx.consistent_point(MPI.COMM_SELF, lambda: {"model": net.state_dict()}, epoch=1, step=2,
                             writer=True)
    with pytest.raises(DivergedError, match=r"at the end of epoch 1: non-finite values in "
                                            r"\['1.bias'\]"):
        ctx.epoch_end(1, net, train_loss=2.0)
    with pytest.raises(DivergedError, match="step 2: loss nan is not finite"):
        ctx.step_done(1, 2, float("nan"))
    ctx.metrics.close()
    assert [r["event"] for r in read_metrics(tmp_path / "m.jsonl")] == ["checkpoint"]
    assert [p.name for p in ctx.checkpoints.checkpoints()] == ["ckpt-e0001-s00000001.pt"]


def test_a_model_collapsed_to_one_class_is_said_at_its_epoch_end(tmp_path, caplog):
    """A constant predictor (smega2's collapse under contention: docs/developers/known-gaps.md)
    exits 0 with an accuracy at chance, as torch's run would: its epoch record gives the share
    of the most predicted class and the log says it in one warning; a model that learned, or a
    test set of one class, is not flagged."""
    from hpcasync.data import ArrayDataset
    from hpcasync.runtime.context import constant_predictor, evaluate

    ctx = _ctx(tmp_path)
    labels = torch.arange(40) % 10
    ctx.test = ArrayDataset(torch.randn(40, 1, 28, 28), labels, num_classes=10)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    with torch.no_grad():
        net[1].weight.zero_()
        net[1].bias.copy_(torch.arange(10.0) == 5)        # class 5 for every image
    with caplog.at_level("WARNING", logger="hpcasync"):
        record = ctx.epoch_end(1, net, train_loss=2.3)
    assert record["top_class_share"] == 1.0 and record["test_accuracy"] == 0.1
    said = [r.getMessage() for r in caplog.records if "constant predictor" in r.getMessage()]
    assert said == ["epoch 1: the model gives 100.0% of the test images one class (test accuracy "
                    "10.00%): it has collapsed to a constant predictor; the run goes on as torch "
                    "would (docs/guide/troubleshooting.md)"]
    with torch.no_grad():                                  # a model that separates the classes
        net[1].bias.zero_()
        net[1].weight.copy_(torch.randn(10, 784))
    caplog.clear()
    with caplog.at_level("WARNING", logger="hpcasync"):
        record = ctx.epoch_end(2, net, train_loss=2.0)
    assert record["top_class_share"] < 0.99 and not caplog.records
    assert constant_predictor(1.0, labels) and not constant_predictor(0.98, labels)
    assert not constant_predictor(1.0, torch.zeros(40, dtype=torch.long))   # one class: right
    assert not constant_predictor(1.0, torch.rand(40))                        # not classes
    loss, acc, top = evaluate(net, ctx.test, predictions=True)
    assert (loss, acc) == evaluate(net, ctx.test) and 0 < top < 0.99
    ctx.metrics.close()
    epochs = [r for r in read_metrics(tmp_path / "m.jsonl") if r["event"] == "epoch"]
    assert [r["top_class_share"] for r in epochs][0] == 1.0


@pytest.mark.rank0
@pytest.mark.parametrize("algorithm", ["ssgd", "asgd"])
def test_diverging_simulation_stops_with_one_line(tmp_path, algorithm):
    t0 = time.time()
    r = run_cli(["sim", *MINI, "--algorithm", algorithm, "--workers", "4", "--lr", "1e4",
                 "--metrics", str(tmp_path / "m.jsonl")], timeout=120)
    assert r.returncode == 2 and time.time() - t0 < 30, r.stderr[-2000:]
    lines = _error_lines(r.stderr)
    assert len(lines) == 1 and "training diverged at step" in lines[0], r.stderr[-2000:]
    events = [rec["event"] for rec in read_metrics(tmp_path / "m.jsonl.partial")]
    assert "epoch" not in events


def test_diverged_error_is_a_user_error():
    assert issubclass(DivergedError, HpcasyncError)


def test_divergence_guard_state_round_trips():
    g = DivergenceGuard(factor=3.0, window=4)
    for i, loss in enumerate([2.0, 1.0, 0.5, 0.4, 0.3]):
        g.check(loss, step=i)
    h = DivergenceGuard(factor=3.0, window=4)
    h.load_state_dict(g.state_dict())
    assert (list(h.recent), h.best, h.first, h.seen) == (list(g.recent), g.best, g.first, g.seen)
    fresh = DivergenceGuard(factor=3.0, window=4)
    fresh.load_state_dict(DivergenceGuard(factor=3.0, window=4).state_dict())
    assert fresh.best == math.inf and fresh.first is None
