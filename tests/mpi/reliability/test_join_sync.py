"""Grow back for OD-SGD and DASO (``--grow-back``, :mod:`hpcasync.runtime.join`): real SIGKILLs
under ``mpirun --with-ft ulfm``, the survivors shrink, spawn a replacement that takes the dead
rank's place (DASO: its node, ``--ranks-per-node 2``), send it the live state and train on at
full size. Each test kills twice in one run:

* a death while the run is synchronous (OD-SGD's warm-up, DASO's blocking epoch): after the join
  the run is the undisturbed run, so epoch 1's evaluation (``test_loss``, a float written in
  full) equals the undisturbed run's — the model is bitwise the same there;
* a death in the phase that is not (OD-SGD's one-step delay, DASO's cycling epoch): the round
  or global sums in flight are lost in the recovery (and OD-SGD's dead rank's own local weights
  with it; DASO's survivors average their replicas), so no run without that death can match it;
  what holds is asserted: 4 ranks at the end, replicas bitwise equal (OD-SGD: the global model;
  DASO: every replica at the epoch end, so both nodes), the undisturbed step count and nodes.

A joiner that loaded less than the survivors hold ends the job with one line (``agree``), so
these tests also fail on any missing piece of state the digest covers. Open MPI only (ULFM).
Design: docs/design/growth.md.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from hpcasync.metrics import read_metrics
from tests.mpi_util import REPO, clean_env, last_summary, mpiexec, need_ulfm

TRAIN = 3000                             # 23 steps of 4 x 32 per epoch
STEPS = TRAIN // 4 // 32
DATA = ["train", "--dataset", "fashion-mnist-mini", "--train-limit", str(TRAIN), "--epochs", "2",
        "--progress", "off"]
# OD-SGD: warm-up (SSGD) to step 30, the one-step delay after it
ODSGD = ["--algorithm", "odsgd", "--odsgd-warmup-iters", "30"]
# DASO: 2 nodes of 2, epoch 1 blocking (warm-up), epoch 2 cycling
DASO = ["--algorithm", "daso", "--ranks-per-node", "2", "--daso-warmup-epochs", "1",
        "--daso-cooldown-epochs", "0"]
JOB_TIMEOUT = 150


def _run(tmp_path, name: str, args, kill: str = ""):
    metrics = tmp_path / f"{name}.jsonl"
    cmd = [*mpiexec(4, ft=True), sys.executable, "-m", "hpcasync.cli", *DATA, *args,
           "--metrics", str(metrics)]
    env = clean_env(HPCASYNC_INJECT_KILL_AT=kill, HPCASYNC_JOIN_TIMEOUT="100")
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=JOB_TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out, metrics


def _epochs(metrics) -> list[dict]:
    return [r for r in read_metrics(metrics) if r["event"] == "epoch"]


def _epoch1_undisturbed(mbase, metrics) -> list[dict]:
    """Epoch 1 (the first death and join inside it) ends on the undisturbed model: its test
    loss and accuracy equal the undisturbed run's exactly. Returns the grown run's epochs."""
    base, grown = _epochs(mbase), _epochs(metrics)
    assert grown[0]["test_loss"] == base[0]["test_loss"]                # = the undisturbed model
    assert grown[0]["test_accuracy"] == base[0]["test_accuracy"]
    return grown


def _grew_twice(out, metrics, places: list[int]) -> dict:
    """The common part: two deaths, two joins into the dead ranks' places, 4 ranks at the end
    with the undisturbed step count and bitwise equal replicas."""
    s = last_summary(metrics)
    assert s["world_size"] == 4 and s["failed_ranks"] == sorted(places)
    joins = s["rank_joins"]
    assert [j["ranks"] for j in joins] == [[p] for p in places]
    assert [j["joined"] for j in joins] == [[4], [5]] and [j["world_size"] for j in joins] == [4, 4]
    assert [j["position"][0] for j in joins] == [1, 2]
    assert s["steps"] == 2 * STEPS
    digests = s["replica_sha256"]
    assert len(digests) == 4 and len(set(digests)) == 1, digests        # replicas bitwise equal
    records = read_metrics(metrics)
    assert [r["event"] for r in records if r["event"] in ("rank_failed", "rank_joined")] == \
        ["rank_failed", "rank_joined"] * 2
    assert [r["world_size"] for r in _epochs(metrics)] == [4, 4]
    assert out.stderr.count("grow-back: 1 rank(s) joined") == 2
    return s


@pytest.mark.rank0
@pytest.mark.timeout(2 * JOB_TIMEOUT + 30)
def test_odsgd_grows_back_in_warm_up_and_in_the_one_step_delay(tmp_path):
    """Rank 1 dies at step 4 (warm-up): after the join epoch 1 ends on the undisturbed model.
    Rank 0 dies at step 35 (one-step delay; the joiner becomes rank 0 and writes the end):
    the global model bitwise equal on the 4 ranks at the end."""
    need_ulfm()
    _, mbase = _run(tmp_path, "base", ODSGD)
    out, metrics = _run(tmp_path, "grow", [*ODSGD, "--grow-back"], "1:step:4,0:step:35")
    s = _grew_twice(out, metrics, [1, 0])
    _epoch1_undisturbed(mbase, metrics)
    assert s["warmup_steps"] == 30 and s["rounds"] in (2 * STEPS - 1, 2 * STEPS)


@pytest.mark.rank0
@pytest.mark.timeout(2 * JOB_TIMEOUT + 30)
def test_daso_grows_back_into_its_node_in_a_blocking_and_a_cycling_epoch(tmp_path):
    """2 nodes of 2. Rank 2 (node 1) dies at step 5 (blocking epoch): after the join epoch 1 ends
    on the undisturbed model. Rank 1 (node 0) dies at its step 30 (cycling epoch, global sums in
    flight): the joiner takes rank 1's place on node 0; nodes of 2 and 2 again, every replica
    (both nodes) bitwise equal at the end."""
    need_ulfm()
    _, mbase = _run(tmp_path, "base", DASO)
    out, metrics = _run(tmp_path, "grow", [*DASO, "--grow-back"], "2:step:5,1:step:30")
    s = _grew_twice(out, metrics, [2, 1])
    grown = _epoch1_undisturbed(mbase, metrics)
    assert s["daso_node_sizes"] == [2, 2] and s["replicas_identical"]
    assert s["daso_schedule"] == last_summary(mbase)["daso_schedule"]
    assert [r["daso_phase"] for r in grown] == ["warmup", "cycling"]
