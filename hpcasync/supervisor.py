"""``hpcasync launch``: start a training job, and restart it from its last checkpoint when a rank
dies — the torchrun ``--max-restarts`` way, for MPIs without ULFM (MPICH, Open MPI without
``--with-ft``, ``--backend horovod``).

Each attempt is a new ``mpiexec`` (or, inside a Slurm allocation, a new ``srun`` step) of ``hpcasync
train``; a restart adds ``--resume <newest good checkpoint>``. Your own script (``-- loop.py``)
is run again as it was and resumes from its own checkpoints (``State.persist``). Only a death is
restarted: a rank that stopped on bad input, on a bug or on a signal the supervisor forwarded is
not (:func:`decide`). One line on stderr per restart, one when it gives up; the exit status is the
last attempt's.

Example::

    hpcasync launch -n 4 --max-restarts 3 -- train --algorithm ssgd --checkpoint-dir ckpt \\
        --checkpoint-every 50 --metrics run.jsonl

Design (how a death is told from other failures, the time lost): docs/design/restarts.md.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError, launcher_rank

#: the folder (one per attempt) where the job's ranks leave their pid (``rank-R``) and, when they
#: end through :func:`hpcasync.errors.fail_fast`, what ended them (``exit-R``)
SUPERVISOR_ENV = "HPCASYNC_SUPERVISOR_DIR"
#: status of a run that stopped at a checkpoint for preemption (hpcasync.checkpoint.EXIT_PREEMPTED)
EXIT_PREEMPTED = 75
#: the mark kinds that say "not a death": bad input (HpcasyncError), a bug (another exception),
#: an interrupt; ``mpi`` (an MPI error or ProcessFailedError: how a peer's death shows) is a death
NOT_A_DEATH = {"error": "stopped on an error", "crash": "crashed (a Python exception)",
               "interrupt": "was interrupted"}
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
SAY = "hpcasync launch:"
#: the attempt's number of restarts before it (0, 1, ...), in every rank's environment (torchrun's
#: ``TORCHELASTIC_RESTART_COUNT``)
RESTART_ENV = "HPCASYNC_RESTART_COUNT"


# --- the ranks' side -------------------------------------------------------------------------------

def announce() -> None:
    """In a rank started by the supervisor: leave ``rank-R`` (host and pid) in its folder, so a
    launcher line naming a pid names a rank. A no-op otherwise."""
    folder = os.environ.get(SUPERVISOR_ENV)
    if not folder:
        return
    try:
        Path(folder, f"rank-{launcher_rank()}").write_text(f"{socket.gethostname()} {os.getpid()}\n")
    except OSError:
        pass                    # the supervisor then names no rank; nothing else depends on it


# --- deciding ---------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What one attempt left: its exit status, the ranks' marks (rank -> {"kind", "message"}),
    how many ranks started (left ``rank-R``), the signal the supervisor forwarded (if any), the
    dead rank named by a launcher line (if any)."""
    status: int
    marks: dict[int, dict] = field(default_factory=dict)
    started: int = 0
    signalled: int | None = None
    dead: list[int] = field(default_factory=list)


def decide(out: Outcome, restarts_done: int, max_restarts: int) -> tuple[bool, str]:
    """``(restart?, why)`` for an attempt that ended with ``out``. Restarted: a non-zero exit with
    no sign of anything but a death (ranks killed by a signal, or ranks that saw a peer's death as
    an MPI error, or a rank the launcher says was killed before any rank left its pid), while
    restarts remain. Not restarted: success, a forwarded signal, a preemption stop (75: the
    scheduler's to requeue), a rank's mark of bad input, a bug or an interrupt, a launcher that
    started no rank."""
    if out.status == 0:
        return False, "the job finished"
    if out.signalled is not None:
        return False, (f"stopped by {signal.Signals(out.signalled).name} (forwarded to the job): "
                       f"not restarting; the job's exit status was {out.status}")
    if out.status == EXIT_PREEMPTED:
        return False, (f"the job stopped at a checkpoint for preemption (status {EXIT_PREEMPTED}): "
                       "not restarting (a requeue or --resume auto continues it)")
    for rank in sorted(out.marks):
        mark = out.marks[rank]
        if mark.get("kind") in NOT_A_DEATH:
            return False, (f"rank {rank} {NOT_A_DEATH[mark['kind']]}, not a death: not restarting "
                           f"(status {out.status}): {mark.get('message', '')}")
    if out.started == 0 and not out.dead:   # (a rank killed in its start-up: the launcher says)
        return False, (f"the launcher ended with status {out.status} before any rank started: "
                       "not restarting")
    who = f"rank {', '.join(map(str, out.dead))} died" if out.dead else "a rank died"
    if restarts_done >= max_restarts:
        return False, (f"{who} (status {out.status}) and --max-restarts {max_restarts} "
                       f"restart(s) are used up: giving up")
    return True, f"{who} (status {out.status})"


