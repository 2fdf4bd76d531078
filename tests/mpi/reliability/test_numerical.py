"""Numerical faults under MPI: real diverging runs (ssgd, daso, odsgd under mpiexec -n 4) that stop
with one line, and NaN gradients at the parameter server rejected and counted while training goes
on. (The divergence test by hand, the guard inside RunContext and the simulator:
tests/unit/test_numerical.py.)"""
from __future__ import annotations

import json
import math
import time

import pytest

from hpcasync.checkpoint import load_checkpoint
from hpcasync.metrics import read_metrics
from hpcasync.runtime.divergence import first_nonfinite
from tests.mpi_util import clean_env, run_mpi
from tests.unit.test_numerical import MINI, _error_lines


@pytest.mark.rank0
# MPICH: the stop's MPI part (the agreed stop, rank 0's one line, the others' exit) is ssgd's; daso
# and odsgd differ in the loss they watch, not in MPI calls (CI's MPICH pass leaves them out)
@pytest.mark.parametrize("algorithm", ["ssgd", pytest.param("daso", marks=pytest.mark.one_mpi),
                                       pytest.param("odsgd", marks=pytest.mark.one_mpi)])
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
@pytest.mark.one_mpi       # MPICH: test_ps.py's in-process bad-push test
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
