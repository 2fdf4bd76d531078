"""Grow back in the parameter-server runtime (``--grow-back``, :mod:`hpcasync.ps.growth`): after
real SIGKILLs under ``mpirun --with-ft ulfm`` a replacement takes each dead rank's place — a
worker's (the server spawns it while the others train, then stops them once, and the run goes
on from the server's state in memory) and the server's (a worker takes over, the replacement
joins as a worker). The run ends with the starting world size and the whole push budget served;
without a free slot it goes on shrunk with one warning line, or ends with one line below
``--min-ranks``. ULFM is Open-MPI-only (skipped under MPICH). Design: docs/design/growth.md.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hpcasync.launch import mpiexec_command
from hpcasync.metrics import read_metrics
from tests.mpi_util import REPO, clean_env, error_lines, last_summary, mpiexec, need_ulfm

TRAIN = 3000                             # 3 workers x 31 batches of 32 per epoch
BUDGET = 2 * (TRAIN // 3 // 32)          # pushes per worker in 2 epochs
DATA = ["train", "--dataset", "fashion-mnist-mini", "--train-limit", str(TRAIN), "--epochs", "2",
        "--progress", "off", "--algorithm", "asgd"]
JOB_TIMEOUT = 150


def _run(tmp_path, name: str, *, kill_at: str = "", kill: str = "", extra=(), launcher=None):
    metrics = tmp_path / f"{name}.jsonl"
    cmd = [*(launcher or mpiexec(4, ft=True)), sys.executable, "-m", "hpcasync.cli", *DATA,
           "--metrics", str(metrics), *extra]
    env = clean_env(HPCASYNC_INJECT_KILL_AT=kill_at, HPCASYNC_INJECT_KILL=kill,
                    HPCASYNC_JOIN_TIMEOUT="100")
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=JOB_TIMEOUT)
    return out, metrics


@pytest.mark.rank0
@pytest.mark.timeout(JOB_TIMEOUT + 30)
def test_a_dead_workers_replacement_trains_the_rest_of_its_shard(tmp_path):
    """Worker rank 3 dies at its step 5: the server spawns a replacement while workers 1 and 2
    train on, then stops them once; the replacement takes rank 3's place (its worker index, its
    shard) at the dead worker's position (its answered pushes) and the others go on from theirs.
    The run ends on 4 ranks with every worker's budget served exactly (shrink-only leaves the
    dead worker's rest untrained)."""
    need_ulfm()
    out, metrics = _run(tmp_path, "worker", kill_at="3:step:5", extra=["--grow-back"])
    assert out.returncode == 0, out.stderr[-3000:]
    s = last_summary(metrics)
    records = read_metrics(metrics)
    events = [r["event"] for r in records if r["event"] in ("worker_failed", "rank_joined")]
    assert events == ["worker_failed", "rank_joined"], events
    assert s["world_size"] == 4
    (join,) = s["rank_joins"]
    assert join["ranks"] == [3] and join["joined"] == [4] and join["world_size"] == 4
    (failed,) = s["failed_workers"]
    assert failed["rank"] == 3 and failed["replaced"] and not failed["finished"]
    # each worker goes on from its position when the server stopped them; the replacement
    # from the dead worker's answered pushes
    starts = {w["worker"]: w["worker_start_step"] for w in s["workers"]}
    assert [starts[w] for w in range(3)] == join["position"]
    assert join["position"][failed["worker"]] == failed["pushes"]
    # every push of every worker's budget served once, none twice
    assert s["pushes_per_worker"] == [BUDGET] * 3, (s["pushes_per_worker"], starts)
    assert s["pushes"] == 3 * BUDGET and s["rejected_pushes"] == 0
    assert [w["worker_steps"] for w in s["workers"]] == [BUDGET] * 3
    assert out.stderr.count("grow-back: 1 rank(s) joined") == 1
    assert s["test_accuracy"] >= 0.45        # undisturbed: 0.618 (2 epochs of the mini set)
    assert 0 < join["join_s"] < 60


@pytest.mark.rank0
@pytest.mark.timeout(JOB_TIMEOUT + 30)
def test_a_worker_found_dead_only_by_the_servers_last_wait_is_replaced_too(tmp_path):
    """Worker rank 3 sleeps 6 s at its step 55 (the others finish their budget meanwhile) and
    dies at its 58th push: the server sees the death in its last wait, when every other worker
    is done and waits for its end message. It still spawns and stops them for the grow-back
    (``PSServer.grow_back``): the replacement trains the dead worker's rest, every push of the
    budget is served."""
    need_ulfm()
    out, metrics = _run(tmp_path, "late", kill_at="3:step:55:6:sleep", kill="3:58",
                        extra=["--grow-back"])
    assert out.returncode == 0, out.stderr[-3000:]
    s = last_summary(metrics)
    (join,) = s["rank_joins"]
    assert join["ranks"] == [3] and join["position"][:2] == [BUDGET, BUDGET], join
    assert s["pushes_per_worker"] == [BUDGET] * 3 and s["rejected_pushes"] == 0
    assert "not trained" not in out.stderr