_OPEN_MPI = re.compile(r"process rank (\d+) with PID \d+")
_OURS = re.compile(r"rank\(s\) ([\d, ]+) died")
_SRUN = re.compile(r"task (\d+): (?:Killed|Terminated|Segmentation|Bus error|Aborted)")
_MPICH_PID = re.compile(r"PID (\d+) RUNNING AT (\S+)")


def dead_ranks(line: str, pids: dict[tuple[str, int], int]) -> list[int]:
    """The ranks a launcher's (or hpcasync's) line says died: Open MPI's ``process rank R with
    PID``, srun's ``task R: Killed``, hpcasync's ``rank(s) D died``, MPICH's ``PID n RUNNING AT
    host`` through ``pids`` ((host, pid) -> rank)."""
    for pattern in (_OPEN_MPI, _SRUN):
        m = pattern.search(line)
        if m:
            return [int(m.group(1))]
    m = _OURS.search(line)
    if m:
        return [int(r) for r in m.group(1).replace(" ", "").split(",") if r]
    m = _MPICH_PID.search(line)
    if m:
        host, pid = m.group(2), int(m.group(1))
        rank = pids.get((host, pid), pids.get((host.split(".")[0], pid)))
        if rank is None:         # hydra names the host as it knows it: match the pid alone
            rank = next((r for (_, p), r in pids.items() if p == pid), None)
        return [] if rank is None else [rank]
    return []


def resume_args(train_args: list[str], checkpoint: str | None) -> list[str]:
    """``train_args`` with any ``--resume`` replaced by ``--resume checkpoint`` (unchanged when
    ``checkpoint`` is None: no checkpoint yet, the run starts as the first attempt did)."""
    if checkpoint is None:
        return list(train_args)
    out, skip = [], False
    for arg in train_args:
        if skip:
            skip = False
            continue
        if arg == "--resume":
            skip = True
            continue
        if arg.startswith("--resume="):
            continue
        out.append(arg)
    return [*out, "--resume", checkpoint]


def script_program(job: list[str]) -> list[str]:
    """What each rank runs for ``job``, the words after ``--`` that are not ``train``: your own
    script (``loop.py ARGS``, run by this Python, or ``python loop.py ARGS`` as given)."""
    words = list(job)
    if words and os.path.basename(words[0]).startswith("python"):
        script = next((w for w in words[1:] if not w.startswith("-")), None)
    else:
        script = words[0] if words else None
        words = [sys.executable, *words]
    if script is None or not script.endswith(".py"):
        raise ConfigError("hpcasync launch runs `train OPTIONS` or your script: hpcasync launch -n "
                          f"N [--max-restarts K] -- train OPTIONS | loop.py ARGS; got {job!r}")
    if not Path(script).is_file():
        raise ConfigError(f"hpcasync launch: no script {script!r}")
    return words


def job_command(n: int, train_args: list[str], *, launcher: str = "mpiexec", ft: bool = False,
                vendor: str | None = None, python: str | None = None,
                program: list[str] | None = None) -> list[str]:
    """The argv of one attempt: ``mpiexec`` (this Python's MPI, :func:`hpcasync.launch.
    mpiexec_command`) or ``srun`` (a new step of the allocation: ``--mpi=pmix``, MPICH
    ``pmi2``; ``--kill-on-bad-exit``) starting ``python -m hpcasync.cli train ARGS``, or
    ``program`` (a script's, :func:`script_program`)."""
    from .launch import MPICH, mpi_vendor, mpiexec_command

    python = python or sys.executable
    program = program or [python, "-m", "hpcasync.cli", "train", *train_args]
    if launcher == "mpiexec":
        return [*mpiexec_command(n, ft=ft, vendor=vendor), *program]
    if launcher == "srun":
        if ft:
            raise ConfigError("--ft needs --launcher mpiexec (ULFM is Open MPI's mpiexec's)")
        if shutil.which("srun") is None:
            raise ConfigError("--launcher srun: no srun on PATH (run inside a Slurm allocation)")
        pmi = "pmi2" if (vendor or mpi_vendor()) == MPICH else "pmix"
        return ["srun", f"--mpi={pmi}", "--kill-on-bad-exit=1", f"--ntasks={n}", *program]
    raise ConfigError(f"--launcher must be mpiexec or srun, not {launcher!r}")


