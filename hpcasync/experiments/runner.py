"""Run an experiment's matrix as subprocesses, resuming where a previous invocation stopped.

Each run is ``python -m hpcasync sim ...`` or ``mpiexec -n RANKS python -m hpcasync train ...``
with ``--metrics OUT/runs/<id>.jsonl``; a stream whose last record is the ``summary`` is a
finished run and is skipped, an unfinished run starts again, a failed one is recorded as
``<id>.failed`` and the matrix goes on. Children die with the runner.

Example::

    spec = load_spec("experiments/shat.toml", mini=True)
    result = run_experiment(spec, "/tmp/shat", jobs=2)     # result.ran, .skipped, .failed

Design: docs/design/experiments.md#runner (the launcher, what is removed or kept on a rerun,
children, the lock).
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import launch
from ..errors import ConfigError
from .spec import Run, Spec, check_run, option_args

log = logging.getLogger("hpcasync")

TAIL_LINES = 40
KILL_GRACE_S = 15.0
_PR_SET_PDEATHSIG = 1


@dataclass
class RunnerResult:
    ran: list[str] = field(default_factory=list)        # finished in this invocation
    skipped: list[str] = field(default_factory=list)    # finished before
    failed: list[str] = field(default_factory=list)     # failed in this invocation
    failed_before: list[str] = field(default_factory=list)


def run_dir(out: Path) -> Path:
    return Path(out) / "runs"


def is_finished(path: Path) -> bool:
    """A metrics stream whose last record is the run's ``summary``."""
    last = b""
    try:
        with open(path, "rb") as fh:
            for line in fh:
                if line.strip():
                    last = line
        return bool(last) and json.loads(last).get("event") == "summary"
    except (OSError, ValueError):
        return False


def child_env() -> dict[str, str]:
    """A child's environment: no launcher job variables (a child mpiexec must not see them), the
    launchers' idle-yield defaults (:func:`hpcasync.launch.child_env`), this package importable."""
    env = launch.child_env()
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    return env


def command(spec: Spec, run: Run, metrics: Path) -> list[str]:
    """The argv of ``run`` writing its metrics to ``metrics``."""
    args = [sys.executable, "-m", "hpcasync", spec.command, *option_args(run.options),
            "--metrics", str(metrics), "--progress", "off"]
    if spec.mode == "mpi":
        # no core binding: with few ranks Open MPI would pin them, and the box is shared
        return [*launch.mpiexec_command(run.ranks, bind="none"), *args]
    return args


def check_finished_options(spec: Spec, run: Run, path: Path) -> None:
    """A finished run must have been made with the options the file gives it now."""
    from ..metrics import read_metrics

    config = next((r for r in read_metrics(path) if r.get("event") == "config"), None)
    if config is None:
        return
    made = {**config["config"].get("options", {}), **config["config"]}
    for key, value in run.options.items():
        if key in made and made[key] != value:
            raise ConfigError(f"{path} was made with {key} = {made[key]!r}, the experiment file "
                              f"now says {value!r}; delete it or use another --out")
    if spec.mode == "mpi" and config.get("world_size") not in (None, run.ranks):
        raise ConfigError(f"{path} was made with {config['world_size']} ranks, the experiment "
                          f"file now says {run.ranks}; delete it or use another --out")


def select(runs: list[Run], only: list[str] | tuple[str, ...]) -> list[Run]:
    """Runs matching every ``KEY=VAL`` of ``only`` (several values of one key: any of them)."""
    wanted: dict[str, set[str]] = {}
    for item in only:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--only {item!r}: expected KEY=VALUE")
        wanted.setdefault(key.replace("-", "_"), set()).add(value)
    axes = set(runs[0].axes) if runs else set()
    for key in wanted:
        if key not in axes:
            raise ConfigError(f"--only {key}: no such axis (axes: {', '.join(sorted(axes))})")
    chosen = [r for r in runs if all(str(r.axes[k]) in v for k, v in wanted.items())]
    if not chosen:
        raise ConfigError(f"--only {' '.join(only)}: no run matches")
    return chosen


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _pdeathsig(sig: int):
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):        # not Linux: children may outlive a killed runner
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return preexec


@dataclass
class _Child:
    run: Run
    proc: subprocess.Popen
    log_path: Path
    started: float
    deadline: float
    argv: list[str]
    load_start: float = 0.0
    timed_out: bool = False


