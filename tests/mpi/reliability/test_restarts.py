"""``hpcasync launch --max-restarts``: where ULFM is absent (MPICH; Open MPI without ``--with-ft``)
a rank SIGKILLed from outside ends the job, and the supervisor restarts it from the newest
checkpoint without a person; the finished run is bitwise the undisturbed one (SSGD resumes
bitwise). A failure that is not a death (bad input found once MPI runs) is not restarted.
(The decision rules alone: tests/unit/test_supervisor.py.)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hpcasync.metrics import read_metrics
from hpcasync.launch import OPEN_MPI
from tests.mpi_util import REPO, VENDOR, clean_env, last_summary, mpiexec, run_mpi, wait_for

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


SCRIPT = str(REPO / "examples" / "train_mnist_elastic.py")
LOOP = ["--limit", "384", "--batch-size", "16", "--epochs", "2", "--commit-every", "2"]


def _ranks(folder, n: int = 4) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(n)]


@pytest.mark.rank0
@pytest.mark.parametrize("algorithm", [
    "ssgd", *(pytest.param(a, marks=pytest.mark.one_mpi)
              for a in ("daso", "odsgd", "localsgd", "asgd"))])
def test_your_own_loop_is_restarted_from_its_last_persisted_commit(algorithm, tmp_path):
    """Your own loop without ULFM (examples/train_mnist_elastic.py, ``State.persist``): rank 2
    SIGKILLs itself after its 7th step (a commit every 2 steps and at each epoch's end); the
    launcher ends the job, ``hpcasync launch`` runs the script again, and every rank goes on from
    the newest commit written. Synchronous (6 steps an epoch): the 5th commit (6 steps, the
    first epoch's end), then the other 6 steps, bitwise as the undisturbed run: SSGD from rank
    0's commit, OD-SGD (each rank's local weights its own) and local SGD (H = 2: rank 0 runs
    ahead and wrote commit 6, which the dead rank never did) from each rank's own. DASO (2 nodes of
    2; the first epoch cycles, the second blocks) dies after its 5th step instead: its commit at
    step 4 is inside the cycling epoch, each rank's own (its node's global messages in flight
    recorded), and it too ends bitwise. A parameter server (8 steps a worker's epoch): the
    server wrote commit c once every worker had asked for it (c = 3, or 2 if a worker's request
    came after the death): each worker goes on from its own commit c (2c steps), the server from
    θ and its clock, and every rank ends with the served model; the same folder on 3 ranks is a
    one-line error (the rule's per-worker state is for 3 workers). (The ssgd case runs under every
    MPI; the others' launch and restart are its.)"""
    ps, daso = algorithm == "asgd", algorithm == "daso"
    extra = ["--algorithm", algorithm] + (["--ranks-per-node", "2"] if algorithm == "daso"
                                          else [])
    ref_dir, run_dir, ckpt = tmp_path / "ref", tmp_path / "run", tmp_path / "ckpt"
    ref_dir.mkdir(), run_dir.mkdir()
    bitwise = not ps
    if bitwise:
        ref = subprocess.run([*mpiexec(4), sys.executable, SCRIPT, *LOOP, *extra, "--out",
                              str(ref_dir)], env=clean_env(), cwd=REPO, capture_output=True,
                             text=True, timeout=120)
        assert ref.returncode == 0, ref.stderr[-2000:]
    job = _launch(tmp_path, "-n", "4", "--max-restarts", "1", "--", SCRIPT, *LOOP, *extra,
                  "--checkpoint-dir", str(ckpt), "--out", str(run_dir), "--kill-rank", "2",
                  "--kill-at", "5" if daso else "7")
    out, err = _end(job, 200)
    assert job.returncode == 0, err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("hpcasync launch: restart 1 of 1:")]
    assert "the script resumes from its own checkpoints" in line, line
    # Open MPI's launcher names the rank that died; MPICH's hydra names one PID of the ranks it
    # saw end badly, after it SIGKILLed the others too (a CI run named rank 1 for rank 2)
    named = r"rank 2 died" if VENDOR == OPEN_MPI else r"rank [0-3] died"
    assert re.search(named, line), line

    assert "finished after 1 restart(s)" in err
    resumed = re.search(r"resuming from \S+ckpt-e000(\d)-s0000000(\d)\.pt \(commit (\d)", err)
    assert resumed, err[-3000:]
    got = _ranks(run_dir)
    assert len({g["params"] for g in got}) == 1               # one model on every rank
    if ps:
        c = int(resumed.group(3))
        assert c in (2, 3) and resumed.group(2) == str(c), resumed.group(0)
        workers = got[1:]
        assert [g["restored"] for g in workers] == [2 * c] * 3, got
        assert [g["executed"] for g in workers] == [16 - 2 * c] * 3        # this attempt's
        assert [g["steps"] for g in workers] == [16] * 3
        assert got[0]["served"] >= 48 - 6 * c                 # (pushes after a request: again)
        # the same folder on 3 ranks (2 workers): the rule's per-worker state is for 3, so the
        # start is one line naming both counts, not a run that deals 3 workers' state to 2
        again = subprocess.run([*mpiexec(3), sys.executable, SCRIPT, *LOOP, *extra,
                                "--checkpoint-dir", str(ckpt)], env=clean_env(), cwd=REPO,
                               capture_output=True, text=True, timeout=120)
        said = [x for x in again.stderr.splitlines() if x.startswith("hpcasync: error")]
        assert again.returncode != 0 and len(said) == 1, again.stderr[-3000:]
        assert "rule state is for 3 workers, this run has 2" in said[0], said
        return
    at = 4 if daso else 6                                    # (DASO: inside its cycling epoch)
    assert resumed.group(1, 2, 3) == (("0", "2", "2") if daso else ("1", "5", "5")), resumed[0]
    assert [g["restored"] for g in got] == [at] * 4           # the commit loaded
    assert [g["executed"] for g in got] == [12 - at] * 4      # (this attempt's steps)
    assert [g["steps"] for g in got] == [12] * 4
    if bitwise:
        assert got[0]["params"] == _ranks(ref_dir)[0]["params"]      # as if never killed


@pytest.mark.rank0
@pytest.mark.one_mpi
def test_a_daso_restart_without_every_ranks_own_commit_goes_on_from_rank_0s(tmp_path):
    """DASO killed after its 5th step (its newest commit, at step 4, inside the cycling epoch),
    then one rank's own files of it removed: the job started again loads rank 0's commit on
    every rank (said in one line), drops the global messages in flight (rank 0's node's), and
    ends with one model on every rank."""
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run_dir.mkdir()
    args = [sys.executable, SCRIPT, *LOOP, "--algorithm", "daso", "--ranks-per-node", "2",
            "--checkpoint-dir", str(ckpt), "--out", str(run_dir)]
    first = subprocess.run([*mpiexec(4), *args, "--kill-rank", "2", "--kill-at", "5"],
                           env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert first.returncode != 0
    own = ckpt / "rank-3"
    assert (own / "ckpt-e0000-s00000002.pt").is_file(), sorted(map(str, ckpt.rglob("*.pt")))
    shutil.rmtree(own)
    again = subprocess.run([*mpiexec(4), *args], env=clean_env(HPCASYNC_RESTART_COUNT="1"),
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    said = (r"no commit in \S+ of which every rank holds its own intact file: every rank goes on "
            r"from rank 0's newest, ckpt-e0000-s00000002\.pt")
    assert re.search(said, again.stderr), again.stderr[-3000:]
    got = _ranks(run_dir)
    assert [g["restored"] for g in got] == [4] * 4 and [g["steps"] for g in got] == [12] * 4
    assert len({g["params"] for g in got}) == 1


@pytest.mark.rank0
@pytest.mark.one_mpi
def test_a_horovod_elastic_script_is_restarted_from_its_last_persisted_commit_bitwise(tmp_path):
    """``hvd.elastic.TorchState.persist`` (the same core as your own loop's State): a Horovod
    elastic script (tests/horovod_elastic_script.py, SSGD, a commit every 2 steps) whose rank 2
    SIGKILLs itself after 3 steps is run again by ``hpcasync launch`` and goes on from rank 0's
    commit at step 2, bitwise as the undisturbed run. (The launch paths under every MPI: the
    test above's ssgd case.)"""
    script = str(REPO / "tests" / "horovod_elastic_script.py")
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = subprocess.run([*mpiexec(4), sys.executable, script, "--out", str(ref_dir)],
                         env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr[-2000:]
    job = _launch(tmp_path, "-n", "4", "--max-restarts", "1", "--", script, "--out",
                  str(run_dir), "--checkpoint-dir", str(tmp_path / "ckpt"), "--kill-rank", "2",
                  "--kill-at", "3")
    out, err = _end(job, 200)
    assert job.returncode == 0, err[-3000:]
    assert "finished after 1 restart(s)" in err and re.search(
        r"resuming from \S+ckpt-e0000-s00000001\.pt \(commit 1", err), err[-3000:]
    got, want = _ranks(run_dir), _ranks(ref_dir)
    assert [g["restored"] for g in got] == [2] * 4 and [g["executed"] for g in got] == [10] * 4
    assert [g["steps"] for g in got] == [w["steps"] for w in want] == [12] * 4
    assert {g["params"] for g in got} == {want[0]["params"]}        # as if never killed


@pytest.mark.rank0
@pytest.mark.one_mpi
def test_your_own_loop_with_shard_servers_is_restarted_from_every_servers_commit(tmp_path):
    """Shard servers (``--ps-ranks 2``: servers 0 and 1, workers 2 and 3, 12 steps a worker's
    epoch) under ``State.persist``: each server writes its own file of a commit once every
    worker asked for it (shard 1's under ``shard-1/``); rank 2 SIGKILLs itself after its 7th
    step, ``hpcasync launch`` runs the script again, and every server goes on from its own file
    of the newest commit both wrote, each worker from its own commit c (2c steps); every rank
    ends with the served model. (Planted: every server reading shard 0's file fails here.)"""
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run_dir.mkdir()
    job = _launch(tmp_path, "-n", "4", "--max-restarts", "1", "--", SCRIPT, *LOOP,
                  "--algorithm", "asgd", "--ps-ranks", "2", "--checkpoint-dir", str(ckpt),
                  "--out", str(run_dir), "--kill-rank", "2", "--kill-at", "7")
    out, err = _end(job, 200)
    assert job.returncode == 0, err[-3000:]
    assert "finished after 1 restart(s)" in err
    resumed = re.search(r"resuming from \S+ckpt-e0000-s0000000(\d)\.pt \(commit (\d)", err)
    assert resumed, err[-3000:]
    c = int(resumed.group(2))
    assert c in (2, 3) and resumed.group(1) == str(c), resumed.group(0)
    assert list((ckpt / "shard-1").glob("ckpt-e*.pt")), sorted(map(str, ckpt.rglob("*.pt")))
    got = _ranks(run_dir)
    assert len({g["params"] for g in got}) == 1               # one model on every rank
    workers = got[2:]
    assert [g["restored"] for g in workers] == [2 * c] * 2, got
    assert [g["executed"] for g in workers] == [24 - 2 * c] * 2
    assert [g["steps"] for g in workers] == [24] * 2
