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
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
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
                  "--daso-cooldown-epochs", "1"]}
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


if __name__ == "__main__":
    main()
