"""The examples as a user runs them, as real 4-rank jobs (``mpiexec -n 4 python examples/...``).

* ``examples/train_mnist.py`` learns with one algorithm of each family (ssgd, daso, odsgd, and the
  parameter server through smega2);
* ``examples/own_model_numpy.py`` learns with its ConvBN (ssgd and dcasgd-a) and its GRU (ssgd),
  writes its result, metrics and checkpoints, and resumes from a checkpoint;
* its plain loop and ``hpcasync train`` reach the same accuracy at the same settings
  (examples/RESULTS.md has the full-size table for all 14 algorithms).

Accuracy bars are at least 4 points below the worst of three seeds measured on this 2-core box
(the measurements are next to each bar); chance is 10 %.
"""
import json
import re
import shutil
import sys

import pytest

from hpcasync.rules import RULES
from tests.mpi_util import MPI_TWINS, last_summary, run_mpi

# end-to-end training to a bar: the MPI calls it makes are the other tests' (CI's MPICH pass leaves it out)
pytestmark = pytest.mark.e2e

TIMEOUT = 240      # s per job: 10-15 s on an idle box, 30-40 s at a load average of 10


def _script(script, args):
    r = run_mpi(4, ["--", sys.executable, f"examples/{script}", *args], timeout=TIMEOUT)
    assert r.returncode == 0, f"{script} {' '.join(args)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


# -- examples/train_mnist.py ------------------------------------------------------------------------

# Test accuracy (all 10000 test images) after 2 epochs over the first 6000 training images, batch
# 32 per rank, lr 0.05, momentum 0.9, seeds 0 / 1 / 2 (the test runs seed 0):
#   ssgd 76.20 / 76.24 / 75.50 %; daso (--ranks-per-node 2, every epoch cycling) 77.03 / 76.38 /
#   76.16 %; odsgd (50 SSGD warm-up steps, then the one-step delay; η_l 0.5 on g/N since issue 13)
#   69.53 / 71.79 / 72.68 % (with η_l 0.1 on g/N, i.e. 4x smaller than before the fix: 46.64 %);
#   smega2 (rank 0 serves, 3 workers; push order depends on timing) 78.39 / 79.15 / 76.84 %.
MNIST = ["--train-limit", "6000", "--epochs", "2", "--seed", "0", "--log-interval", "1000"]


@pytest.mark.rank0
@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("algorithm, extra, bar", [
    ("ssgd", [], 0.71),
    ("daso", ["--ranks-per-node", "2"], 0.72),
    ("odsgd", [], 0.65),
    ("smega2", [], 0.72),
])
def test_train_mnist_learns(algorithm, extra, bar):
    out = _script("train_mnist.py", ["--algorithm", algorithm, *MNIST, *extra])
    found = re.findall(r"Test set \((\S+)\): Average loss: ([\d.]+), Accuracy: ([\d.]+)%", out)
    assert len(found) == 1, out[-2000:]            # printed once, by the root rank
    name, loss, acc = found[0]
    assert name == algorithm
    assert float(acc) / 100 >= bar, (algorithm, acc, loss)


# -- examples/own_model_numpy.py ---------------------------------------------------------------------

# The first 4000 training images of the full set, all 10000 test images, 2 epochs, batch 32 per
# rank, lr 0.05, momentum 0.9; accuracy for seeds 0 / 1 / 2 (the tests run seed 0):
#   convbn ssgd 80.09 / 79.34 / 79.00 %; convbn dcasgd-a (rank 0 serves, 3 workers) 81.21 /
#   81.50 / 81.30 %; gru ssgd 56.00 / 57.27 / 55.96 %.
OWN = ["--train-limit", "4000", "--epochs", "2", "--batch-size", "32", "--lr", "0.05",
       "--momentum", "0.9", "--seed", "0"]
_loop_runs: dict = {}      # one loop run serves the learning, resume and CLI comparison tests


