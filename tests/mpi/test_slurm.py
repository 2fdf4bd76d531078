"""Slurm: the sbatch templates run end to end on a real one-machine Slurm cluster
(scripts/slurm-cluster.sh: Debian's slurm-wlm + munge, started in a temp folder).

The cluster test runs on rank 0 only and is skipped — on every rank alike — when this is not root or
the packages cannot be installed. All jobs are submitted at once and run side by side (the node
declares 22 CPUs: the 2 preemption jobs and your own script's job take 2, the 4 template jobs 4
each; under MPICH the GPU and PS templates' jobs are left out: ONE_MPI_JOBS).
Set HPCASYNC_SKIP_SLURM=1 to skip it. (The environment reader: tests/unit/test_slurm.py.)
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcasync.launch import OPEN_MPI
from tests.mpi_util import COMM, RANK, REPO, VENDOR, clean_env

CLUSTER = REPO / "scripts" / "slurm-cluster.sh"
LOCK = Path("/tmp/hpcasync-slurm-test.lock")        # one test cluster per machine at a time
CURRENT = Path("/tmp/hpcasync-slurm-test.state")    # its state dir, to stop an orphan one
# 22 CPUs declared on 2 cores: every job of the test runs at once (3 x 2 + 4 x 4 tasks; Slurm's
# scheduling waits overlap)
PORTS = {"SLURM_ONEBOX_CTLD_PORT": "16817", "SLURM_ONEBOX_SLURMD_PORT": "16818",
         "SLURM_ONEBOX_CPUS": "22"}
JOB_TIMEOUT = 240
POLL = 0.25          # s between two `scontrol show job` (~4 ms of CPU each); was 2 s: ~1 s lost a wait
SMALL = "--train-limit 2048 --test-limit 500"


def _skip_reason() -> str | None:
    if os.environ.get("HPCASYNC_SKIP_SLURM") == "1":
        return "HPCASYNC_SKIP_SLURM=1"
    if os.geteuid() != 0:
        return "the one-machine Slurm cluster needs root"
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        return "slurm-wlm is not installed and there is no apt-get to install it"
    return None


# Decided on rank 0 and shared, so every rank skips alike.
SKIP = COMM.bcast(_skip_reason() if RANK == 0 else None, root=0)


# --- the cluster ---------------------------------------------------------------------------------

def _run_cluster(action: str, state: Path, timeout: float) -> subprocess.CompletedProcess:
    """scripts/slurm-cluster.sh ACTION STATE, on this test's ports."""
    return subprocess.run(["bash", str(CLUSTER), action, str(state)], capture_output=True,
                          text=True, timeout=timeout, env=clean_env(**PORTS))


def _job_env(conf: Path, **extra: str) -> dict[str, str]:
    base = dict(SLURM_CONF=str(conf), HPCASYNC_REPO=str(REPO),
                HPCASYNC_PYTHON=os.environ.get("HPCASYNC_PYTHON", sys.executable),
                DATASET="fashion-mnist-mini", EPOCHS="1", EXTRA_ARGS=SMALL)
    return clean_env(**{**base, **extra})


# `hpcasync launch --max-restarts` inside the mpi-srun job: rank 2 dies at step 10 of 16; the
# restart is a new srun step resuming from the step-8 checkpoint (6 steps to go: no second kill).
# Open MPI only. Under MPICH (srun --mpi=pmi2) the restart itself works (attempt 2 resumes from
# the step-8 checkpoint), but after the kill slurmstepd once failed to end the other tasks ("Kill
# task failed"), which drains the one node, so the next job of this module never started; not
# understood yet. Under MPICH the restart is tested through mpiexec (test_restarts.py). (A killed
# MPICH rank also leaves its job step's shared-memory segment in /dev/shm, on which a later
# cluster's job with the same id hung in MPI_Init: hence scripts/slurm-cluster.sh's FirstJobId.)
RESTART = {"MAX_RESTARTS": "1", "HPCASYNC_INJECT_KILL_AT": "2:step:10",
           "EXTRA_ARGS": f"{SMALL} --checkpoint-every 4"} if VENDOR == OPEN_MPI else {}

# name -> (template, sbatch options, extra environment)
JOBS = {
    "mpi-srun": ("train-mpi.sbatch", ["-N", "1", "-n", "4", "--ntasks-per-node=4"],
                 {"LAUNCHER": "srun", **RESTART}),
    "mpi-mpirun": ("train-mpi.sbatch", ["-N", "1", "-n", "4", "--ntasks-per-node=4"],
                   {"LAUNCHER": "mpirun"}),
    "gpu-cpu-fallback": ("train-gpu.sbatch", ["--gpus-per-node=0", "--ntasks-per-node=4",
                                              "--cpus-per-task=1"], {}),
    "ps": ("train-ps.sbatch", ["-n", "4"], {}),
}


