"""Issue 15's study: ranks SIGKILLed mid-run under ``mpirun --with-ft ulfm``; what each algorithm
loses (test accuracy after 2 epochs with 0, 1 and 2 deaths vs none) and how long it takes to go on
(kill -> failure detected -> recovered -> next completed step).

Real runs: 4 ranks, full Fashion-MNIST, LeNet, 2 epochs, batch 32, each algorithm's defaults (DASO:
2 virtual nodes of 2, epoch 1 cycling, epoch 2 cool-down). Kills (``HPCASYNC_INJECT_KILL_AT`` for
the synchronous runtimes, ``HPCASYNC_INJECT_KILL`` for a PS worker's push count):

* 1 death: rank 2 after its step 200 (of 468 in epoch 1) / worker rank 3 at its push 300 (of 625);
* 2 deaths: that one, then rank 1 after its step 700 (in epoch 2) / worker rank 1 at push 900;
* server (PS algorithms): the server (rank 0) at its 1000th accepted push (of 3750); a worker
  takes over (``hpcasync.ps.takeover``); "next step" is the new server's first push served;
* ``--mtbf-steps M``: the 1 or 2 kills at exponentially distributed gaps of mean M steps instead
  (seeded by the run's seed).

Every kill logs its wall time (``HPCASYNC_INJECT_KILL_LOG``); the runs' metrics give the detection
time, the recovery time and the end of the next step. Writes ``OUT/runs/*.jsonl``, ``OUT/*.kills``
and ``OUT/report.md`` (with the command, the machine's core count and load averages).

    python experiments/probes/failures.py --out experiments/results/failures [--seeds 0 1]

Issue 23's study (``--random N``): one rank SIGKILLed from outside at a uniformly random time in
[0, T] after launch (T: that route's undisturbed run, measured first in the same pass), start-up
included, N runs per route, every route under ``mpiexec --with-ft ulfm``: see :func:`random_study`.

    python experiments/probes/failures.py --random 4 --out experiments/results/failures
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hpcasync.launch import child_env, mpiexec_command  # noqa: E402
from hpcasync.metrics import read_metrics  # noqa: E402

BASE = ["train", "--dataset", "fashion-mnist", "--model", "lenet", "--epochs", "2",
        "--batch-size", "32", "--progress", "off"]
EXTRA = {"daso": ["--ranks-per-node", "2", "--daso-warmup-epochs", "0",
                  "--daso-cooldown-epochs", "1"],
         "diloco": ["--diloco-sync-every", "16"]}       # (H = 500 would take no outer step)
SYNC = ("ssgd", "odsgd", "daso")
KILLS = {  # deaths -> (sync kills, PS kills)
    0: ("", ""),
    1: ("2:step:200", "3:300"),
    2: ("2:step:200,1:step:700", "3:300,1:900"),
    "server": (None, "0:1000"),          # the PS at its 1000th accepted push (of 3750)
}


def mtbf_kills(deaths: int, seed: int, mean: float) -> tuple[str, str]:
    """``deaths`` ranks killed one after another, the gaps between kills (in steps / pushes of
    the killed rank) drawn from an exponential distribution of mean ``mean`` (seeded by
    ``seed``): ranks 2, 1 for the synchronous runtimes, workers 3, 1 for the PS."""
    rng = random.Random(seed)
    at, sync, ps = 0.0, [], []
    for rank_sync, rank_ps in [(2, 3), (1, 1)][:deaths]:
        at += rng.expovariate(1.0 / mean)
        n = max(1, int(at))
        sync.append(f"{rank_sync}:step:{n}")
        ps.append(f"{rank_ps}:{max(1, n * 4 // 3)}")   # a PS worker pushes 625 per epoch, not 468
    return ",".join(sync), ",".join(ps)


def run_one(out: Path, algorithm: str, deaths, seed: int, timeout: int,
            mtbf: float | None = None) -> dict:
    rid = f"{algorithm}__deaths={deaths}__seed={seed}" + (f"__mtbf={mtbf:g}" if mtbf else "")
    metrics, kills = out / "runs" / f"{rid}.jsonl", out / "runs" / f"{rid}.kills"
    kills.unlink(missing_ok=True)
    sync_kill, ps_kill = (mtbf_kills(deaths, seed, mtbf) if mtbf and deaths in (1, 2)
                          else KILLS[deaths])
    env = child_env()
    env.update(PYTHONPATH=str(REPO), HPCASYNC_INJECT_KILL_LOG=str(kills))
    if algorithm in SYNC:
        env["HPCASYNC_INJECT_KILL_AT"] = sync_kill
    else:
        env["HPCASYNC_INJECT_KILL"] = ps_kill
    cmd = [*mpiexec_command(4, ft=True), sys.executable, "-m", "hpcasync.cli", *BASE,
           "--algorithm", algorithm, "--seed", str(seed), "--metrics", str(metrics),
           *EXTRA.get(algorithm, [])]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    row = {"id": rid, "algorithm": algorithm, "deaths": deaths, "seed": seed,
           "rc": proc.returncode, "wall_s": round(time.time() - t0, 1)}
    if proc.returncode != 0 or not metrics.exists():
        (out / "runs" / f"{rid}.failed").write_text(proc.stderr[-6000:])
        return row
    records = read_metrics(metrics)
    summary = [r for r in records if r["event"] == "summary"][-1]
    row["accuracy"] = summary["test_accuracy"]
    stamps = sorted(float(line.split()[-1]) for line in kills.read_text().splitlines()) \
        if kills.exists() else []
    if algorithm in SYNC:
        fails = summary.get("rank_failures", [])
        row["detect_s"] = [round(f["detected_unix"] - k, 4) for f, k in zip(fails, stamps)]
        row["recovery_s"] = [f["recovery_s"] for f in fails]
        row["next_step_s"] = [round(f["detected_unix"] + f["next_step_s"] - k, 4)
                              for f, k in zip(fails, stamps) if f["next_step_s"] is not None]
        row["identical"] = len(set(summary.get("replica_sha256", ["-"]))) == 1
    elif deaths == "server":
        fails = summary.get("server_failures", [])
        row["detect_s"] = [round(f["detected_unix"] - k, 4) for f, k in zip(fails, stamps)]
        row["recovery_s"] = [f["recovery_s"] for f in fails]
        row["next_step_s"] = [round(f["first_push_unix"] - k, 4) for f, k in zip(fails, stamps)
                              if "first_push_unix" in f]
    else:
        fails = [r for r in records if r["event"] == "worker_failed"]
        row["detect_s"] = [round(f["detected_unix"] - k, 4) for f, k in zip(fails, stamps)]
        row["recovery_s"] = [0.0 for _ in fails]           # the server just retires the worker
        row["next_step_s"] = row["detect_s"]               # and serves the next push at once
    row["dead"] = len(fails)
    return row


def report(out: Path, rows: list[dict], header: str) -> str:
    lines = [header, "",
             "| algorithm | deaths | runs ok | test accuracy (mean over seeds) | Δ vs 0 deaths | "
             "kill → detected (median) | recovery (median) | kill → next step (median, max) |",
             "|---|---|---|---|---|---|---|---|"]
    algos = sorted({r["algorithm"] for r in rows}, key=lambda a: (a not in SYNC, a))
    for a in algos:
        base = [r["accuracy"] for r in rows if r["algorithm"] == a and r["deaths"] == 0
                and "accuracy" in r]
        for d in (0, 1, 2, "server"):
            sel = [r for r in rows if r["algorithm"] == a and r["deaths"] == d]
            ok = [r for r in sel if "accuracy" in r]
            if not sel:
                continue
            acc = statistics.mean(r["accuracy"] for r in ok) if ok else float("nan")
            delta = acc - statistics.mean(base) if ok and base else float("nan")
            det = [x for r in ok for x in r.get("detect_s", [])]
            rec = [x for r in ok for x in r.get("recovery_s", [])]
            nxt = [x for r in ok for x in r.get("next_step_s", [])]

            def med(xs):
                return f"{statistics.median(xs):.3f} s" if xs else "–"
            accs = ", ".join(f"{100 * r['accuracy']:.2f}" for r in ok)
            lines.append(f"| {a} | {d} | {len(ok)}/{len(sel)} | {100 * acc:.2f} % ({accs}) | "
                         f"{100 * delta:+.2f} | {med(det)} | {med(rec)} | "
                         f"{med(nxt)}{f', {max(nxt):.3f} s' if nxt else ''} |")
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    (out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "experiments/results/failures"))
    ap.add_argument("--algorithms", nargs="+", default=["ssgd", "odsgd", "daso", "asgd",
                                                         "smega2"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--deaths", nargs="+", default=["0", "1", "2", "server"],
                    help="0, 1, 2 (ranks killed one after another) or server (the PS; PS "
                         "algorithms only)")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--mtbf-steps", type=float, default=None,
                    help="kill at exponentially distributed times of this mean (in steps) "
                         "instead of the fixed points")
    args = ap.parse_args()
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    rows = []
    for seed in args.seeds:
        for a in args.algorithms:
            for d in args.deaths:
                d = d if d == "server" else int(d)
                if d == "server" and a in SYNC:
                    continue
                rows.append(run_one(out, a, d, seed, args.timeout, args.mtbf_steps))
                print(json.dumps(rows[-1]), flush=True)
    load1 = os.getloadavg()
    header = (f"# Surviving dead ranks (issue 15)\n\nCommand: `python experiments/probes/"
              f"failures.py {shlex.join(sys.argv[1:])}` on {os.cpu_count()} cores, "
              f"{time.strftime('%Y-%m-%d %H:%M')}; load average before "
              f"{', '.join(f'{x:.2f}' for x in load0)}, after "
              f"{', '.join(f'{x:.2f}' for x in load1)} (4 ranks on these cores: "
              "oversubscribed 2x).\n\n" + __doc__.split("\n\n")[1].replace("\n", " "))
    print(report(out, rows, header))


# ---------------------------------------------------------------------------------------------
# Issue 23: kills at random times over the whole run (start-up included), every route.

RANDOM_CLI = ["train", "--dataset", "fashion-mnist", "--model", "lenet", "--epochs", "2",
              "--batch-size", "32", "--train-limit", "12000", "--test-limit", "2000",
              "--progress", "off", "--seed", "0"]
LOOP = ["examples/train_mnist.py", "--algorithm", "ssgd", "--epochs", "2",
        "--train-limit", "12000", "--log-interval", "40", "--seed", "0"]
ELASTIC = ["tests/horovod_elastic_script.py", "--epochs", "2", "--limit", "4000",
           "--batch-size", "16", "--commit-every", "4"]
LOOP_ELASTIC = ["examples/train_mnist_elastic.py", "--dataset", "fashion-mnist", "--epochs", "6",
                "--limit", "24000", "--batch-size", "16", "--commit-every", "4"]
# route -> (kind, algorithm, the ranks one of which is killed)
ROUTES = {
    "ssgd": ("cli", "ssgd", (0, 1, 2, 3)),
    "odsgd": ("cli", "odsgd", (0, 1, 2, 3)),
    "daso": ("cli", "daso", (0, 1, 2, 3)),
    "asgd-worker": ("cli", "asgd", (1, 2, 3)),
    "asgd-server": ("cli", "asgd", (0,)),
    "smega2-worker": ("cli", "smega2", (1, 2, 3)),
    "smega2-server": ("cli", "smega2", (0,)),
    # the CLI with two shard servers (ranks 0 and 1, --ps-ranks 2), two workers
    "asgd-shards": ("cli", "asgd", (0, 1, 2, 3)),
    "asgd-shard-servers": ("cli", "asgd", (0, 1)),     # a shard server killed
    # --grow-back: the dead rank's place refilled (the server's spawn for a PS run)
    "ssgd-grow": ("cli", "ssgd", (0, 1, 2, 3)),
    "asgd-grow-worker": ("cli", "asgd", (1, 2, 3)),
    "asgd-grow-server": ("cli", "asgd", (0,)),
    "odsgd-grow": ("cli", "odsgd", (0, 1, 2, 3)),
    "daso-grow": ("cli", "daso", (0, 1, 2, 3)),
    "diloco-grow": ("cli", "diloco", (0, 1, 2, 3)),
    "own-loop": ("loop", "ssgd", (0, 1, 2, 3)),
    "elastic": ("elastic", "ssgd", (0, 1, 2, 3)),
    "own-loop-elastic": ("elastic", "ssgd", (0, 1, 2, 3)),     # hpcasync.elastic
    "own-loop-elastic-daso": ("elastic", "daso", (0, 1, 2, 3)),
    # a parameter-server rule in hpcasync.elastic: a worker's death absorbed, the server's taken
    # over (rank 0 serves)
    "own-loop-elastic-asgd": ("elastic", "asgd", (0, 1, 2, 3)),
    "own-loop-elastic-smega2": ("elastic", "smega2", (0, 1, 2, 3)),
    "own-loop-elastic-shat": ("elastic", "shat", (0, 1, 2, 3)),
    # the same with HPCASYNC_GROW_BACK=1: a dead worker replaced by the server's spawn, from its
    # last commit; a dead server taken over, and replaced in the new server's worker place
    "own-loop-elastic-asgd-grow": ("elastic", "asgd", (0, 1, 2, 3)),
    "own-loop-elastic-shat-grow": ("elastic", "shat", (0, 1, 2, 3)),
    # the server killed, with grow-back: taken over, a replacement in the new server's place
    "own-loop-elastic-asgd-grow-server": ("elastic", "asgd", (0,)),
    # two shard servers (ranks 0 and 1, ps_ranks=2), two workers: a dead shard server taken over
    "own-loop-elastic-asgd-shards": ("elastic", "asgd", (0, 1, 2, 3)),
    "own-loop-elastic-asgd-shard-servers": ("elastic", "asgd", (0, 1)),    # a server killed
    # without ULFM: `hpcasync launch --max-restarts 2 -- examples/train_mnist_elastic.py` with
    # State.persist (--checkpoint-dir): the job ends, the supervisor runs it again, every rank goes
    # on from the newest commit written
    "own-loop-restart": ("restart", "ssgd", (0, 1, 2, 3)),
    "own-loop-restart-asgd": ("restart", "asgd", (0, 1, 2, 3)),
    "own-loop-restart-daso": ("restart", "daso", (0, 1, 2, 3)),
    "own-loop-restart-odsgd": ("restart", "odsgd", (0, 1, 2, 3)),
    "own-loop-restart-localsgd": ("restart", "localsgd", (0, 1, 2, 3)),
}
# ended: a non-zero exit within 30 s of the kill; HANG (random study): no exit T + 60 s after the
# kill, T the undisturbed run's length (a run may have to do all of it again: a restart)
ENDED_WITHIN, HANG_AFTER = 30.0, 60.0


def _rank_pids(launcher: int) -> dict[int, int]:
    """MPI rank -> pid of the launcher's direct children that carry a rank (the CLI's start-up
    watchers are the ranks' own children, so they are never picked)."""
    found = {}
    for pid in _children(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                found[int(kv.split(b"=", 1)[1])] = pid
    return found


def _procs_where(field: int, value: int) -> list[int]:
    """The pids whose ``/proc/PID/stat`` field ``field`` (counted after the command: 1 the
    parent, 2 the process group) is ``value``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[field]) == value:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _children(parent: int) -> list[int]:
    """The pids whose parent is ``parent`` (``hpcasync launch``: its job's launcher, which runs
    in a session of its own)."""
    return _procs_where(1, parent)


def _session_pids(pgid: int) -> list[int]:
    return _procs_where(2, pgid)


def _route_cmd(route: str, rid: str, runs: Path) -> tuple[list[str], Path]:
    """The command and the file whose lines mark the run's progress."""
    kind, algorithm, _ = ROUTES[route]
    launch = [*mpiexec_command(4, ft=True), sys.executable]
    if kind == "cli":
        metrics = runs / f"{rid}.jsonl"
        metrics.unlink(missing_ok=True)
        return [*launch, "-m", "hpcasync.cli", *RANDOM_CLI, "--algorithm", algorithm,
                "--metrics", str(metrics), *EXTRA.get(algorithm, []),
                *(["--ps-ranks", "2"] if "-shard" in route else []),
                *(["--grow-back"] if "-grow" in route else [])], \
            metrics.with_name(metrics.name + ".partial")   # renamed to ``metrics`` at the end
    if kind == "loop":
        return [*launch, *LOOP], runs / f"{rid}.out"
    outdir = runs / f"{rid}.elastic"
    if outdir.exists():
        for f in outdir.iterdir():
            f.unlink()
    outdir.mkdir(exist_ok=True)
    if kind == "restart":
        ckpt = runs / f"{rid}.ckpt"
        shutil.rmtree(ckpt, ignore_errors=True)
        return [sys.executable, "-m", "hpcasync.cli", "launch", "-n", "4", "--max-restarts", "2",
                "--", *LOOP_ELASTIC, "--algorithm", algorithm, "--epochs", "30",
                *(["--ranks-per-node", "2"] if algorithm == "daso" else []),
                "--checkpoint-dir", str(ckpt), "--checkpoint-every", "50", "--out", str(outdir)], \
            runs / f"{rid}.out"
    script = {"own-loop-elastic": LOOP_ELASTIC,
              "own-loop-elastic-daso": [*LOOP_ELASTIC, "--algorithm", "daso", "--ranks-per-node",
                                        "2"]}.get(route, ELASTIC)
    if route.startswith("own-loop-elastic-") and algorithm != "daso":
        script = [*LOOP_ELASTIC, "--algorithm", algorithm,
                  *(["--ps-ranks", "2"] if "-shard" in route else [])]
    return [*launch, *script, "--out", str(outdir)], runs / f"{rid}.out"


def _phase(lines: list[tuple[float, str]], at: float, kind: str) -> str:
    """Where the run was at ``at`` (s after launch), from the progress lines seen by then."""
    seen = [text for t, text in lines if t <= at]
    if kind == "cli":
        events = [json.loads(t).get("event") for t in seen if t.startswith("{")]
        epochs = events.count("epoch")
        if "summary" in events:
            return "end (summary written)"
        if not events:
            return "start-up (no metrics yet)"
        return f"training epoch {epochs + 1}" if epochs < 2 else "final (eval, gathers)"
    if kind == "loop":
        train = [t for t in seen if t.startswith("Train Epoch:")]
        if any("Test set" in t for t in seen):
            return "end (test printed)"
        return f"training epoch {train[-1].split()[2]}" if train else "start-up (no output yet)"
    return "unknown (the script logs nothing before its end)"


def run_random(out: Path, route: str, index: int, kill_at: float | None, rank: int | None,
               length: float = 0.0) -> dict:
    """One run of ``route``; ``kill_at`` None: undisturbed. Returns its row. ``length``: the
    undisturbed run's wall time; a killed run still going ``length`` + 60 s after the kill is a
    hang (a restart without ULFM begins again from the start, or from an early commit)."""
    kind, algorithm, _ = ROUTES[route]
    runs = out / "runs_random"
    rid = f"{route}__{'base' if kill_at is None else f'kill{index}'}"
    cmd, progress = _route_cmd(route, rid, runs)
    env = child_env()
    env.update(PYTHONPATH=str(REPO), PYTHONFAULTHANDLER="1")
    if kind == "elastic" and "-grow" in route:
        env["HPCASYNC_GROW_BACK"] = "1"
    stdout, stderr = runs / f"{rid}.out", runs / f"{rid}.err"
    row = {"route": route, "run": rid, "kill_at_s": None if kill_at is None else round(kill_at, 2),
           "rank": rank}
    lines: list[tuple[float, str]] = []
    with open(stdout, "w") as so, open(stderr, "w") as se:
        t0 = time.time()
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=so, stderr=se,
                                start_new_session=True)
        killed_unix = None
        deadline = t0 + 600
        while True:
            now = time.time()
            try:                    # (the run renames its .partial stream at its end)
                raw = progress.read_text()
            except FileNotFoundError:
                raw = None
            if raw is not None:
                text = raw.splitlines()
                complete = text if raw.endswith("\n") else text[:-1]
                lines += [(now - t0, s) for s in complete[len(lines):]]
            if proc.poll() is not None:
                break
            if killed_unix is None and kill_at is not None and now - t0 >= kill_at:
                launcher = (proc.pid if kind != "restart" else       # (the supervisor's child)
                            next(iter(_children(proc.pid)), proc.pid))
                pid = _rank_pids(launcher).get(rank)
                if pid is not None:          # not forked yet: killed as soon as it is
                    os.kill(pid, signal.SIGKILL)
                    killed_unix = time.time()
                    row["killed_s"] = round(killed_unix - t0, 2)
                    row["phase"] = ("launcher start-up (ranks just forked)" if not lines
                                    and now - t0 > kill_at + 0.2 else
                                    _phase(lines, killed_unix - t0, kind))
                    deadline = min(killed_unix + length + HANG_AFTER, t0 + 600)
            if now > deadline:
                break
            time.sleep(0.02)
        if proc.poll() is None:              # HANG: every rank's Python stacks, then SIGKILL
            row["outcome"] = "HANG"
            jobs = [proc.pid, *_children(proc.pid)]     # (restart: the supervisor's job too)
            for p in [r for j in jobs for r in _rank_pids(j).values()]:
                os.kill(p, signal.SIGABRT)   # PYTHONFAULTHANDLER=1: all threads' tracebacks
            time.sleep(3)
            for j in jobs:
                try:
                    os.killpg(j, signal.SIGKILL)
                except OSError:
                    pass
            proc.wait()
        end = time.time()
        for p in _session_pids(proc.pid):    # ranks left behind by an ended launcher
            row.setdefault("left_behind", []).append(p)
            os.kill(p, signal.SIGKILL)
    row["rc"] = proc.returncode
    row["wall_s"] = round(end - t0, 2)
    row["first_line_s"] = round(lines[0][0], 2) if lines else None    # the start-up's end
    err = stderr.read_text(errors="replace")
    errors = ([ln for ln in err.splitlines() if "hpcasync: error" in ln or "died" in ln]
              or [ln for ln in err.splitlines() if "error" in ln.lower() or "noticed" in ln])
    row["error_lines"] = len([ln for ln in err.splitlines() if "hpcasync: error" in ln])
    row["first_error"] = errors[0].replace("\x00", "")[:240] if errors else None
    metrics = runs / f"{rid}.jsonl"
    result = _result(kind, metrics, runs / f"{rid}.elastic", stdout)
    row.update(result)
    if kill_at is not None and killed_unix is None:
        row["outcome"] = "not killed (run over before the kill)"
    elif "outcome" not in row:
        after = end - killed_unix if killed_unix else None
        if row["rc"] == 0 and result.get("done"):
            row["outcome"] = "survived" if killed_unix else "undisturbed"
        elif row["rc"] == 0:
            row["outcome"] = "exit 0 WITHOUT a result"
        elif after is not None and after <= ENDED_WITHIN:
            row["outcome"] = "ended"
        else:
            row["outcome"] = "ended late" if after is not None else "failed (undisturbed)"
        if after is not None:
            row["kill_to_exit_s"] = round(after, 2)
    if killed_unix is not None and kind == "cli" and metrics.exists():
        row["recovery_s"] = _recovery(metrics, killed_unix)
    if killed_unix is not None:
        row["phase"] = _refine_phase(row, kind, metrics, runs / f"{rid}.elastic", killed_unix)
    return row


