"""Probe (issue 21 item 5): does a PS run from a user's loop, interrupted after epoch 1 and resumed
from its checkpoint, land where the uninterrupted run lands?

For each rule it runs ``examples/own_model_numpy.py`` (ConvBN, Fashion-MNIST subset, 1 server + N-1
workers) three times: 2 epochs uninterrupted; 1 epoch with ``--checkpoint-dir`` (every rank calls
``hpcasync.save_checkpoint`` at its epoch end); 2 epochs again on that directory (every rank calls
``load_checkpoint``: the server takes θ, the rule and its clock, each worker its position and
buffers). Prints final test accuracy of both and their difference in points. Asynchronous runs
are not deterministic: the difference includes the push-order noise of two plain runs.

    python experiments/probes/ps_user_resume.py --rules asgd smega2 --ranks 3 --train-limit 6000
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RULES = ["asgd", "dcasgd", "dcasgd-a", "lcasgd", "shat", "shat-root", "ensemble", "asp",
         "smega2", "dana", "nag"]


def run(rule: str, epochs: int, ranks: int, train_limit: int, seed: int, ckpt: str | None,
        out: Path) -> dict:
    from hpcasync.launch import child_env, mpiexec_command

    cmd = [*mpiexec_command(ranks), sys.executable, str(REPO / "examples/own_model_numpy.py"),
           "--algorithm", rule, "--model", "convbn", "--train-limit", str(train_limit),
           "--epochs", str(epochs), "--seed", str(seed), "--result", str(out)]
    if ckpt:
        cmd += ["--checkpoint-dir", ckpt]
    env = child_env()
    env.setdefault("PYTHONPATH", str(REPO))
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise SystemExit(f"{rule}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return {**json.loads(out.read_text()), "resumed": "resuming after epoch" in p.stdout}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rules", nargs="+", default=RULES)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--train-limit", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", action="store_true",
                    help="also a second uninterrupted run: the push-order noise to compare with")
    a = ap.parse_args()
    load = os.getloadavg()[0]
    print(f"# ranks {a.ranks}, ConvBN, Fashion-MNIST first {a.train_limit} images, 2 epochs, "
          f"seed {a.seed}; load average at start {load:.2f}")
    print("| rule | uninterrupted | interrupted after 1, resumed | difference (points) |"
          + (" second uninterrupted: difference |" if a.noise else ""))
    print("|---|---|---|---|" + ("---|" if a.noise else ""))
    for rule in a.rules:
        with tempfile.TemporaryDirectory() as tmp:
            t = Path(tmp)
            t0 = time.time()
            whole = run(rule, 2, a.ranks, a.train_limit, a.seed, None, t / "whole.json")
            run(rule, 1, a.ranks, a.train_limit, a.seed, str(t / "ck"), t / "half.json")
            resumed = run(rule, 2, a.ranks, a.train_limit, a.seed, str(t / "ck"), t / "res.json")
            assert resumed["resumed"], f"{rule}: the second launch did not resume"
            d = 100 * (resumed["accuracy"] - whole["accuracy"])
            noise = ""
            if a.noise:
                again = run(rule, 2, a.ranks, a.train_limit, a.seed, None, t / "again.json")
                noise = f" {100 * (again['accuracy'] - whole['accuracy']):+.2f} |"
            print(f"| {rule} | {100 * whole['accuracy']:.2f} % | {100 * resumed['accuracy']:.2f} % "
                  f"| {d:+.2f} |{noise}  ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