# A stand-in for `python -m hpcasync.cli train` that waits for SIGUSR1 and exits as a preempted
# run does (status 75); it marks itself ready once its trap is set. Option checks and
# `-m hpcasync.launch` (which MPI, the launcher's options) go to Python.
STUB = """#!/bin/bash
if [ "$1" = -c ] || [ "$2" = hpcasync.launch ]; then exec {python} "$@"; fi
rank=${{OMPI_COMM_WORLD_RANK:-${{PMI_RANK:-${{SLURM_PROCID:-0}}}}}}
n=${{OMPI_COMM_WORLD_SIZE:-${{PMI_SIZE:-${{SLURM_NTASKS:-1}}}}}}
# report, then wait (<= 5 s) until every rank has: the first rank to exit 75 ends the job
trap 'echo "rank $rank got USR1"; touch "{ready}/got-$rank"; for i in $(seq 50); do
      [ "$(ls "{ready}"/got-* 2>/dev/null | wc -l)" -ge "$n" ] && break; sleep 0.1; done; exit 75' USR1
touch "{ready}/ready-$rank"
for i in $(seq 2400); do sleep 0.1; done
echo "rank $rank: no signal"
"""
PREEMPT = {"preempt-srun": "srun", "preempt-mpirun": "mpirun"}

# your own script (examples/train_mnist_elastic.py, State.persist) under `SCRIPT=... sbatch
# train-mpi.sbatch` with MAX_RESTARTS=1 and srun, 2 ranks: rank 1 SIGKILLs itself after its 7th
# step of 12, `hpcasync launch --launcher srun` starts a second srun step, which goes on from
# commit 5.
# Open MPI only, as RESTART above.
SCRIPT_JOB = "own-loop-srun" if VENDOR == OPEN_MPI else None


# The GPU and PS templates launch as mpi-srun does (srun, the same MPI plugin): under MPICH, where
# the MPI library is what changes, their jobs are left out (marked one_mpi; not even submitted).
ONE_MPI_JOBS = ("gpu-cpu-fallback", "ps")
LEFT_OUT = ONE_MPI_JOBS if VENDOR != OPEN_MPI else ()      # the jobs this MPI does not run


def _submit_preempt_job(conf: Path, name: str, launcher: str, work: Path) -> str:
    stub, ready = work / "bin", work / "ready"
    stub.mkdir()
    ready.mkdir()
    (stub / "python").write_text(STUB.format(python=sys.executable, ready=ready))
    (stub / "python").chmod(0o755)
    (stub / "mpirun").symlink_to(Path(sys.executable).parent / "mpirun")
    sub = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={work}", f"--output={work}/slurm-%j.out",
         f"--job-name=t-{name}", "-N", "1", "-n", "2", "--ntasks-per-node=2",
         str(REPO / "slurm" / "train-mpi.sbatch")],
        env=_job_env(conf, RUN_DIR=str(work / "runs"), LAUNCHER=launcher, REQUEUE="0",
                     HPCASYNC_PYTHON=str(stub / "python")),
        capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, f"sbatch failed: {sub.stderr}"
    return sub.stdout.strip().split(";")[0]