def _tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _kill(child: _Child) -> None:
    """End a child's whole process group (mpiexec and its ranks): TERM, then KILL."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(child.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class _Lock:
    def __init__(self, out: Path):
        self.fh = open(out / ".lock", "w")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.fh.close()
            raise ConfigError(f"{out}: another experiment runner is using this directory") from None

    def release(self) -> None:
        Path(self.fh.name).unlink(missing_ok=True)
        self.fh.close()


def run_experiment(spec: Spec, out: str | Path, *, only=(), timeout: float | None = None,
                   jobs: int | None = None, retry_failed: bool = False,
                   poll_s: float = 0.2) -> RunnerResult:
    """Run the runs of ``spec`` (those matching ``only``) into ``out``; see
    docs/design/experiments.md#runner.

    Args:
        timeout: seconds per run (default: the file's ``timeout``).
        jobs: runs at a time (default: the file's ``jobs``; sim mode only, MPI runs are timed).
        retry_failed: rerun the runs recorded as failed by an earlier invocation.
    """
    jobs = spec.jobs if jobs is None else jobs
    if jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    if jobs > 1 and spec.mode == "mpi":
        raise ConfigError("--jobs > 1 is for sim experiments only (MPI runs are timed)")
    timeout = spec.timeout if timeout is None else timeout
    if not timeout > 0:
        raise ConfigError(f"--timeout must be > 0, got {timeout}")
    chosen = select(spec.runs, only)
    for run in chosen:                  # every problem before anything starts (one line each)
        check_run(spec, run)
    out = Path(out)
    rdir = run_dir(out)
    rdir.mkdir(parents=True, exist_ok=True)
    lock = _Lock(out)
    try:
        _write_atomic(out / "experiment.json", json.dumps(spec.to_record(), indent=1) + "\n")
        return _run_all(spec, chosen, rdir, timeout, jobs, retry_failed, poll_s)
    finally:
        lock.release()


def _run_all(spec: Spec, chosen: list[Run], rdir: Path, timeout: float, jobs: int,
             retry_failed: bool, poll_s: float) -> RunnerResult:
    result = RunnerResult()
    pending = []
    for run in chosen:
        final = rdir / f"{run.id}.jsonl"
        if is_finished(final):
            check_finished_options(spec, run, final)
            for stale in ("jsonl.partial", "log", "failed"):      # left by a killed runner
                (rdir / f"{run.id}.{stale}").unlink(missing_ok=True)
            log.info("skip %s (finished)", run.id)
            result.skipped.append(run.id)
        elif (rdir / f"{run.id}.failed").is_file() and not retry_failed:
            log.info("skip %s (failed before; --retry-failed reruns it)", run.id)
            result.failed_before.append(run.id)
        else:
            pending.append(run)
    env = child_env()
    preexec = _pdeathsig(signal.SIGTERM if spec.mode == "mpi" else signal.SIGKILL)
    active: list[_Child] = []
    total, done = len(pending), 0
    try:
        while pending or active:
            while pending and len(active) < jobs:
                active.append(_start(spec, pending.pop(0), rdir, timeout, env, preexec))
            time.sleep(poll_s)
            for child in list(active):
                if child.proc.poll() is None and time.time() < child.deadline:
                    continue
                if child.proc.poll() is None:
                    child.timed_out = True
                    _kill(child)
                active.remove(child)
                done += 1
                ok = _finish(child, rdir, timeout)
                (result.ran if ok else result.failed).append(child.run.id)
                log.info("[%d/%d] %s %s (%.1f s)", done, total, "done" if ok else "FAILED",
                         child.run.id, time.time() - child.started)
    except BaseException:
        for child in active:
            _kill(child)
        raise
    return result


def _start(spec: Spec, run: Run, rdir: Path, timeout: float, env, preexec) -> _Child:
    final = rdir / f"{run.id}.jsonl"
    for stale in (final, rdir / f"{run.id}.jsonl.partial", rdir / f"{run.id}.failed",
                  rdir / f"{run.id}.log", rdir / f"{run.id}.load"):
        stale.unlink(missing_ok=True)
    argv = command(spec, run, final)
    log_path = rdir / f"{run.id}.log"
    log.info("start %s", run.id)
    with open(log_path, "wb") as fh:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, preexec_fn=preexec)
    now = time.time()
    return _Child(run=run, proc=proc, log_path=log_path, started=now, deadline=now + timeout,
                  argv=argv, load_start=os.getloadavg()[0])


def _finish(child: _Child, rdir: Path, timeout: float) -> bool:
    """Record the outcome of an ended child; True when the run finished."""
    rid = child.run.id
    final = rdir / f"{rid}.jsonl"
    rc = child.proc.wait()
    if rc == 0 and not child.timed_out and is_finished(final):
        child.log_path.unlink(missing_ok=True)
        # the machine's 1-minute load average when the run started and ended (timings taken
        # under other load are not results: the report prints these beside them)
        _write_atomic(rdir / f"{rid}.load", json.dumps(
            {"start": child.load_start, "end": os.getloadavg()[0], "cpus": os.cpu_count()}) + "\n")
        return True
    why = (f"timed out after {timeout:g} s" if child.timed_out
           else f"exit status {rc}" if rc != 0 else "exit status 0 but no summary record")
    shown = ["hpcasync", *child.argv[child.argv.index("-m") + 2:]]
    shown[shown.index("--metrics") + 1] = f"runs/{rid}.jsonl"
    if child.run.ranks is not None:
        shown = ["mpiexec", "-n", str(child.run.ranks), *shown]
    text = (f"{why}\ncommand: {' '.join(shown)}\n--- last lines of output ---\n"
            f"{_tail(child.log_path)}\n")
    _write_atomic(rdir / f"{rid}.failed", text)
    for leftover in (child.log_path, final, rdir / f"{rid}.jsonl.partial"):
        leftover.unlink(missing_ok=True)
    log.warning("%s failed: %s (see %s)", rid, why, rdir / f"{rid}.failed")
    return False
