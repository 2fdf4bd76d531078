"""``hpcasync launch``'s decisions without a job: which failures are restarted, the dead rank read
from a launcher's line, the restart's arguments and launcher command, the marks a failing rank
leaves (hpcasync.errors.fail_fast) and the refusals before anything starts.
(A real SIGKILL under mpiexec: tests/mpi/reliability/test_restarts.py.)"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from hpcasync.errors import ConfigError
from hpcasync.supervisor import (Outcome, Supervisor, dead_ranks, decide, job_command, resume_args,
                                 script_program)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_death_is_restarted_while_restarts_remain():
    died = Outcome(137, started=4, dead=[2])
    assert decide(died, 0, 2) == (True, "rank 2 died (status 137)")
    assert decide(died, 1, 2)[0]
    again, why = decide(died, 2, 2)
    assert not again and "--max-restarts 2 restart(s) are used up: giving up" in why
    # survivors that saw the death as an MPI error are still a death; nothing named: "a rank"
    mpi = Outcome(9, {0: {"kind": "mpi", "message": "Exception: MPI_ERR_OTHER"}}, started=2)
    assert decide(mpi, 0, 1) == (True, "a rank died (status 9)")


@pytest.mark.parametrize("kind, words", [("error", "stopped on an error"),
                                         ("crash", "crashed (a Python exception)"),
                                         ("interrupt", "was interrupted")])
def test_a_rank_that_stopped_on_purpose_is_not_restarted(kind, words):
    out = Outcome(2, {3: {"kind": "mpi"}, 1: {"kind": kind, "message": "TopologyError: x"}},
                  started=4)
    again, why = decide(out, 0, 5)
    assert not again
    assert why == f"rank 1 {words}, not a death: not restarting (status 2): TopologyError: x"


def test_success_signals_preemption_and_launcher_failures_are_not_restarted():
    assert decide(Outcome(0, started=4), 0, 3) == (False, "the job finished")
    again, why = decide(Outcome(143, started=4, signalled=signal.SIGTERM), 0, 3)
    assert not again and why.startswith("stopped by SIGTERM (forwarded to the job)")
    again, why = decide(Outcome(75, started=4), 0, 3)
    assert not again and "preemption (status 75)" in why
    again, why = decide(Outcome(1, started=0), 0, 3)
    assert not again and "before any rank started" in why
    # a rank killed in its start-up (imports), before it left its pid: the launcher names it
    again, why = decide(Outcome(137, started=0, dead=[3]), 0, 3)
    assert again and why == "rank 3 died (status 137)"


def test_dead_rank_from_each_launchers_line():
    pids = {("vm", 4242): 3, ("node7", 99): 1}
    assert dead_ranks("prterun noticed that process rank 2 with PID 28687 on node vm exited on",
                      pids) == [2]
    assert dead_ranks("srun: error: vm: task 1: Killed", pids) == [1]
    assert dead_ranks("srun: error: vm: task 0: Exited with exit code 2", pids) == []
    assert dead_ranks("hpcasync: error (rank 0): rank(s) 1, 3 died; this run cannot", pids) == [1, 3]
    assert dead_ranks("=   PID 4242 RUNNING AT vm", pids) == [3]
    assert dead_ranks("=   PID 99 RUNNING AT node7.cluster", pids) == [1]
    assert dead_ranks("=   PID 5 RUNNING AT vm", pids) == []
    assert dead_ranks("[05:00:01 r0] epoch 1: loss 0.3", pids) == []


def test_resume_args_replace_any_resume():
    base = ["--algorithm", "ssgd", "--resume", "old.pt", "--epochs", "2", "--resume=auto"]
    assert resume_args(base, "ck/new.pt") == ["--algorithm", "ssgd", "--epochs", "2",
                                              "--resume", "ck/new.pt"]
    assert resume_args(base, None) == base


def test_job_command_per_launcher():
    cmd = job_command(3, ["--epochs", "1"])
    assert cmd[-6:] == [sys.executable, "-m", "hpcasync.cli", "train", "--epochs", "1"]
    assert cmd[cmd.index("-n") + 1] == "3"
    with pytest.raises(ConfigError, match="--launcher must be mpiexec or srun"):
        job_command(2, [], launcher="torchrun")
    if shutil.which("srun"):
        assert job_command(2, [], launcher="srun", vendor="mpich")[:4] == [
            "srun", "--mpi=pmi2", "--kill-on-bad-exit=1", "--ntasks=2"]
        assert job_command(2, [], launcher="srun", vendor="openmpi")[1] == "--mpi=pmix"
    else:
        with pytest.raises(ConfigError, match="no srun on PATH"):
            job_command(2, [], launcher="srun")


def test_your_own_script_is_a_job_too(tmp_path):
    """``-- loop.py ARGS`` runs with this Python, ``-- python loop.py ARGS`` as given; anything
    else (or a script that is not there) is one line before any job; a script needs no
    ``--checkpoint-dir`` of the supervisor's (it resumes from its own)."""
    loop = tmp_path / "loop.py"
    loop.write_text("pass\n")
    assert script_program([str(loop), "--x", "1"]) == [sys.executable, str(loop), "--x", "1"]
    assert script_program(["python3", "-u", str(loop)]) == ["python3", "-u", str(loop)]
    cmd = job_command(2, [], program=script_program([str(loop)]))
    assert cmd[-2:] == [sys.executable, str(loop)] and cmd[cmd.index("-n") + 1] == "2"
    for bad, words in ((["bench", "allreduce"], "runs `train OPTIONS` or your script"),
                       ([str(tmp_path / "nope.py")], "no script")):
        with pytest.raises(ConfigError, match=words):
            script_program(bad)
    Supervisor(2, [], max_restarts=2, script=script_program([str(loop)]))


