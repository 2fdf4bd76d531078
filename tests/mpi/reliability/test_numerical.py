"""Numerical faults: the divergence test by hand, the guard inside RunContext (no epoch record and
no checkpoint with NaN weights), real diverging runs (ssgd, daso, odsgd under mpiexec -n 4; the
simulator) that stop with one line, and NaN gradients at the parameter server rejected and counted
while training goes on."""
from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch

from hpcasync.checkpoint import CheckpointManager, load_checkpoint
from hpcasync.config import TrainConfig
from hpcasync.errors import ConfigError, DivergedError, HpcasyncError
from hpcasync.metrics import MetricsWriter, read_metrics
from hpcasync.runtime.context import Progress, RunContext
from hpcasync.runtime.divergence import DivergenceGuard, check_factor, diverged, first_nonfinite
from tests.mpi_util import clean_env, run_cli, run_mpi

MINI = ["--dataset", "fashion-mnist-mini", "--train-limit", "2048", "--test-limit", "200",
        "--epochs", "2", "--progress", "off"]


def _error_lines(stderr: str) -> list[str]:
    return [ln[ln.index("hpcasync: error"):] for ln in stderr.splitlines()
            if "hpcasync: error" in ln]


# -- the test by hand ------------------------------------------------------------------------------

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


# -- inside RunContext -----------------------------------------------------------------------------

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


# -- real runs -------------------------------------------------------------------------------------

@pytest.mark.rank0
@pytest.mark.parametrize("algorithm", ["ssgd", "daso", "odsgd"])
def test_diverging_run_stops_with_one_line_and_no_nan_record(tmp_path, algorithm):
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    extra = ["--ranks-per-node", "2"] if algorithm == "daso" else []
    t0 = time.time()
    r = run_mpi(4, ["train", *MINI, "--algorithm", algorithm, *extra, "--lr", "1e4",
                    "--log-every", "1", "--metrics", str(metrics), "--checkpoint-dir", str(ckpt),
                    "--checkpoint-every", "1"], timeout=120)
    elapsed = time.time() - t0
    assert r.returncode == 2 and elapsed < 30, (elapsed, r.stderr[-2000:])
    lines = _error_lines(r.stderr)
    assert len(lines) == 1 and "training diverged at step" in lines[0], r.stderr[-2000:]
    assert "lower --lr" in lines[0] and "Traceback" not in r.stderr
    assert not metrics.exists()                     # an unfinished run leaves only the .partial
    text = (tmp_path / "m.jsonl.partial").read_text()
    records = [json.loads(line) for line in text.splitlines()]
    assert records[-1]["event"] == "diverged" and records[-1]["reason"] in lines[0]
    assert "epoch" not in [rec["event"] for rec in records]
    for line, rec in zip(text.splitlines(), records):
        if rec["event"] != "config":        # NaN is written as null, an infinity as "inf"
            assert "null" not in line and '"inf"' not in line and '"-inf"' not in line, line
    assert [rec["event"] for rec in records if rec["event"] == "step"]     # losses were logged
    for path in ckpt.glob("ckpt-*.pt"):            # whatever was saved holds finite values
        assert first_nonfinite(load_checkpoint(path)) is None


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


@pytest.mark.rank0
def test_nan_gradients_rejected_at_the_ps_and_counted(tmp_path):
    """Worker rank 2 pushes a NaN gradient at its 5th step: the PS (rank 0) rejects it, counts
    it in the epoch record and the summary, and the run ends normally with finite weights."""
    m = tmp_path / "m.jsonl"
    r = run_mpi(4, ["train", *MINI, "--algorithm", "asgd", "--lr", "0.05",
                    "--metrics", str(m)], env=clean_env(HPCASYNC_INJECT_NAN="2:5"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    records = read_metrics(m)
    epochs = [rec for rec in records if rec["event"] == "epoch"]
    summary = records[-1]
    assert [e["rejected_pushes"] for e in epochs] == [1, 0] and summary["rejected_pushes"] == 1
    assert summary["pushes"] == 2 * 3 * ((2048 // 3) // 32) - 1      # every other push applied
    assert "NaN" in json.dumps(summary["reject_reasons"])
    # finite weights that learned (125 pushes of 32 images, 2 epochs; chance is 10 %). This command
    # measured 51 47 44 43 / 56 / 51 % (seed 0 x4 / 1 / 2; the push order varies) and test loss
    # 1.22-1.42 (2.30-2.31 untrained); 12 more runs of it (2026-11-24, without the NaN) 34-55 %,
    # loss 1.15-1.67, and a full-suite run loss 1.79. With 1 epoch (62 pushes) it had measured
    # 29.5-42 % and CI's MPICH pass then got 24 %: so the bars are the worst run - 8 points / + 0.2
    assert math.isfinite(summary["test_loss"]) and summary["test_accuracy"] >= 0.26, summary
    assert summary["test_loss"] < 2.0, summary


def test_diverged_error_is_a_user_error():
    assert issubclass(DivergedError, HpcasyncError)