# --- running ----------------------------------------------------------------------------------------

def say(text: str) -> None:
    print(f"{SAY} {text}", file=sys.stderr, flush=True)


class Supervisor:
    """Runs the attempts of one job (module doc). ``train_args``: the ``hpcasync train`` options;
    ``checkpoint_dir`` and ``metrics``: theirs (a restart resumes from the first and keeps the
    previous attempt's ``METRICS.partial`` as ``METRICS.attempt-K.partial``). ``script``: your
    own script's argv instead (:func:`script_program`): a restart runs it again as it was, with
    ``HPCASYNC_RESTART_COUNT`` (0 in the first attempt) in its environment, and it resumes from
    its own checkpoints (``hpcasync.elastic.State.persist``, ``hpcasync.load_checkpoint``)."""

    def __init__(self, n: int, train_args: list[str], *, max_restarts: int = 0,
                 launcher: str = "mpiexec", ft: bool = False, checkpoint_dir: str | None = None,
                 metrics: str | None = None, script: list[str] | None = None):
        if max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
        if max_restarts > 0 and not checkpoint_dir and script is None:
            raise ConfigError("--max-restarts needs the job's --checkpoint-dir: a restart resumes "
                              "from its newest checkpoint")
        self.n, self.train_args, self.max_restarts = n, list(train_args), max_restarts
        self.launcher, self.ft, self.script = launcher, ft, script
        self.checkpoint_dir, self.metrics = checkpoint_dir, metrics
        job_command(n, self.train_args, launcher=launcher, ft=ft,       # checks the launcher now
                    program=script)
        self._job: subprocess.Popen | None = None
        self._signalled: int | None = None
        self._events: dict[str, float] = {}
        self._lock = threading.Lock()
        self._restart: tuple[int, float] | None = None      # (attempt, when its death showed)
        self._resumed: float | None = None                  # seconds from that to the resume

    # signals: forwarded to the job, and no restart after them
    def _forward(self, signum, frame) -> None:
        self._signalled = signum
        job = self._job
        if job is not None and job.poll() is None:
            try:
                os.kill(job.pid, signum)
            except OSError:
                pass

    def _pump(self, stream, out, pids_dir: Path, dead: list[int]) -> None:
        """Copy one of the job's streams to ours (``out``), noting the first death line (MPICH's
        hydra writes its own to stdout) and the resume line."""
        for raw in iter(stream.readline, b""):
            if not raw.endswith(b"\n"):
                raw += b"\n"           # a last line cut short: our own lines start on their own
            out.write(raw)
            out.flush()
            line = raw.decode(errors="replace")
            found = dead_ranks(line, _pids(pids_dir)) if not dead else []
            with self._lock:
                if found and not dead:
                    dead.extend(found)
                    self._events.setdefault("death_seen", time.time())
            if "resuming from " in line and self._restart is not None \
                    and self._resumed is None:
                k, t_death = self._restart
                self._resumed = time.time() - t_death
                say(f"restart {k}: training resumed {self._resumed:.1f} s after the death was "
                    "reported")

    def attempt(self, args: list[str], state: Path, restarts: int) -> Outcome:
        """One job after ``restarts`` restarts, its marks in ``state/attempt-N`` (N from 1)."""
        folder = state / f"attempt-{restarts + 1}"
        folder.mkdir(parents=True)
        env = {**os.environ, SUPERVISOR_ENV: str(folder), RESTART_ENV: str(restarts)}
        cmd = job_command(self.n, args, launcher=self.launcher, ft=self.ft, program=self.script)
        say(f"attempt {restarts + 1}: {' '.join(cmd)}")
        dead: list[int] = []
        self._job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        pumps = [threading.Thread(target=self._pump, args=(src, dst.buffer, folder, dead),
                                  daemon=True)
                 for src, dst in ((self._job.stdout, sys.stdout), (self._job.stderr, sys.stderr))]
        for pump in pumps:
            pump.start()
        status = self._job.wait()
        for pump in pumps:
            pump.join(timeout=10)
        status = 128 - status if status < 0 else status      # launcher killed by a signal
        marks = {}
        for path in folder.glob("exit-*"):
            try:
                marks[int(path.name[5:])] = json.loads(path.read_text())
            except (OSError, ValueError):
                marks[int(path.name[5:])] = {"kind": "crash", "message": "unreadable mark"}
        started = len(list(folder.glob("rank-*")))
        return Outcome(status, marks, started, self._signalled, dead)

    def run(self) -> int:
        previous = {s: signal.signal(s, self._forward) for s in FORWARDED}
        state = Path(tempfile.mkdtemp(prefix="hpcasync-launch-"))
        try:
            return self._run(state)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            job = self._job
            if job is not None and job.poll() is None:      # the supervisor itself failed
                job.terminate()          # SIGTERM first: a SIGKILLed launcher leaves its ranks
                try:                     # running and its session directory behind
                    job.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    job.kill()
            shutil.rmtree(state, ignore_errors=True)

    def _run(self, state: Path) -> int:
        args, restarts, lost = self.train_args, 0, []
        while True:
            self._events, self._resumed = {}, None
            t0 = time.time()
            out = self.attempt(args, state, restarts)
            t_end = time.time()
            if self._resumed is not None:
                lost.append(self._resumed)
            restart, why = decide(out, restarts, self.max_restarts)
            if not restart:
                if out.status != 0:
                    say(why)
                elif restarts:
                    total = f"; time lost {sum(lost):.1f} s" if lost else ""
                    say(f"the job finished after {restarts} restart(s){total}")
                return out.status
            restarts += 1
            checkpoint = self._newest_checkpoint()
            self._keep_metrics(restarts)
            self._restart = (restarts, min(self._events.get("death_seen", t_end), t_end))
            source = ("the script resumes from its own checkpoints" if self.script else
                      f"resuming from {checkpoint}" if checkpoint else
                      "no checkpoint yet: starting again as the first attempt did")
            say(f"restart {restarts} of {self.max_restarts}: {why} {t_end - t0:.1f} s into "
                f"attempt {restarts}; {source}")
            args = resume_args(self.train_args, checkpoint)

    def _newest_checkpoint(self) -> str | None:
        if not self.checkpoint_dir or not Path(self.checkpoint_dir).is_dir():
            return None
        from .checkpoint import latest_checkpoint

        found = latest_checkpoint(self.checkpoint_dir)
        return str(found) if found else None

    def _keep_metrics(self, k: int) -> None:
        if not self.metrics:
            return
        partial = Path(self.metrics + ".partial")
        if partial.exists():
            partial.replace(Path(f"{self.metrics}.attempt-{k}.partial"))


def _pids(folder: Path) -> dict[tuple[str, int], int]:
    pids = {}
    for path in folder.glob("rank-*"):
        try:
            host, pid = path.read_text().split()
            pids[(host, int(pid))] = int(path.name[5:])
        except (OSError, ValueError):
            pass
    return pids


# --- the command line -------------------------------------------------------------------------------

def add_arguments(p) -> None:
    p.add_argument("-n", "--np", dest="np", type=int, required=True, help="number of ranks")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the job from its newest checkpoint after up to N deaths "
                        "(needs the job's --checkpoint-dir)")
    p.add_argument("--launcher", default="mpiexec", choices=("mpiexec", "srun"),
                   help="mpiexec (this Python's MPI) or srun (each attempt a new step of the "
                        "Slurm allocation)")
    p.add_argument("--ft", action="store_true",
                   help="mpiexec --with-ft ulfm (Open MPI): survive deaths in the job, restart "
                        "after those it cannot survive")
    p.add_argument("job", nargs="*", help="-- train <hpcasync train options> | -- loop.py <its "
                   "arguments> (your own script, which resumes from its own checkpoints)")