def _refine_phase(row: dict, kind: str, metrics: Path, outdir: Path, killed_unix: float) -> str:
    """The phase seen live, made precise by what the run recorded about the death."""
    first = row.get("first_error") or ""
    if row.get("outcome") == "HANG":
        dump = (metrics.parent / f"{row['run']}.err").read_text(errors="replace")
        if "in init_mpi" in dump:
            return "start-up: the survivors in MPI_Init (their faulthandler stacks)"
    if "during start-up" in first:
        return "start-up, before MPI was up (the start-up watcher's line)"
    if kind == "cli" and metrics.exists():
        records = read_metrics(metrics)
        s = [r for r in records if r["event"] == "summary"]
        s = s[-1] if s else {}
        for f in s.get("rank_failures", []):
            e, b = f["position"][:2]
            return f"epoch {e}, {b} steps done (the survivors' position)"
        for f in s.get("server_failures", []):
            return f"server at θ version {f['theta_version']} ({100 * f['share_done']:.0f} % done)"
        for r in records:
            if r["event"] == "worker_failed":
                return f"worker after {r['pushes']} pushes (PS version {r['ps_version']})"
        if s and not s.get("failed_ranks") and not s.get("failed_workers"):
            return "end: training over, no failure recorded (the rank was exiting)"
    if kind == "restart" and outdir.exists():
        said = (metrics.parent / f"{row['run']}.err").read_text(errors="replace")
        restored = {json.loads(p.read_text()).get("restored") for p in outdir.glob("rank*.json")}
        if "restart 1 of" not in said:
            return ("end (the job finished: the kill came after the killed rank's end)"
                    if row.get("rc") == 0 else "start-up (not restarted)")
        if restored - {None, 0}:
            own = "; each rank its own" if "each rank its own" in said else ""
            return (f"training (restarted from a written commit: steps "
                    f"{sorted(restored - {None})}{own})")
        return "start-up or before the first commit was written (restarted from the beginning)"
    if kind == "elastic" and outdir.exists():
        results = {p.stem: (p.stat().st_mtime, json.loads(p.read_text()))
                   for p in outdir.glob("rank*.json")}
        if f"rank{row['rank']}" in results and results[f"rank{row['rank']}"][0] <= killed_unix:
            return "end (the killed rank had written its result)"
        records = [f for _, r in results.values() for f in r.get("failures", [])]
        if any(f.get("set_up_again") for f in records):
            return "set-up (a rank died before the server was set up; set up again)"
        if any(f.get("shard_sources") for f in records):
            return "training (a shard server died; a worker took its place)"
        if any(f.get("server") is not None for f in records):
            return "training (the server died; a worker took over)"
        if any(f.get("absorbed") for f in records):
            return "training (a worker died; retired, absorbed at the end)"
        if any(r["resets"] for _, r in results.values()):
            return "training (the survivors reset to a smaller world)"
    return row.get("phase", "–")


