"""A new algorithm needs its own code and one registry entry, nothing else in hpcasync
(docs/design/new-algorithm.md): ``toy-asgd`` (``tests/toy_algorithm.py``: a rule class and an
entry with its own CLI option ``--toy-scale``, written outside the package) and ``toy-localsgd``
(an ``ssgd``-family method: an optimizer class with state of its own and an entry with two
options) train through ``hpcasync train``, survive a real SIGKILL under ULFM, grow back to their
starting size, write checkpoints and resume from them. ULFM is Open-MPI-only (skipped under
MPICH)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hpcasync.metrics import read_metrics
from tests.mpi_util import REPO, clean_env, last_summary, mpiexec, need_ulfm

TRAIN = 3000                             # 3 workers x 31 batches of 32 per epoch
BUDGET = 2 * (TRAIN // 3 // 32)          # pushes per worker in 2 epochs
TIMEOUT = 120


def _toy(tmp_path, name: str, *args: str, kill_at: str = "", ft: bool = False,
         algorithm: tuple = ("toy-asgd", "--toy-scale", "0.5")):
    metrics = tmp_path / f"{name}.jsonl"
    cmd = [*mpiexec(4, ft=ft), sys.executable, "tests/toy_algorithm.py", "train",
           "--algorithm", *algorithm, "--dataset", "fashion-mnist-mini",
           "--train-limit", str(TRAIN), "--progress", "off", "--metrics", str(metrics),
           "--checkpoint-dir", str(tmp_path / "ckpt"), *args]
    out = subprocess.run(cmd, env=clean_env(HPCASYNC_INJECT_KILL_AT=kill_at,
                                            HPCASYNC_JOIN_TIMEOUT="100"),
                         cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    return last_summary(metrics), read_metrics(metrics)


@pytest.mark.rank0
@pytest.mark.timeout(2 * TIMEOUT + 30)
def test_a_new_algorithm_from_outside_the_package_survives_grows_back_and_resumes(tmp_path):
    need_ulfm()
    s, records = _toy(tmp_path, "grow", "--epochs", "2", "--grow-back", kill_at="3:step:5",
                      ft=True)
    assert s["rule_workers"]["toy_scale"] == 0.5            # its option reached its rule
    (join,) = s["rank_joins"]
    assert join["ranks"] == [3] and s["world_size"] == 4
    assert s["pushes_per_worker"] == [BUDGET] * 3             # the dead worker's rest trained
    saved = [r["step"] for r in records if r["event"] == "checkpoint"]
    assert saved == [BUDGET * 3 // 2, BUDGET * 3], saved     # each epoch's end
    s, _ = _toy(tmp_path, "resume", "--epochs", "3", "--resume", "auto")
    assert s["resumed_at_push"] == 3 * BUDGET
    assert s["pushes_per_worker"] == [3 * BUDGET // 2] * 3
    assert s["rule_workers"]["toy_scale"] == 0.5 and s["test_accuracy"] >= 0.45


@pytest.mark.rank0
@pytest.mark.timeout(2 * TIMEOUT + 30)
def test_a_new_synchronous_method_survives_rank_0s_death_grows_back_and_resumes(tmp_path):
    """``toy-localsgd`` (a local SGD whose period grows after each average), rank 0 killed at
    its 5th step under ULFM with ``--grow-back``: the survivors reset, the replacement takes
    rank 0's place with the live state, every replica ends equal and the checkpoints, written
    by the replacement, hold the method's own schedule (its period and next average) where an
    undisturbed run has it; ``--resume auto`` goes on with it."""
    from hpcasync.checkpoint import read_checkpoint
    from tests.toy_algorithm import schedule

    need_ulfm()
    toy = ("toy-localsgd", "--toy-period", "2", "--toy-growth", "1")
    steps = TRAIN // 4 // 32                                 # 23 a rank and epoch
    s, records = _toy(tmp_path, "grow", "--epochs", "2", "--grow-back", kill_at="0:step:5",
                      ft=True, algorithm=toy)
    (join,) = s["rank_joins"]
    assert join["ranks"] == [0] and s["world_size"] == 4
    assert len(set(s["replica_sha256"])) == 1, s["replica_sha256"]
    saved = [r["step"] for r in records if r["event"] == "checkpoint"]
    assert saved == [steps, 2 * steps], saved

    def extra(step):
        _, state = read_checkpoint(tmp_path / "ckpt" / f"ckpt-e{step // steps:04d}-s{step:08d}.pt")
        x = state["optimizer"]["hpcasync"]
        return x["steps"], (x["period"], x["next_average"])

    assert [extra(k) for k in saved] == [(k, schedule(k)) for k in saved]
    s, _ = _toy(tmp_path, "resume", "--epochs", "3", "--resume", "auto", algorithm=toy)
    assert extra(3 * steps) == (3 * steps, schedule(3 * steps)) and s["test_accuracy"] >= 0.45


@pytest.mark.rank0
@pytest.mark.no_mpi
def test_its_option_is_refused_for_another_algorithm_before_mpi():
    out = subprocess.run([sys.executable, "tests/toy_algorithm.py", "train", "--algorithm",
                          "asgd", "--toy-scale", "0.5"], env=clean_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == \
        "hpcasync: error: --toy-scale applies to toy-asgd, not asgd"
    out = subprocess.run([sys.executable, "tests/toy_algorithm.py", "train", "--algorithm",
                          "ssgd", "--toy-growth", "2"], env=clean_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.stderr.strip().splitlines()[-1] == \
        "hpcasync: error: --toy-growth applies to toy-localsgd, not ssgd"
