"""Issue 24's study: deaths at exponential gaps (a job MTBF) on 4 ranks, three ways of living with
them — shrink only (ULFM), grow back (ULFM, ``--grow-back``), restart from a checkpoint
(``hpcasync launch --max-restarts``, no ULFM) — against undisturbed runs; then the model of
:mod:`hpcasync.sim.mtbf` at 64-1024 ranks with the costs measured here.

Real runs: ``hpcasync train --algorithm ssgd`` on 4 ranks (``--oversubscribe``), LeNet, the full
Fashion-MNIST (Debian's), 2 epochs, batch 32, ``--seed 0`` in every run (so the undisturbed,
grow-back and restarted runs should end on the same parameters: ``params_sha256``). Kills: a
SIGKILL, from outside, of a random live rank process (the launcher's children that carry a rank:
joiners included), at exponential gaps of mean ``--mtbf`` seconds of *training* (seeded by the
study seed; the same kill times for every mode of a seed). The clock runs only while the run
trains: a kill that falls due during start-up, a recovery, a join or a restart waits until the
metrics stream shows a step again (the model makes the same assumption); no kill after the last
epoch's record (a death at the final gathers can hang a ULFM run: docs/design/growth.md); at most
``--max-kills`` kills per run.

    python experiments/probes/mtbf.py --seeds 0 1 2 --out experiments/results/mtbf
    python experiments/probes/mtbf.py --report experiments/results/mtbf   # the report again

Writes ``OUT/runs/<run>.json`` (one row), ``<run>.jsonl`` (the metrics), ``<run>.err`` (stderr)
and ``OUT/results.md`` (the command, ``uptime`` before and after, the tables, the model's table,
then ``OUT/notes.md``: what the numbers say, written by hand).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
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

TRAIN = ["--algorithm", "ssgd", "--dataset", "fashion-mnist", "--model", "lenet",
         "--epochs", "2", "--batch-size", "32", "--progress", "off", "--seed", "0",
         "--log-every", "10"]
EPOCHS = 2
CKPT_EVERY = 50                      # steps (~2.5 s of training here)
MODES = ("base-ulfm", "shrink", "grow", "base-restart", "restart")
ULFM = ("base-ulfm", "shrink", "grow")
TRAINING = ("step", "checkpoint", "epoch")
POLL = 0.02


# --- processes ------------------------------------------------------------------------------------

def _stat(pid: int) -> tuple[str, int] | None:
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return rest[0], int(rest[1])          # state, parent
    except (OSError, ValueError, IndexError):
        return None


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            st = _stat(int(d.name))
            if st:
                children.setdefault(st[1], []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _has_rank(pid: int) -> bool:
    try:
        return b"\0OMPI_COMM_WORLD_RANK=" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def live_ranks(root: int) -> list[int]:
    """Pids of the rank processes under ``root`` (a launcher's children carrying a rank, joiners
    included; not the ranks' own start-up watchers, whose parent carries one too), not zombies."""
    found = []
    for pid in _descendants(root):
        st = _stat(pid)
        if st and st[0] not in "ZX" and _has_rank(pid) and not _has_rank(st[1]):
            found.append(pid)
    return sorted(found)


def kill_tree(root: int) -> None:
    for pid in reversed(_descendants(root)):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.kill(root, signal.SIGKILL)
    except OSError:
        pass


# --- one run --------------------------------------------------------------------------------------

def schedule(seed: int, mtbf: float, max_kills: int) -> list[float]:
    """Kill times in seconds of training: exponential gaps of mean ``mtbf``."""
    rng, at, out = random.Random(f"mtbf/{seed}"), 0.0, []
    for _ in range(max_kills):
        at += rng.expovariate(1.0 / mtbf)
        out.append(round(at, 3))
    return out


def _events(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines(keepends=True):
        if line.endswith("\n"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def command(mode: str, metrics: Path, ckpt: Path, max_restarts: int) -> list[str]:
    if mode in ULFM:
        return [*mpiexec_command(4, ft=True), sys.executable, "-m", "hpcasync.cli", "train",
                *TRAIN, "--metrics", str(metrics), *(["--grow-back"] if mode == "grow" else [])]
    return [sys.executable, "-m", "hpcasync.cli", "launch", "-n", "4", "--max-restarts",
            str(max_restarts), "--", "train", *TRAIN, "--metrics", str(metrics),
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(CKPT_EVERY)]


def run_one(out: Path, mode: str, seed: int, kills_at: list[float], timeout: float,
            max_restarts: int) -> dict:
    runs = out / "runs"
    rid = f"{mode}__seed{seed}"
    metrics = runs / f"{rid}.jsonl"
    for p in runs.glob(f"{rid}.jsonl*"):
        p.unlink()
    ckpt = Path("/tmp/hpcasync-mtbf-ckpt") / rid
    shutil.rmtree(ckpt, ignore_errors=True)
    partial = metrics.with_name(metrics.name + ".partial")
    cmd = command(mode, metrics, ckpt, max_restarts)
    env = child_env()
    env.update(PYTHONPATH=str(REPO))
    rng = random.Random(f"mtbf-rank/{seed}")
    row = {"run": rid, "mode": mode, "seed": seed, "kills_due_train_s": kills_at,
           "load_before": [round(x, 2) for x in os.getloadavg()],
           "command": shlex.join(cmd), "kills": []}
    err = runs / f"{rid}.err"
    t0 = time.time()
    with open(err, "w") as se:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=se, stderr=subprocess.STDOUT,
                                start_new_session=True)
        train_clock, last, paused, pending = 0.0, time.time(), True, list(kills_at)
        kill_mark: tuple[int, int] | None = None      # (inode, events seen) at the last kill
        marker = "rank_failed"
        started = False
        while proc.poll() is None:
            now = time.time()
            if now - t0 > timeout:
                row["outcome"] = "HANG"
                kill_tree(proc.pid)
                break
            try:
                inode = partial.stat().st_ino
            except OSError:
                inode = None
            ev = _events(partial) if inode else []
            names = [e["event"] for e in ev]
            final = sum(n == "epoch" for n in names) >= EPOCHS or "summary" in names
            if kill_mark is not None:        # paused since a kill: wait for marker, then a step
                if mode in ULFM:             # the same stream: a recovery record, then a step
                    later = names[kill_mark[1]:] if inode == kill_mark[0] else names
                    back = marker in later and "step" in later[later.index(marker):]
                else:                        # a restart: a new attempt's stream with a step
                    back = inode is not None and inode != kill_mark[0] and "step" in names
                if back:
                    row["kills"][-1]["kill_to_training_s"] = round(now - row["kills"][-1]
                                                                   ["unix"], 3)
                    kill_mark = None
            training = (kill_mark is None and bool(names) and names[-1] in TRAINING
                        and "step" in names and not final)
            if training:
                started = True
                if not paused:
                    train_clock += now - last
                paused = False
            else:
                paused = True
            last = now
            if training and pending and train_clock >= pending[0]:
                pids = [p for p in live_ranks(proc.pid)
                        if p not in {k["pid"] for k in row["kills"]}]
                if pids:
                    pid = rng.choice(pids)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pid = None
                    if pid:
                        pending.pop(0)
                        row["kills"].append({"pid": pid, "unix": round(time.time(), 4),
                                             "wall_s": round(time.time() - t0, 2),
                                             "train_s": round(train_clock, 2),
                                             "live_before": len(pids)})
                        kill_mark = (inode, len(ev))
            time.sleep(POLL)
        proc.wait()
    row["rc"] = proc.returncode
    row["load_after"] = [round(x, 2) for x in os.getloadavg()]
    row["wall_s"] = round(time.time() - t0, 2)
    row["train_clock_s"] = round(train_clock, 2)
    row["started_training"] = started
    row.setdefault("outcome", "ok" if proc.returncode == 0 else f"rc {proc.returncode}")
    row.update(_read_results(metrics, err, mode))
    (runs / f"{rid}.json").write_text(json.dumps(row, indent=1) + "\n")
    return row


def _read_results(metrics: Path, err: Path, mode: str) -> dict:
    res: dict = {}
    records = _events(metrics) if metrics.exists() else []
    summary = [r for r in records if r["event"] == "summary"]
    if summary:
        s = summary[-1]
        res.update(accuracy=s["test_accuracy"], world_size=s["world_size"], steps=s["steps"],
                   params_sha256=s["params_sha256"], train_wall_s=s["wall_time_s"],
                   recovery_s=[f["recovery_s"] for f in s.get("rank_failures", [])],
                   next_step_s=[f["next_step_s"] for f in s.get("rank_failures", [])],
                   next_step_unix=[f["detected_unix"] + f["next_step_s"]
                                   for f in s.get("rank_failures", [])
                                   if f.get("next_step_s") is not None],
                   join_s=[j["join_s"] for j in s.get("rank_joins", [])],
                   spawn_s=[j["spawn_s"] for j in s.get("rank_joins", [])])
    res["checkpoints"] = sum(r["event"] == "checkpoint" for r in records)
    text = err.read_text(errors="replace")
    res["restart_lines"] = [ln for ln in text.splitlines() if "hpcasync launch: restart" in ln]
    res["resumed_after_report_s"] = [float(m) for m in re.findall(
        r"training resumed ([0-9.]+) s after the death", text)]
    # work lost by a restart: steps between the checkpoint resumed from and the last step logged
    lost = []
    said = r"hpcasync launch: restart \d+ of \d+: .*resuming from \S*ckpt-e(\d+)-s(\d+)\.pt"
    for k, m in enumerate(re.findall(said, text), 1):
        att = _events(metrics.with_name(f"{metrics.name}.attempt-{k}.partial"))
        steps = [r for r in att if r["event"] == "step"]
        if steps:
            lost.append({"checkpoint_step": int(m[1]), "last_logged": [steps[-1]["epoch"],
                                                                       steps[-1]["batch"]]})
    res["restart_lost"] = lost
    res["error_lines"] = [ln[:300] for ln in text.splitlines()
                          if "hpcasync: error" in ln or "Traceback" in ln][:5]
    return res


# --- the report -----------------------------------------------------------------------------------

def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def _fmt(x, spec=".1f", none="–"):
    return none if x is None else format(x, spec)


def kill_to_next(r: dict) -> list[float | None]:
    """Per death: seconds from the kill to the next completed step — under ULFM from the run's
    records (``detected_unix + next_step_s`` of its ``rank_failures``, in order), for a restart
    from the probe's watch (the first step record of the next attempt; they are written every
    10 steps)."""
    if r["mode"] in ULFM:
        nxt = r.get("next_step_unix", [])
        return [round(nxt[i] - k["unix"], 3) if i < len(nxt) else None
                for i, k in enumerate(r["kills"])]
    return [k.get("kill_to_training_s") for k in r["kills"]]


def checkpoint_cost(repeats: int = 20) -> float:
    """Seconds to write one checkpoint of LeNet's model and momentum-SGD state with
    :func:`hpcasync.checkpoint.save_checkpoint` (atomic: temp file, fsync, rename), the mean of
    ``repeats`` writes to /tmp."""
    import tempfile

    import torch

    from hpcasync.checkpoint import save_checkpoint
    from hpcasync.models import build_model

    model = build_model("lenet", (1, 28, 28))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model(torch.zeros(2, 1, 28, 28)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        for i in range(repeats):
            save_checkpoint(Path(d) / f"c{i}.pt", state, algorithm="ssgd", model="lenet")
        return (time.perf_counter() - t0) / repeats


def measured_costs(rows: list[dict], delta: float | None) -> dict:
    """The model's inputs from the runs (medians over every death, :func:`kill_to_next`): shrink
    ``r``, grow ``c`` (the join included), restart ``R``, and ``delta`` (a checkpoint's cost)."""
    def med(mode):
        xs = [x for r in rows if r["mode"] == mode for x in kill_to_next(r) if x is not None]
        return statistics.median(xs) if xs else None
    base_u = _mean(r.get("train_wall_s") for r in rows if r["mode"] == "base-ulfm")
    base_r = _mean(r.get("train_wall_s") for r in rows if r["mode"] == "base-restart")
    ck = _mean(r.get("checkpoints") for r in rows if r["mode"] == "base-restart")
    by_diff = (base_r - base_u) / ck if base_u and base_r and ck else None
    return {"shrink_r": med("shrink"), "grow_c": med("grow"), "restart_R": med("restart"),
            "delta": delta, "delta_by_difference": by_diff}


def report(out: Path, rows: list[dict], header: str) -> str:
    from hpcasync.sim import mtbf as model

    by = {m: [r for r in rows if r["mode"] == m] for m in MODES}
    base = {"ulfm": by["base-ulfm"], "restart": by["base-restart"]}
    ref_acc = _mean(r.get("accuracy") for r in by["base-ulfm"])
    ref_sha = {r.get("params_sha256") for r in by["base-ulfm"]}
    lines = [header, "", "## Real runs (4 ranks)", "",
             "| mode | runs ok | deaths (per run) | test acc. % (mean; runs) | Δ vs undisturbed "
             "(points) | wall s (mean; runs) | (wall − undisturbed mean) / deaths s: the load's "
             "swings dominate it | kill → next step s (each death) | recovery_s / join_s / "
             "restart | final world "
             "| params = undisturbed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in MODES:
        sel = by[m]
        if not sel:
            continue
        ok = [r for r in sel if "accuracy" in r]        # a summary written (rc: see below)
        ref = base["restart" if m in ("restart", "base-restart") else "ulfm"]
        ref_wall = _mean(r["wall_s"] for r in ref if "accuracy" in r)
        deaths = [len(r["kills"]) for r in sel]
        acc = _mean(r["accuracy"] for r in ok)
        lost = [(r["wall_s"] - ref_wall) / len(r["kills"]) for r in ok
                if r["kills"] and ref_wall]
        k2t = [x for r in sel for x in kill_to_next(r)]
        if m == "shrink":
            costs = "recovery_s " + ", ".join(f"{x:.3f}" for r in ok for x in r["recovery_s"])
        elif m == "grow":
            costs = "join_s " + ", ".join(f"{x:.2f}" for r in ok for x in r["join_s"])
        elif m == "restart":
            costs = "resumed after the launcher's report " + ", ".join(
                f"{x:.1f}" for r in ok for x in r["resumed_after_report_s"]) + " s; lost steps " \
                + ", ".join(_lost_steps(r, rows) for r in ok)
        else:
            costs = f"{_fmt(_mean(r.get('checkpoints') for r in ok), '.0f')} checkpoints" \
                if m == "base-restart" else "–"
        same = [r.get("params_sha256") in ref_sha for r in ok]
        accs = ", ".join(format(100 * r["accuracy"], ".2f") for r in ok)
        walls = ", ".join(format(r["wall_s"], ".1f") for r in sel)
        lines.append(
            f"| {m} | {len(ok)}/{len(sel)} | {', '.join(map(str, deaths))} | "
            f"{_fmt(acc and 100 * acc, '.2f')} ({accs}) | "
            f"{_fmt(acc and ref_acc and 100 * (acc - ref_acc), '+.2f')} | "
            f"{_fmt(_mean(r['wall_s'] for r in ok))} ({walls}) | "
            f"{_fmt(_mean(lost))} ({', '.join(f'{x:.1f}' for x in lost) or '–'}) | "
            f"{', '.join(_fmt(x, '.2f', '?') for x in k2t) or '–'} | {costs} | "
            f"{', '.join(str(r.get('world_size', '?')) for r in sel)} | {sum(same)}/{len(ok)} |")
    bad = [r for r in rows if "accuracy" not in r]
    odd = [r for r in rows if "accuracy" in r and r["rc"] != 0]
    if odd:
        lines += ["", "Runs that wrote their summary but whose launcher exited non-zero: "
                  + "; ".join(f"{r['run']} (rc {r['rc']})" for r in odd)]
    if bad:
        lines += ["", "Runs that did not end with a result: " + "; ".join(
            f"{r['run']} ({r['outcome']}, {len(r['kills'])} kills; "
            f"{(r.get('error_lines') or ['no error line'])[0]})" for r in bad)]
    kept = out / "checkpoint_cost.json"      # measured once, so the report is the same again
    if not kept.exists():
        kept.write_text(json.dumps({"checkpoint_s": checkpoint_cost(),
                                    "measured": time.strftime("%Y-%m-%d %H:%M UTC",
                                                              time.gmtime())}) + "\n")
    costs = measured_costs(rows, json.loads(kept.read_text())["checkpoint_s"])
    lines += ["", "Costs measured (medians over every death; the model's inputs): "
              f"shrink r = {_fmt(costs['shrink_r'], '.2f')} s, grow-back c = "
              f"{_fmt(costs['grow_c'], '.2f')} s, restart R = {_fmt(costs['restart_R'], '.2f')} s "
              "(kill → the next step: the run's records under ULFM, the first step logged by "
              "the next attempt for a restart), checkpoint "
              f"δ = {_fmt(costs['delta'], '.4f')} s (LeNet's model and optimizer state written "
              "20 times by `save_checkpoint`, kept in `checkpoint_cost.json`; from the runs, "
              "(undisturbed restart-mode training time − ULFM's) / checkpoints written gives "
              f"{_fmt(costs['delta_by_difference'], '.2f')} s, within the noise of a shared "
              "machine)."]
    lines += ["", model.report(costs)]
    notes = out / "notes.md"                 # what the numbers say, written by hand
    if notes.exists():
        lines += ["", notes.read_text().rstrip()]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    return text


def _lost_steps(r: dict, rows: list[dict]) -> str:
    spe = None
    for b in rows:
        if b["mode"].startswith("base") and b.get("steps"):
            spe = b["steps"] / EPOCHS
            break
    out = []
    for x in r.get("restart_lost", []):
        if spe:
            e, b = x["last_logged"]
            out.append(str(round((e - 1) * spe + b - x["checkpoint_step"])))
    return "/".join(out) or "–"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "experiments/results/mtbf"))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--mtbf", type=float, default=10.0,
                    help="mean gap between kills, seconds of training (the job's MTBF)")
    ap.add_argument("--max-kills", type=int, default=3)
    ap.add_argument("--max-restarts", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--report", metavar="OUT", help="only write OUT/results.md again")
    args = ap.parse_args()
    if args.report:
        out = Path(args.report)
        rows = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
        for r in rows:                   # the results read again from the run's files
            r.update(_read_results(out / "runs" / f"{r['run']}.jsonl",
                                   out / "runs" / f"{r['run']}.err", r["mode"]))
        rows.sort(key=lambda r: (r["seed"], MODES.index(r["mode"])))
        header = (out / "header.md").read_text()
        print(report(out, rows, header))
        return
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    up0, t_start = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), \
        time.time()
    rows = []
    for seed in args.seeds:
        kills = schedule(seed, args.mtbf, args.max_kills)
        for mode in args.modes:
            row = run_one(out, mode, seed, [] if mode.startswith("base") else kills,
                          args.timeout, args.max_restarts)
            rows.append(row)
            print(json.dumps({k: row.get(k) for k in ("run", "rc", "wall_s", "accuracy",
                                                       "world_size", "kills", "outcome")}),
                  flush=True)
    up1 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    header = (
        "# Deaths at exponential gaps: shrink, grow back or restart (issue 24, item 3)\n\n"
        f"Command: `python experiments/probes/mtbf.py {shlex.join(sys.argv[1:])}` on "
        f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M', time.gmtime(t_start))} UTC, "
        f"{(time.time() - t_start) / 60:.1f} min in all. `uptime` before: `{up0}`; after: "
        f"`{up1}`. The machine was shared with other engineers' work: times are upper bounds "
        "and vary run to run.\n\n" + __doc__.split("\n\n")[1].replace("\n", " "))
    (out / "header.md").write_text(header)
    print(report(out, rows, header))


if __name__ == "__main__":
    main()