def _own_model(algorithm, model, tmp_path, extra=()):
    """Run own_model_numpy.py (with --result, --metrics, --checkpoint-dir) once per setting:
    (stdout, result record, directory)."""
    key = (algorithm, model, tuple(extra))
    if key not in _loop_runs:
        tmp_path.mkdir(parents=True, exist_ok=True)
        out = _script("own_model_numpy.py", ["--algorithm", algorithm, "--model", model, *OWN,
                                             *extra, "--result", str(tmp_path / "result.json"),
                                             "--metrics", str(tmp_path / "run.jsonl"),
                                             "--checkpoint-dir", str(tmp_path / "ckpt")])
        _loop_runs[key] = (out, json.loads((tmp_path / "result.json").read_text()), tmp_path)
    return _loop_runs[key]


def _final_accuracy(out):
    lines = re.findall(r"final test accuracy: (0\.\d{4})", out)
    assert len(lines) == 1, out[-2000:]            # printed once, by the root rank
    return float(lines[0])


@pytest.mark.rank0
@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("algorithm, model, bar", [
    ("ssgd", "convbn", 0.75),
    ("dcasgd-a", "convbn", 0.77),
    ("ssgd", "gru", 0.51),
])
def test_own_model_learns(algorithm, model, bar, tmp_path):
    out, result, where = _own_model(algorithm, model, tmp_path)
    acc = _final_accuracy(out)
    assert result["accuracy"] == acc and result["algorithm"] == algorithm
    assert result["model"] == model and result["epochs"] == 2 and result["world_size"] == 4
    assert last_summary(where / "run.jsonl")["test_accuracy"] == pytest.approx(acc, abs=1e-4)
    assert sorted(p.name for p in (where / "ckpt").iterdir())[-1].startswith("ckpt-e0002")
    assert acc >= bar, (algorithm, model, acc)


@pytest.mark.rank0
@pytest.mark.timeout(2 * TIMEOUT + 30)
def test_own_model_resumes_from_its_checkpoint(tmp_path):
    """Started again on the checkpoint of epoch 1, the ssgd run trains epoch 2 alone and ends
    exactly where the uninterrupted run ended."""
    out, result, where = _own_model("ssgd", "convbn", tmp_path / "full")
    resume = tmp_path / "resume"
    resume.mkdir()
    first = sorted((where / "ckpt").glob("ckpt-e0001*"))
    assert first, list((where / "ckpt").iterdir())
    shutil.copy(first[0], resume)
    metrics = tmp_path / "resumed.jsonl"
    again = _script("own_model_numpy.py", ["--algorithm", "ssgd", "--model", "convbn", *OWN,
                                           "--checkpoint-dir", str(resume),
                                           "--metrics", str(metrics)])
    assert "resuming after epoch 1" in again
    assert _final_accuracy(again) == result["accuracy"]
    epochs = [r["epoch"] for r in map(json.loads, metrics.read_text().splitlines())
              if r["event"] == "epoch"]
    assert epochs == [2]


# -- the plain loop against the CLI ------------------------------------------------------------------

# Loop minus CLI, points, at the settings of OWN, ConvBN, seeds 0 / 1 / 2 / 3 / 4 (tests: seed 0):
#   ssgd +0.47 / -1.23 / -0.88 / -1.75 / +0.60; odsgd +1.69 / +1.22 / +1.25 / +0.62 / -0.16;
#   dcasgd-a (seeds 0-2) +0.52 / -0.35 / -0.92; daso +1.44 / +2.51 / +0.14 / +1.16 / +2.38.
# The gap is the data order alone (numpy's permutation in the loop, hpcasync's in the CLI): with
# the CLI's order the loop reproduced the CLI's accuracy to the last digit for ssgd, daso and odsgd
# (seeds 0, 1, 4). daso has no test here: it exceeded 2 points for 2 of 5 seeds. dcasgd-a is
# asynchronous: its push order follows the machine's timing, so on a loaded box one run differs
# from the next with the same seed (CI, 2026-11-23: loop 81.63 %, CLI 77.29 %): 5 points, else 2.
FAMILY_OPTIONS = {   # the same settings: loop options, CLI options, margin
    "ssgd": ([], [], 0.02),
    "odsgd": ([], ["--odsgd-warmup-iters", "50"], 0.02),
    "dcasgd-a": ([], [], 0.05),
}


