"""Preemption: a job signalled mid-training checkpoints at an agreed step and exits 75; a resumed
run ends with the same final parameters as an uninterrupted one (SSGD: bitwise)."""
import json
import shutil
import signal
import subprocess
import sys

import pytest

from hpcasync.metrics import read_metrics
from tests.mpi_util import (REPO, SSGD_REFERENCE, clean_env, error_lines, last_summary, mpiexec,
                            reference_summary, run_mpi, wait_for)

# 16 steps an epoch, 3 epochs; the ranks agree on a stop every 10 steps
ARGS = SSGD_REFERENCE


@pytest.mark.rank0
def test_ssgd_preempted_and_resumed_is_bitwise_equal(tmp_path):
    # the uninterrupted run (shared with reliability/test_recovery.py)
    want = reference_summary(ARGS, tmp_path)["params_sha256"]

    ckpt = tmp_path / "ckpt"
    partial = tmp_path / "a.jsonl.partial"
    cmd = [*mpiexec(4), sys.executable, "-m", "hpcasync.cli", *ARGS,
           "--metrics", str(tmp_path / "a.jsonl"), "--checkpoint-dir", str(ckpt)]
    job = subprocess.Popen(cmd, env=clean_env(), cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        # signal once the first epoch is recorded: the stop lands somewhere inside epoch 2
        wait_for(lambda: partial.exists() and '"epoch"' in partial.read_text(), 240, "epoch 1")
        job.send_signal(signal.SIGUSR1)          # as `#SBATCH --signal=B:USR1@60` would
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 75, err[-2000:]
    records = [json.loads(line) for line in partial.read_text().splitlines()]
    assert records[-1]["event"] == "preempted"
    assert any(r["event"] == "checkpoint" for r in records)
    assert list(ckpt.glob("ckpt-*.pt"))

    resumed = run_mpi(4, [*ARGS, "--metrics", str(tmp_path / "b.jsonl"), "--checkpoint-dir",
                          str(ckpt), "--resume", "auto"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    records = read_metrics(tmp_path / "b.jsonl")
    assert records[1]["event"] == "resume"
    assert last_summary(tmp_path / "b.jsonl")["params_sha256"] == want


_good: dict = {}         # one good checkpoint for the three damages (each damages its own copy)


@pytest.mark.rank0
# --resume PATH is read before MPI starts (train.precheck), on every rank alike: the three damages
# take one MPI path, "truncate"'s; the other two are one_mpi (CI's MPICH pass leaves them out)
@pytest.mark.parametrize("damage", ["truncate", pytest.param("garbage", marks=pytest.mark.one_mpi),
                                    pytest.param("wrong-model", marks=pytest.mark.one_mpi)])
def test_bad_checkpoint_one_line_error(tmp_path, damage):
    if "path" not in _good:
        ckpt = tmp_path / "good"
        r = run_mpi(2, [*ARGS, "--epochs", "1", "--train-limit", "512", "--checkpoint-dir",
                        str(ckpt)], timeout=200)
        assert r.returncode == 0, r.stderr[-2000:]
        _good["path"] = sorted(ckpt.glob("ckpt-*.pt"))[-1]
    good = _good["path"]
    (tmp_path / "ckpt").mkdir()
    path = tmp_path / "ckpt" / good.name
    shutil.copyfile(good, path)
    extra = []
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(b"not a checkpoint at all" * 10)
    else:
        extra = ["--model", "mlp"]
    r = run_mpi(2, [*ARGS, "--epochs", "2", "--train-limit", "512", *extra, "--resume", str(path)],
                timeout=120)
    assert r.returncode != 0
    lines = error_lines(r.stderr)
    assert lines and str(path.name) in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
