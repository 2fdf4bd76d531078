"""``hpcasync launch --max-restarts``: where ULFM is absent (MPICH; Open MPI without ``--with-ft``)
a rank SIGKILLed from outside ends the job, and the supervisor restarts it from the newest
checkpoint without a person; the finished run is bitwise the undisturbed one (SSGD resumes
bitwise). A failure that is not a death (bad input found once MPI runs) is not restarted.
(The decision rules alone: tests/unit/test_supervisor.py.)
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from hpcasync.metrics import read_metrics
from tests.mpi_util import REPO, clean_env, last_summary, run_mpi, wait_for

ARGS = ["--algorithm", "ssgd", "--dataset", "fashion-mnist-mini", "--train-limit", "512",
        "--test-limit", "100", "--epochs", "2", "--progress", "off", "--seed", "5",
        "--push-delay", "60"]                # 8 steps an epoch on 2 ranks, >= 60 ms each
TAG = "HPCASYNC_TEST_RESTART_JOB"


def _launch(tmp_path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hpcasync.cli", "launch", *args],
                            env=clean_env(**{TAG: str(tmp_path)}), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _rank_pid(tag: str, rank: int) -> int | None:
    """The pid of rank ``rank`` of ``hpcasync train`` started with ``TAG=tag`` (/proc)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                cmd = fh.read().split(b"\0")
            if b"hpcasync.cli" not in cmd or b"train" not in cmd:
                continue
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = dict(v.split(b"=", 1) for v in fh.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        mine = env.get(TAG.encode()) == tag.encode()
        r = env.get(b"OMPI_COMM_WORLD_RANK", env.get(b"PMI_RANK"))
        if mine and r == str(rank).encode():
            return int(name)
    return None


def _end(job: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return job.communicate(timeout=timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


@pytest.mark.rank0
def test_a_sigkilled_rank_is_restarted_from_the_checkpoint_bitwise(tmp_path):
    ref = run_mpi(2, ["train", *ARGS, "--metrics", str(tmp_path / "ref.jsonl")], timeout=120)
    assert ref.returncode == 0, ref.stderr[-2000:]
    want = last_summary(tmp_path / "ref.jsonl")

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "run.jsonl"
    ckpt.mkdir()
    job = _launch(tmp_path, "-n", "2", "--max-restarts", "1", "--", "train", *ARGS,
                  "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--metrics",
                  str(metrics))
    try:
        # the step-4 checkpoint is written: kill rank 1 (12 steps, >= 0.7 s, still to go)
        wait_for(lambda: any(int(p.name[12:20]) >= 4 for p in ckpt.glob("ckpt-e*-s*.pt")), 120,
                 "the step-4 checkpoint", poll=0.02)
        pid = _rank_pid(str(tmp_path), 1)
        assert pid is not None, "rank 1 not found"
        os.kill(pid, signal.SIGKILL)
        t_kill = time.time()
        out, err = _end(job, 150)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    wall = time.time() - t_kill
    assert job.returncode == 0, err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("hpcasync launch: restart 1 of 1:")]
    resumed = re.search(r"resuming from (\S+ckpt-e\d+-s(\d+)\.pt)$", line)
    assert resumed and int(resumed.group(2)) >= 4, line
    assert "rank 1 died" in line, line                # Open MPI: its line; MPICH: by the pid
    lost = re.search(r"restart 1: training resumed ([\d.]+) s after", err)
    assert lost, err[-3000:]
    assert "finished after 1 restart(s)" in err
    assert (tmp_path / "run.jsonl.attempt-1.partial").exists()   # the first attempt's stream
    records = read_metrics(metrics)                  # the last attempt's stream
    assert (records[1]["event"], records[1]["path"]) == ("resume", resumed.group(1))
    got = last_summary(metrics)
    assert got["steps"] == want["steps"] == 16
    assert got["params_sha256"] == want["params_sha256"]         # as if never killed
    print(f"\nkill -> finished {wall:.1f} s; time lost to the restart {lost.group(1)} s",
          file=sys.stderr)


@pytest.mark.rank0
@pytest.mark.one_mpi
def test_bad_input_found_under_mpi_is_not_restarted(tmp_path):
    """2 ranks cannot make virtual nodes of 3: every rank stops on a TopologyError (exit 2) after
    MPI started; the supervisor says why it does not restart and exits with the job's status.
    (The marks decide, not the MPI: one pass is enough.)"""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    job = _launch(tmp_path, "-n", "2", "--max-restarts", "3", "--", "train", *ARGS,
                  "--checkpoint-dir", str(ckpt), "--ranks-per-node", "3")
    out, err = _end(job, 120)
    assert job.returncode == 2, err[-3000:]
    assert "restart 1" not in err
    said = [x for x in err.splitlines() if x.startswith("hpcasync launch:")]
    assert len(said) == 2 and said[0].startswith("hpcasync launch: attempt 1: "), said
    line = said[1]                      # after the one attempt's command: why it stops
    assert re.match(r"hpcasync launch: rank 0 stopped on an error, not a death: not restarting "
                    r"\(status 2\): TopologyError: 2 ranks .* virtual nodes of 3", line), line
