"""A worker process dies in an asynchronous (parameter-server) run: real jobs, real SIGKILLs.

Under ``mpirun --with-ft ulfm`` (Open MPI's ULFM) the PS retires the dead worker and the others
train on: exit 0, the summary names the dead worker, its pushes stop where it died, the rule's
per-worker state for it is gone, and a full Fashion-MNIST run still reaches 80 %. Without ULFM the
launcher ends the job: non-zero within a minute, a checkpoint written at the PS's SIGTERM and a
logged command that resumes it (which the test runs). Without ULFM the PS's own death ends the
job non-zero.

ULFM is Open-MPI-only: under MPICH its tests skip ("ULFM needs Open MPI"), fault tolerance asked
for is a one-line error, and a dead worker ends the job at once (hydra SIGKILLs every rank, no
SIGTERM first): the resume point is the last epoch's checkpoint.

Kills: ``HPCASYNC_INJECT_KILL=RANK:N`` (that rank SIGKILLs itself at its N-th push, after the
gradient was written and before the header: an in-flight push), and once from outside by pid.
Every job runs under a timeout.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcasync.checkpoint import latest_checkpoint, read_checkpoint
from hpcasync.metrics import read_metrics
from hpcasync.launch import OPEN_MPI
from tests.mpi_util import REPO, VENDOR, clean_env, last_summary, mpiexec, need_ulfm, wait_for

FULL = ["train", "--dataset", "fashion-mnist", "--model", "lenet", "--epochs", "2",
        "--progress", "off"]
MINI = ["train", "--dataset", "fashion-mnist-mini", "--train-limit", "2048", "--test-limit", "500",
        "--epochs", "2", "--progress", "off"]
FULL_BUDGET = 2 * (60000 // 3 // 32)          # pushes per worker: 2 epochs x 625 batches
MINI_BUDGET = 2 * (2048 // 3 // 32)           # 2 epochs x 21 batches
JOB_TIMEOUT = 240


def _launch(args, *, ft=True, env=None, timeout=JOB_TIMEOUT) -> tuple[subprocess.CompletedProcess,
                                                                     float]:
    cmd = [*mpiexec(4, ft=ft), sys.executable, "-m", "hpcasync.cli", *args]
    t0 = time.time()
    out = subprocess.run(cmd, env=clean_env(**(env or {})), cwd=REPO, capture_output=True,
                         text=True, timeout=timeout)
    return out, time.time() - t0


def _check_survived(path: Path, *, dead: int, pushes: int, budget: int) -> dict:
    """Exact properties of a run that lost worker ``dead`` after ``pushes`` answered pushes."""
    s = last_summary(path)
    assert s["fault_tolerance"] == "ulfm"
    [failed] = s["failed_workers"]
    assert (failed["worker"], failed["rank"], failed["pushes"]) == (dead, dead + 1, pushes)
    assert not failed["finished"] and 0 < failed["ps_version"] < s["pushes"]
    want = [budget] * 3
    want[dead] = pushes                                   # its pushes stop where it died
    assert s["pushes_per_worker"] == want and s["rejected_pushes"] == 0
    assert s["pushes"] == sum(want)
    assert sorted(w["worker"] for w in s["workers"]) == sorted({0, 1, 2} - {dead})
    assert all(w["worker_steps"] == budget for w in s["workers"])
    alive = [w != dead for w in range(3)]
    assert s["rule_workers"]["alive"] == alive and s["rule_workers"]["active"] == 2
    records = read_metrics(path)
    [event] = [r for r in records if r["event"] == "worker_failed"]
    assert event["worker"] == dead and event["ps_version"] == failed["ps_version"]
    epochs = [r for r in records if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert sum(r["pushes"] for r in epochs) == s["pushes"]      # every accepted push counted once
    assert sum(r["pushes_per_worker"][dead] for r in epochs) == pushes
    return s


@pytest.mark.rank0
def test_asgd_survives_a_worker_sigkilled_mid_run_with_80_percent(tmp_path):
    """The done-bar: 4 ranks (PS + 3 workers), asgd, full Fashion-MNIST, worker 2 (rank 3)
    SIGKILLs itself in the middle of its 600th push (of 1250)."""
    need_ulfm()
    metrics = tmp_path / "m.jsonl"
    out, _ = _launch([*FULL, "--algorithm", "asgd", "--metrics", str(metrics)],
                     env={"HPCASYNC_INJECT_KILL": "3:600"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"worker 2 \(rank 3\) died at PS version \d+; continuing with 2 workers",
                     out.stderr)
    s = _check_survived(metrics, dead=2, pushes=599, budget=FULL_BUDGET)
    assert s["test_accuracy"] >= 0.80, s["test_accuracy"]


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def _pid_of_rank(job_pid: int, rank: int) -> int:
    for pid in _descendants(job_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no process of rank {rank} under {job_pid}")


@pytest.mark.rank0
def test_dcasgd_survives_a_worker_killed_from_outside_and_drops_its_backup(tmp_path):
    """dcasgd-a, full Fashion-MNIST: rank 2 (worker 1) is SIGKILLed by pid once a third of the
    pushes are in; its DC-ASGD backup goes (``dc_backups``), the run still reaches 80 %."""
    need_ulfm()
    metrics = tmp_path / "m.jsonl"
    partial = Path(str(metrics) + ".partial")
    cmd = [*mpiexec(4, ft=True), sys.executable, "-m", "hpcasync.cli", *FULL, "--algorithm",
           "dcasgd-a", "--metrics", str(metrics), "--log-every", "100"]
    job = subprocess.Popen(cmd, env=clean_env(), cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        def pushes() -> int:
            if not partial.exists():
                return 0
            recs = [json.loads(x) for x in partial.read_text().splitlines() if '"push"' in x]
            return max((r["push"] for r in recs if r["event"] == "push"), default=0)
        wait_for(lambda: pushes() >= 1200, 180, "1200 accepted pushes")
        os.kill(_pid_of_rank(job.pid, 2), signal.SIGKILL)
        _, err = job.communicate(timeout=JOB_TIMEOUT)
    finally:
        job.kill()
    assert job.returncode == 0, err[-3000:]
    s = last_summary(metrics)
    [failed] = s["failed_workers"]
    assert (failed["worker"], failed["rank"]) == (1, 2) and failed["pushes"] < FULL_BUDGET
    _check_survived(metrics, dead=1, pushes=failed["pushes"], budget=FULL_BUDGET)
    assert s["rule_workers"]["dc_backups"] == [0, 2]                # retired: backup dropped
    assert s["test_accuracy"] >= 0.80, s["test_accuracy"]


@pytest.mark.rank0
@pytest.mark.parametrize("algorithm,transport", [("smega2", "p2p"), ("shat", "rma-put")])
def test_rule_state_of_the_dead_worker_is_retired(tmp_path, algorithm, transport):
    """SMEGA2's cycle length N drops to 2, SHAT's count of the dead worker is 0 and no longer grows
    (mini data set). On p2p the kill falls between the push's header and its gradient: dropped."""
    need_ulfm()
    metrics = tmp_path / "m.jsonl"
    out, _ = _launch([*MINI, "--algorithm", algorithm, "--ps-transport", transport,
                      "--metrics", str(metrics)], env={"HPCASYNC_INJECT_KILL": "2:20"})
    assert out.returncode == 0, out.stderr[-3000:]
    s = _check_survived(metrics, dead=1, pushes=19, budget=MINI_BUDGET)
    rw = s["rule_workers"]
    if algorithm == "smega2":
        assert rw["smega2_n"] == 2
    else:
        assert rw["shat_counts"][1] == 0
        assert rw["shat_counts"][0] + rw["shat_counts"][2] > 0