def _result(kind: str, progress: Path, outdir: Path, stdout: Path) -> dict:
    if kind == "cli":
        if not progress.exists():
            return {"done": False}
        summary = [r for r in read_metrics(progress) if r["event"] == "summary"]
        return ({"done": True, "accuracy": summary[-1]["test_accuracy"],
                 "world_after": summary[-1].get("world_size")} if summary else {"done": False})
    if kind == "loop":
        acc = [ln for ln in stdout.read_text(errors="replace").splitlines()
               if "Test set" in ln and "Accuracy:" in ln]
        return ({"done": True, "accuracy": float(acc[-1].rsplit("Accuracy:", 1)[1].strip(" %"))
                 / 100} if acc else {"done": False})
    results = [json.loads(p.read_text()) for p in outdir.glob("rank*.json")] \
        if outdir.exists() else []
    if not results:
        return {"done": False}
    return {"done": True, "survivors": len(results),
            "state_steps": max(r["steps"] for r in results),    # (a PS: a worker's, not 0)
            "replicas_equal": len({r["params"] for r in results}) == 1}


def _recovery(metrics: Path, killed_unix: float) -> float | None:
    """Kill -> the next completed step (sync: detected + next_step_s; PS worker: the server's
    detection, it serves the next push at once; PS server: the new server's first push)."""
    records = read_metrics(metrics)
    summary = [r for r in records if r["event"] == "summary"]
    if not summary:
        return None
    s = summary[-1]
    for f in s.get("rank_failures", []):
        if f.get("next_step_s") is not None:
            return round(f["detected_unix"] + f["next_step_s"] - killed_unix, 3)
    for f in s.get("server_failures", []):
        if "first_push_unix" in f:
            return round(f["first_push_unix"] - killed_unix, 3)
    for r in records:
        if r["event"] == "worker_failed":
            return round(r["detected_unix"] - killed_unix, 3)
    return None