@pytest.mark.rank0
@pytest.mark.timeout(2 * TIMEOUT + 30)
@pytest.mark.parametrize("algorithm", list(FAMILY_OPTIONS))
def test_loop_matches_cli(algorithm, tmp_path):
    loop_extra, cli_extra, margin = FAMILY_OPTIONS[algorithm]
    _, result, _ = _own_model(algorithm, "convbn", tmp_path / "loop", loop_extra)
    metrics = tmp_path / "cli.jsonl"
    r = run_mpi(4, ["train", "--algorithm", algorithm,
                    "--model", "examples/own_model_numpy.py:convbn",
                    "--dataset", "examples/own_model_numpy.py:images", *OWN, *cli_extra,
                    "--progress", "off", "--metrics", str(metrics)], timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    cli = last_summary(metrics)["test_accuracy"]
    assert abs(result["accuracy"] - cli) <= margin, (algorithm, result["accuracy"], cli)


# -- examples/horovod_mnist.py: a Horovod-API script, one algorithm of each kind ------------------

# Test accuracy on the first 2000 test images after 1 epoch over the first 3000 training images,
# batch 32 per rank, lr 0.05 (nag 0.02), momentum 0.9, seed 42, 4 ranks (PS rules: 1 server + 3
# workers), measured once on this 2-core box: ssgd 45.15, daso (2 virtual nodes) 45.95, odsgd
# (warm-up 10 steps, then the one-step delay) 42.50, asgd 47.18, dcasgd 52.77, dcasgd-a 50.92, lcasgd 53.97,
# shat 43.73, shat-root 47.08, ensemble 35.78, asp 50.87, smega2 49.13, dana 52.12, nag 54.37 %.
# The asynchronous runs vary with push timing: the bar (20 %, twice chance) says that each
# algorithm is reached through hvd.DistributedOptimizer and learns, not how well (a CI-like run with
# other jobs beside it: dana 21.59 %; the bar was 30 %).
# smega2 runs at lr 0.02 here (nag's default): at 0.05 its first epoch sits at the edge of
# stability (its cycle of N pushes is a momentum step of lr N·η, warmed up from η): 16 runs gave
# 17.39-63.17 % (one below the bar; CI once 17.89 %), with warmup_epochs=0 9.80-50.17 %, and at
# lr 0.02 24 runs (12 of them two jobs at once) gave 40.03-55.37 %.
# One job per MPI-twin class (tests.mpi_util.MPI_TWINS: a twin's script run takes the same facade
# and MPI paths, its rule is server-side math): the 7 twins (dcasgd, dcasgd-a, dana, nag,
# shat-root, ensemble, asp) were 7 more jobs of ~18 s each on the 2-core CI box. Each of the 11
# rules learns through the front door in test_ps_rules_learn.py, in-process.
HVD = ["--train-limit", "3000", "--test-limit", "2000", "--epochs", "1"]
HVD_ALGORITHMS = [a for a in ("ssgd", "localsgd", "slowmo", "diloco", "daso", "odsgd", *RULES)
                  if a not in MPI_TWINS]


@pytest.mark.rank0
@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("algorithm", HVD_ALGORITHMS)
def test_horovod_script_reaches_each_kind_of_algorithm(algorithm):
    extra = {"daso": ["--ranks-per-node", "2"], "smega2": ["--lr", "0.02"]}.get(algorithm, [])
    out = _script("horovod_mnist.py", ["--algorithm", algorithm, *HVD, *extra])
    found = re.findall(r"test accuracy \((\S+), (\d) training ranks\): ([\d.]+)%", out)
    assert len(found) == 1, out[-2000:]            # printed once, by training rank 0
    name, ranks, acc = found[0]
    from hpcasync.api import PS_ALGORITHMS
    assert name == algorithm and int(ranks) == (3 if algorithm in PS_ALGORITHMS else 4)
    assert float(acc) >= 20.0, (algorithm, acc)