@pytest.mark.rank0
def test_a_worker_dead_at_its_first_push_is_retired_with_none_answered(tmp_path):
    """Worker 1 (rank 2) dies at its first push (its gradient written, before the header): the
    server retires it with 0 pushes answered, the other two push their whole budget."""
    need_ulfm()
    metrics = tmp_path / "m.jsonl"
    out, _ = _launch([*MINI, "--algorithm", "asgd", "--metrics", str(metrics)],
                     env={"HPCASYNC_INJECT_KILL": "2:1"})
    assert out.returncode == 0, out.stderr[-3000:]
    s = last_summary(metrics)
    [failed] = s["failed_workers"]
    assert (failed["worker"], failed["rank"], failed["pushes"]) == (1, 2, 0), failed
    assert s["pushes_per_worker"] == [MINI_BUDGET, 0, MINI_BUDGET], s["pushes_per_worker"]
    assert sorted(w["worker"] for w in s["workers"]) == [0, 2]
    assert all(w["worker_steps"] == MINI_BUDGET for w in s["workers"]), s["workers"]
    assert s["rule_workers"]["alive"] == [True, False, True]


@pytest.mark.rank0
def test_without_ulfm_the_job_ends_nonzero_with_a_checkpoint_and_the_resume_works(tmp_path):
    """Open MPI: the launcher SIGTERMs the survivors first, the PS writes a checkpoint at the death
    and logs the command that resumes it (run here). MPICH: hydra SIGKILLs at once, so the resume
    point is the newest periodic (or epoch) checkpoint (``--resume auto`` finds it). Periodic
    ones make that point certain: the dying worker's 29 answered pushes mean the PS accepted 29
    or more, so the checkpoint at push 24 was written (epoch 1's end, push 63, need not be: one
    worker can run far ahead of the others on a loaded machine)."""
    ckpt = tmp_path / "ckpt"
    args = [*MINI, "--algorithm", "asgd", "--checkpoint-dir", str(ckpt)]
    if VENDOR != OPEN_MPI:
        args += ["--checkpoint-every", "12"]
    out, took = _launch([*args, "--metrics", str(tmp_path / "a.jsonl")], ft=False,
                        env={"HPCASYNC_INJECT_KILL": "3:30"}, timeout=120)
    assert out.returncode != 0 and took < 60, (out.returncode, took, out.stderr[-3000:])
    assert "fault tolerance: none" in out.stderr
    m = re.search(r"wrote checkpoint (\S+); if the job ends now, resume with:\n\s+(.+)\n",
                  out.stderr)
    if VENDOR == OPEN_MPI:
        assert m, out.stderr[-3000:]
        path, command = Path(m.group(1)), shlex.split(m.group(2))
        assert command[:5] == ["mpirun", "--with-ft", "ulfm", "-n", "4"] and "--resume" in command
        assert command[command.index("--resume") + 1] == "auto"
        kind, program = "signal", command[5:]
    else:
        assert m is None, out.stderr[-3000:]       # SIGKILLed: the PS had no chance
        path = latest_checkpoint(ckpt)
        assert path is not None, sorted(p.name for p in ckpt.iterdir())
        kind, program = "saved", [sys.executable, "-m", "hpcasync", *args, "--metrics", "x",
                                  "--resume", "auto"]
    header, state = read_checkpoint(path, expect={"algorithm": "asgd", "world_size": 4})
    assert path.parent == ckpt
    positions = state["ps"]["positions"]
    if kind == "signal":
        assert state["kind"] == "signal"
        assert positions[2] == 29              # worker 2 died in its 30th push: 29 answered
    else:                                      # pushes split as they came in
        total = sum(positions)
        assert ((state["kind"] == "periodic" and total % 12 == 0)
                or (state["kind"] == "epoch" and total == 3 * (MINI_BUDGET // 2))), (state["kind"],
                                                                                     total)
        assert total >= 24 and positions[2] <= 29
    assert header["step"] == state["ps"]["stats"]["accepted"] == sum(positions)
    # run the resume command (this venv's launcher, ULFM where there is one; a new metrics file)
    resumed = [*mpiexec(4, ft=VENDOR == OPEN_MPI), *program]
    resumed[resumed.index("--metrics") + 1] = str(tmp_path / "b.jsonl")
    done = subprocess.run(resumed, env=clean_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    s = last_summary(tmp_path / "b.jsonl")
    assert s["resumed_at_push"] == sum(positions)
    assert s["pushes_per_worker"] == [MINI_BUDGET] * 3 and s["failed_workers"] == []
    assert sorted(w["worker_start_step"] for w in s["workers"]) == sorted(positions)


@pytest.mark.rank0
def test_the_parameter_server_dying_without_ulfm_ends_the_job_nonzero_fast(tmp_path):
    """Without ULFM the launcher ends the job (under ULFM a worker takes over: one server rank,
    ``test_server_takeover.py``; a shard server, ``test_takeover_rebuild.py``)."""
    out, took = _launch([*MINI, "--algorithm", "asgd"], ft=False,
                        env={"HPCASYNC_INJECT_KILL": "0:50"}, timeout=120)
    assert out.returncode != 0 and took < 60, (out.returncode, took, out.stderr[-3000:])


@pytest.mark.rank0
@pytest.mark.parametrize("kill", ["1:29", "3:45", "2:60"])
def test_own_loop_server_ends_with_one_line_after_a_worker_death_under_ulfm(tmp_path, kill):
    """A user's loop with a PS rule (examples/train_mnist.py) under ULFM, without hpcasync.elastic:
    the server retires the killed worker, and the script's next collective over the dead rank
    ends the job with one line — never a hang. It hung in 4-6 of 10 draws while the server's
    checkpoint collector probed for requests from any worker (Open MPI 5.0.11: the server's receive
    of pushes from any worker then kept failing with MPI_ERR_PROC_FAILED_PENDING); the requests are
    now counted in each push header and received from that worker alone."""
    need_ulfm()
    log = tmp_path / "kills"
    cmd = [*mpiexec(4, ft=True), sys.executable, "examples/train_mnist.py", "--algorithm", "asgd",
           "--epochs", "1", "--train-limit", "6000"]
    try:
        out = subprocess.run(cmd, env=clean_env(HPCASYNC_INJECT_KILL=kill,
                                                HPCASYNC_INJECT_KILL_LOG=str(log)),
                             cwd=REPO, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the job ran past 90 s (a hang): {str(exc.stderr)[-2000:]}")
    ended = time.time()
    killed_at = float(log.read_text().split()[3])
    assert ended - killed_at < 30, f"the job ended {ended - killed_at:.1f} s after the death"
    assert "retired" in out.stderr, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if "hpcasync: error" in ln]
    assert out.returncode != 0 and len(lines) == 1 and "died" in lines[0], out.stderr[-3000:]