def random_study(out: Path, n: int, routes: list[str], seed: int,
                 after_startup: bool = False) -> list[dict]:
    """``n`` kills per route at uniformly random times in [0, T] (T: the undisturbed run's
    length), or with ``after_startup`` in [S, T] for the CLI's routes, S when the undisturbed
    run wrote its first metrics line (its start-up over: the kills land in training)."""
    (out / "runs_random").mkdir(parents=True, exist_ok=True)
    rows, base = [], {}
    for route in routes:
        row = run_random(out, route, 0, None, None)
        base[route] = row
        rows.append(row)
        print(json.dumps(row), flush=True)
    for i in range(n):                       # route after route, so a cut-short study has all
        for route in routes:
            rng = random.Random(f"{seed}/{route}/{i}")
            t = base[route]["wall_s"]
            cli = ROUTES[route][0] == "cli"      # (the scripts print nothing at their start)
            lo = (base[route].get("first_line_s") or 0.0) if after_startup and cli else 0.0
            row = run_random(out, route, i, rng.uniform(lo, t), rng.choice(ROUTES[route][2]),
                             length=t)
            row["T_s"] = t
            if "accuracy" in row and "accuracy" in base[route]:
                row["delta_acc"] = round(row["accuracy"] - base[route]["accuracy"], 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "random_rows.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def random_report(out: Path, rows: list[dict], header: str) -> str:
    lines = [header, "", "| route | run | T (s) | kill at (s) | rank | phase hit | outcome | "
             "kill → exit (s) | kill → next step (s) | accuracy (Δ vs undisturbed) | "
             "first error line |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = (f"{100 * r['accuracy']:.2f} %" + (f" ({100 * r['delta_acc']:+.2f})"
                                                  if "delta_acc" in r else "")
               if "accuracy" in r else
               (f"{r['survivors']} survivors, {r['state_steps']} steps, replicas "
                f"{'equal' if r['replicas_equal'] else 'DIFFER'}" if "survivors" in r else "–"))
        err = (r.get("first_error") or "").replace("|", "\\|")
        lines.append(
            f"| {r['route']} | {r['run']} | {r.get('T_s', r['wall_s'])} | "
            f"{r.get('killed_s', r['kill_at_s']) if r['kill_at_s'] is not None else '–'} | "
            f"{r['rank'] if r['rank'] is not None else '–'} | {r.get('phase', '–')} | "
            f"{r['outcome']} (rc {r['rc']}) | {r.get('kill_to_exit_s', '–')} | "
            f"{r.get('recovery_s') if r.get('recovery_s') is not None else '–'} | {acc} | "
            f"{err[:140] or '–'} |")
    counts: dict[str, dict[str, int]] = {}
    for r in rows:
        if r["kill_at_s"] is not None:
            counts.setdefault(r["route"], {}).setdefault(r["outcome"], 0)
            counts[r["route"]][r["outcome"]] += 1
    lines += ["", "Per route:", "", "| route | outcomes | kills hit: start-up / training / "
              "the end | kill → next step (median, max) |", "|---|---|---|---|"]
    for route, c in counts.items():
        rec = [r["recovery_s"] for r in rows if r["route"] == route
               and r.get("recovery_s") is not None]
        phases = [str(r.get("phase", "")) for r in rows if r["route"] == route
                  and r.get("killed_s") is not None]
        start = sum(p.startswith(("start-up", "launch")) for p in phases)
        end = sum(p.startswith("end") for p in phases)
        unknown = sum(p.startswith(("unknown", "–")) for p in phases)
        lines.append(f"| {route} | {', '.join(f'{k} {v}' for k, v in sorted(c.items()))} | "
                     f"{start} / {len(phases) - start - end - unknown} / {end}"
                     + (f" (+{unknown} unknown)" if unknown else "") + " | "
                     + (f"{statistics.median(rec):.3f} s, {max(rec):.3f} s" if rec else "–")
                     + " |")
    text = "\n".join(lines) + "\n"
    (out / "random.md").write_text(text)
    return text