def test_each_attempt_is_told_its_restart_count(tmp_path):
    """``HPCASYNC_RESTART_COUNT`` (torchrun's ``TORCHELASTIC_RESTART_COUNT``): 0, then 1, ...; a
    script that dies twice by itself (no rank marks: a death) is restarted, then finishes."""
    loop = tmp_path / "loop.py"
    loop.write_text("import os, signal, sys\n"
                    "n = int(os.environ['HPCASYNC_RESTART_COUNT'])\n"
                    "d = os.environ['HPCASYNC_SUPERVISOR_DIR']\n"
                    "open(os.path.join(d, 'rank-0'), 'w').write('host %d\\n' % os.getpid())\n"
                    f"open({str(tmp_path / 'seen')!r}, 'a').write(str(n))\n"
                    "if n < 2: os.kill(os.getpid(), signal.SIGKILL)\n")
    assert Supervisor(1, [], max_restarts=2, script=script_program([str(loop)])).run() == 0
    assert (tmp_path / "seen").read_text() == "012"


def test_restarts_need_a_checkpoint_dir():
    with pytest.raises(ConfigError, match="--max-restarts needs the job's --checkpoint-dir"):
        Supervisor(2, ["--epochs", "1"], max_restarts=1)
    with pytest.raises(ConfigError, match="--max-restarts must be >= 0"):
        Supervisor(2, [], max_restarts=-1, checkpoint_dir="x")


@pytest.mark.parametrize("exc, kind", [("ConfigError('bad --lr')", "error"),
                                       ("RuntimeError('bug')", "crash"),
                                       ("ProcessFailedError('gone', [2])", "mpi")])
def test_fail_fast_leaves_the_mark_the_supervisor_reads(tmp_path, exc, kind):
    code = ("from hpcasync.errors import *\n"
            f"try:\n    raise {exc}\nexcept BaseException as e:\n    fail_fast(e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**env, "HPCASYNC_SUPERVISOR_DIR": str(tmp_path),
                              "PYTHONPATH": REPO})
    assert out.returncode == (2 if kind == "error" else 1), out.stderr
    mark = json.loads((tmp_path / "exit-0").read_text())
    assert mark["kind"] == kind and mark["message"].startswith(exc.split("(")[0] + ": ")


def test_launch_refuses_bad_train_options_before_any_job(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-m", "hpcasync.cli", "launch", "-n", "2",
                          "--max-restarts", "1", "--", "train", "--epochs", "1"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "hpcasync: error: --max-restarts needs the job's --checkpoint-dir: a restart resumes "
        "from its newest checkpoint"]