def _asgd_available() -> bool:
    from hpcasync.runtime import algorithms

    return "asgd" in algorithms()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Rank 0: start a cluster and submit every job; yields the conf path and {name: (jobid,
    workdir)}. None on other ranks."""
    if RANK != 0 or SKIP:
        yield None
        return
    LOCK.touch(exist_ok=True)
    lock = open(LOCK, "w")
    deadline = time.time() + 300
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.time() > deadline:
                pytest.skip("another run's Slurm test cluster is still up after 300 s")
            time.sleep(2)
    state = tmp_path_factory.mktemp("slurm-state")
    try:
        if CURRENT.exists():                       # left behind by a run that was killed
            _run_cluster("stop", Path(CURRENT.read_text().strip()), 90)
        CURRENT.write_text(str(state))
        t0 = time.time()
        started = _run_cluster("start", state, 900)
        if started.returncode == 3:
            pytest.skip(started.stderr.strip().splitlines()[-1])
        assert started.returncode == 0, f"cluster did not start:\n{started.stderr}"
        print(f"\nslurm cluster up in {time.time() - t0:.1f} s", file=sys.stderr)
        conf = state / "slurm.conf"
        jobs = {}
        for name, launcher in PREEMPT.items():
            work = tmp_path_factory.mktemp(f"job-{name}")
            jobs[name] = (_submit_preempt_job(conf, name, launcher, work), work)
        if SCRIPT_JOB:
            work = tmp_path_factory.mktemp(f"job-{SCRIPT_JOB}")
            (work / "out").mkdir()
            args = (f"--limit 192 --epochs 2 --commit-every 2 --checkpoint-dir {work / 'ckpt'} "
                    f"--out {work / 'out'} --kill-rank 1 --kill-at 7")
            sub = subprocess.run(
                ["sbatch", "--parsable", f"--chdir={work}", f"--output={work}/slurm-%j.out",
                 f"--job-name=t-{SCRIPT_JOB}", "-N", "1", "-n", "2", "--ntasks-per-node=2",
                 str(REPO / "slurm" / "train-mpi.sbatch")],
                env=_job_env(conf, RUN_DIR=str(work / "runs"), LAUNCHER="srun", MAX_RESTARTS="1",
                             SCRIPT=str(REPO / "examples" / "train_mnist_elastic.py"),
                             EXTRA_ARGS=args),
                capture_output=True, text=True, timeout=30)
            assert sub.returncode == 0, f"sbatch of your own script failed: {sub.stderr}"
            jobs[SCRIPT_JOB] = (sub.stdout.strip().split(";")[0], work)
        for name, (template, options, extra) in JOBS.items():
            if name == "ps" and not _asgd_available():
                continue
            if name in LEFT_OUT:
                continue
            work = tmp_path_factory.mktemp(f"job-{name}")
            if "MAX_RESTARTS" in extra:
                extra = {**extra, "CHECKPOINT_DIR": str(work / "ckpt")}
            sub = subprocess.run(
                ["sbatch", "--parsable", f"--chdir={work}", f"--output={work}/slurm-%j.out",
                 f"--job-name=t-{name}", *options, str(REPO / "slurm" / template)],
                env=_job_env(conf, RUN_DIR=str(work / "runs"), **extra), capture_output=True,
                text=True, timeout=30)
            assert sub.returncode == 0, f"sbatch {template} failed: {sub.stderr}"
            jobs[name] = (sub.stdout.strip().split(";")[0], work)
        yield {"conf": conf, "jobs": jobs, "t0": time.time()}
    finally:
        stopped = _run_cluster("stop", state, 120)
        CURRENT.unlink(missing_ok=True)
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
        assert stopped.returncode == 0, f"cluster did not stop:\n{stopped.stderr}"


def _wait_job(conf: Path, jobid: str, deadline: float) -> dict[str, str]:
    env = clean_env(SLURM_CONF=str(conf))
    fields: dict[str, str] = {}
    while time.time() < deadline:
        out = subprocess.run(["scontrol", "show", "job", jobid], env=env, capture_output=True,
                             text=True, timeout=20).stdout
        fields = dict(re.findall(r"(\w+)=(\S*)", out))
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                      "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"):
            return fields
        time.sleep(POLL)
    subprocess.run(["scancel", jobid], env=env, timeout=20)
    raise AssertionError(f"job {jobid} still {fields.get('JobState')} after {JOB_TIMEOUT} s")


@pytest.mark.rank0
@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
@pytest.mark.parametrize("name", list(PREEMPT))
def test_preemption_warning_reaches_every_rank(cluster, name):
    """The batch shell's SIGUSR1 (what `#SBATCH --signal=B:USR1@60` sends) reaches every rank
    through srun and through mpirun, and status 75 (preempted) ends the job as 75 without requeue
    when REQUEUE=0."""
    if cluster is None:
        return
    jobid, work = cluster["jobs"][name]
    env = clean_env(SLURM_CONF=str(cluster["conf"]))
    deadline = time.time() + JOB_TIMEOUT
    while len(list((work / "ready").glob("ready-*"))) < 2:
        state = subprocess.run(["scontrol", "show", "job", jobid], env=env, capture_output=True,
                               text=True, timeout=20).stdout
        assert "JobState=RUNNING" in state or "JobState=PENDING" in state, state
        assert time.time() < deadline, "the stub ranks never became ready"
        time.sleep(POLL)
    sig = subprocess.run(["scancel", "--batch", "--signal=USR1", jobid], env=env,
                         capture_output=True, text=True, timeout=20)
    assert sig.returncode == 0, sig.stderr
    fields = _wait_job(cluster["conf"], jobid, deadline)
    text = (work / f"slurm-{jobid}.out").read_text(errors="replace")
    # each rank's trap leaves got-RANK (before any rank exits: each waits for all the files); the
    # printed lines are the launcher's forwarding, which a job ended by the first exit 75 may cut
    # (CI, 2026-12-03: mpirun's output had rank 0's line alone)
    got = sorted(p.name for p in (work / "ready").glob("got-*"))
    assert got == ["got-0", "got-1"], (got, text)
    assert re.search(r"rank \d got USR1", text), text
    assert "passing SIGUSR1 to the ranks" in text and "no signal" not in text
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "75:0", "0")


@pytest.mark.rank0
@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.one_mpi) if n in ONE_MPI_JOBS
                                  else n for n in JOBS])
def test_sbatch_template(cluster, name):
    if cluster is None:
        return
    if name in LEFT_OUT:
        pytest.skip("under MPICH this template launches as mpi-srun does (ONE_MPI_JOBS)")
    if name == "ps" and name not in cluster["jobs"]:
        pytest.xfail("the parameter-server runtime (--algorithm asgd) is not registered yet")
    jobid, work = cluster["jobs"][name]
    t_submit = cluster["t0"]
    fields = _wait_job(cluster["conf"], jobid, t_submit + JOB_TIMEOUT)
    log = next(work.glob("slurm-*.out"), None)
    text = log.read_text(errors="replace") if log else "(no job output)"
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), \
        f"job {jobid} ({name}): {fields.get('JobState')} {fields.get('ExitCode')}\n{text[-3000:]}"
    metrics = work / "runs" / f"hpcasync-{jobid}.jsonl"          # named after the job id
    assert metrics.exists(), f"no {metrics.name}: {sorted(p.name for p in work.rglob('*'))}"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    summaries = [r for r in records if r["event"] == "summary"]
    config = next(r for r in records if r["event"] == "config")
    assert len(summaries) == 1 and config["world_size"] == 4
    summary = summaries[0]
    if name == "ps":
        assert summary["algorithm"] == "asgd"
        assert summary["world_size"] == 4 and summary.get("num_workers", 3) == 3, summary
    else:
        assert summary["world_size"] == 4 and summary["algorithm"] == "ssgd"
        # 16 SSGD steps (2048 images, batch 32 x 4): 40.6 / 35.8 / 46.4 % on the 500 test images
        # at seeds 0 / 1 / 2 (deterministic; plain mpiexec, same arguments); bar: worst - 4 points
        assert summary["test_accuracy"] >= 0.31 and summary["epochs"] == 1, summary
    launcher = JOBS[name][2].get("LAUNCHER", "srun")
    if VENDOR == OPEN_MPI:
        expected = "srun --mpi=pmix" if launcher == "srun" else "mpirun --oversubscribe -n 4"
    else:                            # MPICH: PMI-2 under srun; hydra oversubscribes by itself
        expected = "srun --mpi=pmi2" if launcher == "srun" else "mpirun -n 4"
    assert expected in text, text[-2000:]
    if "MAX_RESTARTS" in JOBS[name][2]:          # one restart, as a second srun step
        assert re.search(r"hpcasync launch: restart 1 of 1: rank 2 died .* resuming from \S+"
                         r"ckpt-e0001-s00000008\.pt", text), text[-3000:]
        assert text.count(f"attempt 2: {expected}") == 1, text[-3000:]
        assert [r["event"] for r in records][:2] == ["config", "resume"]
    print(f"\n{name}: job {jobid} done {time.time() - t_submit:.0f} s after submission",
          file=sys.stderr)


@pytest.mark.rank0
@pytest.mark.skipif(SKIP is not None or SCRIPT_JOB is None,
                    reason=str(SKIP or "srun restarts are tested under Open MPI"))
def test_your_own_script_under_srun_is_restarted_from_its_last_commit(cluster):
    """``SCRIPT=examples/train_mnist_elastic.py MAX_RESTARTS=1 sbatch slurm/train-mpi.sbatch``:
    the template runs ``hpcasync launch --launcher srun -- SCRIPT ARGS`` on 2 ranks; rank 1's
    death ends the first srun step, a second step runs the script again and every rank goes on
    from the newest commit written (commit 5, 6 steps), ending with 12 steps and one model."""
    if cluster is None:
        return
    jobid, work = cluster["jobs"][SCRIPT_JOB]
    fields = _wait_job(cluster["conf"], jobid, cluster["t0"] + JOB_TIMEOUT)
    log = next(work.glob("slurm-*.out"), None)
    text = log.read_text(errors="replace") if log else "(no job output)"
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), \
        f"job {jobid}: {fields.get('JobState')} {fields.get('ExitCode')}\n{text[-3000:]}"
    assert "--launcher srun --max-restarts 1 -- " in text and "train_mnist_elastic.py" in text
    assert re.search(r"hpcasync launch: restart 1 of 1: rank 1 died .*the script resumes from "
                     r"its own checkpoints", text), text[-3000:]
    assert text.count("attempt 2: srun --mpi=pmix") == 1, text[-3000:]
    assert re.search(r"resuming from \S+ckpt-e0001-s00000005\.pt \(commit 5", text), text[-3000:]
    got = [json.loads((work / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [g["restored"] for g in got] == [6] * 2 and [g["steps"] for g in got] == [12] * 2
    assert len({g["params"] for g in got}) == 1