def refresh_report(out: Path) -> None:
    """Rewrite ``OUT/random.md`` from ``OUT/random_rows.json`` and the logs (the phases refined
    again), keeping its header."""
    rows = json.loads((out / "random_rows.json").read_text())
    for r in rows:
        err = (out / "runs_random" / f"{r['run']}.err").read_text(errors="replace").splitlines()
        errors = ([ln for ln in err if "hpcasync: error" in ln or "died" in ln]
                  or [ln for ln in err if "error" in ln.lower() or "noticed" in ln])
        r["first_error"] = errors[0].replace("\x00", "")[:240] if errors else None
        if r.get("killed_s") is not None:
            kind = ROUTES[r["route"]][0]
            r["phase"] = _refine_phase(r, kind, out / "runs_random" / f"{r['run']}.jsonl",
                                       out / "runs_random" / f"{r['run']}.elastic", 0.0)
    (out / "random_rows.json").write_text(json.dumps(rows, indent=1) + "\n")
    header = (out / "random.md").read_text().split("\n| route | run |")[0].rstrip("\n")
    random_report(out, rows, header)


if __name__ == "__main__":
    if "--refresh-report" in sys.argv:
        refresh_report(Path(sys.argv[sys.argv.index("--refresh-report") + 1]))
    elif "--random" in sys.argv:
        ap = argparse.ArgumentParser(description="issue 23: kills at random times")
        ap.add_argument("--random", type=int, required=True, help="runs per route")
        ap.add_argument("--routes", nargs="+", default=list(ROUTES), choices=list(ROUTES))
        ap.add_argument("--seed", type=int, default=23)
        ap.add_argument("--after-startup", action="store_true",
                        help="the CLI's routes: kill in [S, T], S when the undisturbed run's "
                             "first metrics line appeared (kills in training, not in the "
                             "start-up)")
        ap.add_argument("--out", default=str(REPO / "experiments/results/failures"))
        args = ap.parse_args()
        out = Path(args.out)
        load0, up0, t_start = os.getloadavg(), subprocess.run(
            ["uptime"], capture_output=True, text=True).stdout.strip(), time.time()
        rows = random_study(out, args.random, args.routes, args.seed, args.after_startup)
        up1 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        header = (
            "# Kills at random times, every route (issue 23)\n\n"
            f"Command: `python experiments/probes/failures.py {shlex.join(sys.argv[1:])}` on "
            f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M', time.gmtime(t_start))} "
            f"UTC, {(time.time() - t_start) / 60:.1f} min in all. `uptime` before: `{up0}`; "
            f"after: `{up1}`. "
            + ("Nothing else ran on the machine during the study.\n\n" if load0[0] < 1.0 else
               "The machine was shared with other work (other engineers' builds and tests) "
               "during the study, so every time here is an upper bound.\n\n")
            + "Each route: one undisturbed run (its length is T), then runs in which one rank "
            "(chosen at random among the route's ranks) is SIGKILLed from outside at a "
            + ("uniformly random time in [S, T] after launch, S when the undisturbed run wrote "
               "its first metrics line, for the CLI's routes (`--after-startup`: kills in "
               "training; [0, T] for the scripts)"
               if args.after_startup else "uniformly random time in [0, T] after launch")
            + " (seeded; a rank not forked yet is "
            "killed as soon as it is). All under `mpiexec --oversubscribe --with-ft ulfm -n 4`. "
            "CLI: `hpcasync train` (LeNet, Fashion-MNIST's first 12000 images, 2 epochs, "
            "batch 32, test on 2000); own loop: `examples/train_mnist.py --algorithm ssgd` "
            "(same data); elastic: `tests/horovod_elastic_script.py` (linear model, 4000 "
            "images, 2 epochs, commit every 4 steps); own-loop-elastic: "
            "`examples/train_mnist_elastic.py` (linear model, Fashion-MNIST's first 24000 "
            "images, 6 epochs, batch 16, commit every 4 steps; `-daso`: 2 virtual nodes of 2, "
            "epochs 1-5 cycling with a global send every batch, epoch 6 blocking). Outcomes: *survived* (exit 0 with the "
            "result), *ended* (non-zero exit within 30 s of the kill), *ended late* (after "
            "30 s), *HANG* (no exit T + 60 s after the kill, T the undisturbed run's length: every rank's stacks dumped with "
            "SIGABRT + faulthandler, then killed). *phase hit*: from the run's own records "
            "(metrics lines / printed lines) seen by the time of the kill. *kill → next step*: "
            "from the run's recovery records (`rank_failures`, `worker_failed`, "
            "`server_failures`). Logs: `runs_random/`.")
        print(random_report(out, rows, header))
    else:
        main()
