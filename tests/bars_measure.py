"""Measure the accuracies behind the learning bars of ``tests/mpi/test_learning_bars.py``.

Runs exactly the test's command (:func:`tests.mpi.test_learning_bars.command`) for each algorithm and
seed, one 4-rank job at a time (the box is shared: never two at once), and prints one line a run
plus, at the end, the per-algorithm minimum and the bar it implies (minimum − 4 points)::

    source .venv/bin/activate
    python tests/bars_measure.py --seeds 0 1 2 --out /tmp/bars.jsonl          # all 14
    python tests/bars_measure.py --seeds 0 0 0 --algorithms asgd lcasgd       # timing repeats

Appends one JSON line a run to ``--out`` (algorithm, seed, accuracy, job seconds, load average), so
an interrupted measurement keeps what it had. Not a test (pytest does not collect this file).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hpcasync.metrics import read_metrics  # noqa: E402
from tests.mpi_util import last_summary, run_mpi  # noqa: E402
from tests.mpi.test_learning_bars import ALGORITHMS, MARGIN, command  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--out", default="/tmp/bars.jsonl")
    args = ap.parse_args()
    got: dict[str, list[float]] = {}
    for algorithm in args.algorithms:
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as tmp:
                metrics = Path(tmp) / "m.jsonl"
                t0 = time.time()
                r = run_mpi(4, command(algorithm, metrics, seed=seed), timeout=900)
                took = time.time() - t0
                acc = last_summary(metrics)["test_accuracy"] if r.returncode == 0 else None
                epochs = [(e["test_accuracy"], round(e["train_loss"], 3), e.get("top_class_share"))
                          for e in read_metrics(metrics) if e["event"] == "epoch"] \
                    if r.returncode == 0 else []
            row = {"algorithm": algorithm, "seed": seed, "accuracy": acc, "job_s": round(took, 1),
                   "load": os.getloadavg()[0], "epochs": epochs,
                   "collapse_said": "constant predictor" in r.stderr}
            if acc is None:
                row["stderr"] = r.stderr[-1500:]
            else:
                got.setdefault(algorithm, []).append(acc)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    for algorithm, accs in got.items():
        print(f"{algorithm:10s} " + " / ".join(f"{100 * a:.1f}" for a in accs)
              + f"   min {100 * min(accs):.1f}  bar {100 * (min(accs) - MARGIN):.1f}")


if __name__ == "__main__":
    main()