@pytest.mark.rank0
@pytest.mark.timeout(JOB_TIMEOUT + 30)
def test_a_dead_servers_place_is_refilled_after_the_takeover(tmp_path):
    """The server dies at its 40th push: a worker takes over (ps.takeover), spawns a replacement
    and it joins as a worker in rank 0's place; every worker resumes at the takeover's share of
    its budget. The run ends on 4 ranks (3 workers again) with the budget served."""
    need_ulfm()
    out, metrics = _run(tmp_path, "server", kill="0:40", extra=["--grow-back"])
    assert out.returncode == 0, out.stderr[-3000:]
    s = last_summary(metrics)
    events = [r["event"] for r in read_metrics(metrics)
              if r["event"] in ("server_failed", "rank_joined")]
    assert events == ["server_failed", "rank_joined"], events
    (failure,) = s["server_failures"]
    assert failure["dead_ranks"] == [0] and failure["workers"] == 2
    (join,) = s["rank_joins"]
    assert join["ranks"] == [0] and join["joined"] == [4] and join["world_size"] == 4
    assert s["world_size"] == 4 and s["ps_rank"] == failure["new_server"] != 0
    assert len(s["workers"]) == 3
    start = int(failure["share_done"] * BUDGET)
    assert [w["worker_start_step"] for w in s["workers"]] == [start] * 3
    assert s["pushes_per_worker"] == [BUDGET] * 3 and s["rejected_pushes"] == 0
    assert s["test_accuracy"] >= 0.45


@pytest.mark.rank0
@pytest.mark.timeout(2 * JOB_TIMEOUT + 30)
def test_no_free_slot_goes_on_shrunk_or_ends_below_min_ranks(tmp_path):
    """Four slots and no --oversubscribe: the server's spawn fails while the workers train. The
    run goes on with 3 ranks (one warning line; the dead worker's rest is not trained, as
    without --grow-back; prterun exits 213 for the failed spawn); with --min-ranks 4 it ends,
    non-zero, with one line."""
    need_ulfm()
    launcher = [*mpiexec_command(4, ft=True, oversubscribe=False, bind="none"),
                "--host", "localhost:4"]
    out, metrics = _run(tmp_path, "shrunk", kill_at="2:step:2", extra=["--grow-back"],
                        launcher=launcher)      # (early: the others must still be training)
    assert out.returncode == 213, out.stderr[-3000:]   # prterun's record of the failed spawn
    s = last_summary(metrics)
    assert "rank_joins" not in s
    assert [r["event"] for r in read_metrics(metrics) if r["event"] == "grow_failed"] == \
        ["grow_failed"]
    (failed,) = s["failed_workers"]
    assert failed["rank"] == 2 and not failed.get("replaced")
    assert s["pushes"] < 3 * BUDGET              # the dead worker's rest: not trained
    assert out.stderr.count("grow-back: spawning 1 replacement(s) failed") == 1
    out, metrics = _run(tmp_path, "min", kill_at="2:step:2",
                        extra=["--grow-back", "--min-ranks", "4"], launcher=launcher)
    assert out.returncode != 0, out.stderr[-3000:]    # (prterun: 213 again, for the spawn)
    lines = [ln for ln in out.stderr.splitlines() if "fewer than --min-ranks 4" in ln]
    assert len(lines) == 1 and "rank(s) 2 died" in lines[0], out.stderr[-3000:]
    assert not metrics.exists()                  # no finished stream: the job ended


@pytest.mark.rank0
@pytest.mark.timeout(JOB_TIMEOUT + 30)
def test_a_death_during_the_grow_ends_the_job_with_one_line_in_seconds(tmp_path):
    """Worker rank 3 dies at step 5; when the replacement is about to connect, worker rank 1
    dies too (kill phase ``grow``). The grow is not survived: the job ends, non-zero, within
    30 s of that death (``HPCASYNC_JOIN_CONNECT_TIMEOUT`` bounds any wait left), a survivor
    naming both dead ranks in one line and the replacement saying it could not connect."""
    need_ulfm()
    log = tmp_path / "kills.log"
    metrics = tmp_path / "g.jsonl"
    cmd = [*mpiexec(4, ft=True), sys.executable, "-m", "hpcasync.cli", *DATA,
           "--metrics", str(metrics), "--grow-back"]
    env = clean_env(HPCASYNC_INJECT_KILL_AT="3:step:5,1:grow:1", HPCASYNC_INJECT_KILL_LOG=str(log))
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=JOB_TIMEOUT)
    ended = time.time()
    assert out.returncode != 0, out.stderr[-3000:]
    killed = {ln.split()[1]: float(ln.split()[3]) for ln in log.read_text().splitlines()}
    assert set(killed) == {"step", "grow"}
    assert ended - killed["grow"] < 30, (ended - killed["grow"], out.stderr[-3000:])
    assert any("rank(s) 1, 3 died" in ln for ln in error_lines(out.stderr)), out.stderr[-3000:]


@pytest.mark.rank0
@pytest.mark.no_mpi
def test_ps_grow_options_are_checked_before_mpi():
    """--grow-back with one server rank only; --max-ranks does not apply (the PS refills the dead
    ranks' places: each worker's place fixes its shard and position); --min-ranks needs
    --grow-back (without it nothing would check it)."""
    from hpcasync.config import TrainConfig
    from hpcasync.errors import ConfigError
    from hpcasync.ps import runtime
    from hpcasync.runtime import algorithms

    def check(**options):
        runtime.validate(TrainConfig(algorithm="asgd", options=options).validate(algorithms()))

    check(grow_back=True, min_ranks=3)
    for bad, says in ((dict(grow_back=True, ps_ranks=2), "--ps-ranks K > 1 is not built"),
                      (dict(grow_back=True, max_ranks=4), "--max-ranks does not apply to asgd"),
                      (dict(min_ranks=3), "--min-ranks applies to asgd with --grow-back only")):
        with pytest.raises(ConfigError, match=says):
            check(**bad)
