"""Fresh-cache decisions of ``algorithm="auto"`` against the allreduce benchmark's own timing.

Each run starts ``hpcasync bench allreduce`` with an empty tune file (``HPCASYNC_TUNE_FILE`` in a
new temporary directory), so the default decides every size class afresh inside the run; the
benchmark then times MPI_Allreduce, the default and the window side by side. A decision is wrong
when the method it chose was slower than the other by more than 3 % in that run. Prints a
markdown report (per run and size: the choice, window/MPI, ours/MPI; then the tally).

    python experiments/probes/tune_study.py --runs 10 --ranks 2 4 --sizes 4K 64K 1M 16M 64M
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hpcasync.launch import child_env, mpiexec_command  # noqa: E402


def parse_table(text: str) -> list[dict]:
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for ln in lines[1:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if cells[0].startswith("-"):
            continue
        rows.append(dict(zip(head, cells)))
    return rows


def one_run(ranks: int, sizes: list[str], iters: int) -> tuple[list[dict], float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        env = child_env(HPCASYNC_TUNE_FILE=str(Path(tmp) / "auto.json"))
        out = Path(tmp) / "bench.md"
        load0 = os.getloadavg()[0]
        cmd = [*mpiexec_command(ranks), sys.executable, "-m", "hpcasync.cli", "bench",
               "allreduce", "--sizes", *sizes, "--iters", str(iters), "--no-horovod",
               "--out", str(out)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            raise SystemExit(f"bench failed ({r.returncode}): {r.stderr[-2000:]}")
        return parse_table(out.read_text()), load0, os.getloadavg()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", nargs="+", default=["4K", "64K", "1M", "16M", "64M"])
    ap.add_argument("--iters", type=int, default=60)
    args = ap.parse_args()
    print(f"# Fresh-cache decisions of algorithm='auto'\n\nCommand: `python "
          f"experiments/probes/tune_study.py --runs {args.runs} --ranks "
          f"{' '.join(map(str, args.ranks))} --sizes {' '.join(args.sizes)} --iters {args.iters}`"
          f" ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores)\n")
    tally: dict[tuple, dict] = {}
    for ranks in args.ranks:
        print(f"\n## {ranks} ranks\n\n| run | load before/after | " +
              " | ".join(args.sizes) + " |\n|---|---|" + "---|" * len(args.sizes))
        for run in range(1, args.runs + 1):
            rows, l0, l1 = one_run(ranks, args.sizes, args.iters)
            cells = []
            for size, row in zip(args.sizes, rows):
                window = row["auto"].startswith("window")      # "window (measured now)"
                w_mpi = float(row["window/MPI"])          # > 1: the window was faster
                o_mpi = float(row["ours/MPI"])
                wrong = (w_mpi < 1 / 1.03) if window else (w_mpi > 1.03)
                t = tally.setdefault((ranks, size), {"window": 0, "mpi": 0, "wrong": 0,
                                                     "ours": []})
                t["window" if window else "mpi"] += 1
                t["wrong"] += wrong
                if window:
                    t["ours"].append(o_mpi)
                cells.append(f"{'W' if window else 'M'} {w_mpi:.2f} / {o_mpi:.2f}"
                             + (" **wrong**" if wrong else ""))
            print(f"| {run} | {l0:.2f} / {l1:.2f} | " + " | ".join(cells) + " |", flush=True)
    print("\nCell: the choice (W window, M MPI), then window/MPI and ours/MPI as the benchmark "
          "timed them in that run (> 1: faster than MPI_Allreduce).\n")
    print("| ranks | size | chose window | chose MPI | wrong (> 3 % slower) | "
          "lowest ours/MPI where the window was chosen |\n|---|---|---|---|---|---|")
    for (ranks, size), t in tally.items():
        low = f"{min(t['ours']):.2f}" if t["ours"] else "–"
        print(f"| {ranks} | {size} | {t['window']} | {t['mpi']} | {t['wrong']} | {low} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
