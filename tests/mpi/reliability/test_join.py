"""Grow back (``--grow-back``, :mod:`hpcasync.runtime.join`): after a real SIGKILL under
``mpirun --with-ft ulfm`` the survivors of an SSGD run spawn a replacement (``MPI_Comm_spawn``),
merge it in, send it the live state and train on at full size — ending with the starting world
size, replicas bitwise equal, the step count and the final parameters of an undisturbed run of the
same seed (each joiner takes the dead rank's place: same shards, same reduction order). Without a
free slot the run goes on shrunk with one warning line, or ends with one line below
``--min-ranks``. ULFM is Open-MPI-only (skipped under MPICH). Design: docs/design/growth.md.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from hpcasync.launch import mpiexec_command
from hpcasync.metrics import read_metrics
from tests.mpi_util import REPO, clean_env, last_summary, mpiexec, need_ulfm

TRAIN = 3000                             # 23 steps of 4 x 32 per epoch
DATA = ["train", "--dataset", "fashion-mnist-mini", "--train-limit", str(TRAIN), "--epochs", "2",
        "--progress", "off", "--algorithm", "ssgd"]
JOB_TIMEOUT = 150


def _run(tmp_path, name: str, kill: str = "", *, extra=(), launcher=None):
    metrics = tmp_path / f"{name}.jsonl"
    cmd = [*(launcher or mpiexec(4, ft=True)), sys.executable, "-m", "hpcasync.cli", *DATA,
           "--metrics", str(metrics), *extra]
    env = clean_env(HPCASYNC_INJECT_KILL_AT=kill, HPCASYNC_JOIN_TIMEOUT="100")
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=JOB_TIMEOUT)
    return out, metrics


@pytest.mark.rank0
@pytest.mark.timeout(2 * JOB_TIMEOUT + 30)
def test_ssgd_grows_back_to_the_undisturbed_runs_parameters(tmp_path):
    """Rank 0 dies at step 5 (the joiner becomes rank 0; a survivor keeps the metrics stream),
    then rank 3 at its step 30 (epoch 2): two joins, both at full size again. Against an
    undisturbed run: the same steps, the same final parameters bitwise, the same accuracy."""
    need_ulfm()
    base, mbase = _run(tmp_path, "base")
    assert base.returncode == 0, base.stderr[-3000:]
    out, metrics = _run(tmp_path, "grow", "0:step:5,3:step:30", extra=["--grow-back"])
    assert out.returncode == 0, out.stderr[-3000:]
    b, s = last_summary(mbase), last_summary(metrics)
    assert s["world_size"] == 4 and s["failed_ranks"] == [0, 3]
    joins = s["rank_joins"]
    assert [j["ranks"] for j in joins] == [[0], [3]] and [j["joined"] for j in joins] == [[4], [5]]
    assert [j["world_size"] for j in joins] == [4, 4]
    assert [j["position"][:2] for j in joins] == [[1, 5], [2, 30 - 23]]
    digests = s["replica_sha256"]
    assert len(digests) == 4 and len(set(digests)) == 1, digests        # replicas bitwise equal
    assert s["steps"] == b["steps"] == 2 * (TRAIN // 4 // 32)
    assert s["params_sha256"] == b["params_sha256"]                     # = the undisturbed run
    assert s["test_accuracy"] == b["test_accuracy"]
    records = read_metrics(metrics)
    assert [r["event"] for r in records if r["event"] in ("rank_failed", "rank_joined")] == \
        ["rank_failed", "rank_joined"] * 2
    assert [r["world_size"] for r in records if r["event"] == "epoch"] == [4, 4]
    # the summary's wall time is the run's, also when a joiner (rank 0's) writes it
    assert s["wall_time_s"] >= max(r["wall_time_s"] for r in records if r["event"] == "epoch")
    assert out.stderr.count("grow-back: 1 rank(s) joined") == 2
    assert all(0 < j["join_s"] < 60 for j in joins)


@pytest.mark.rank0
@pytest.mark.timeout(2 * JOB_TIMEOUT + 30)
def test_no_free_slot_goes_on_shrunk_or_ends_below_min_ranks(tmp_path):
    """Four slots and no --oversubscribe: the spawn fails. Above --min-ranks the run finishes on
    3 ranks with one warning line (every rank exits 0; prterun exits 213 for the failed spawn);
    with --min-ranks 4 it ends, non-zero, with one line."""
    need_ulfm()
    launcher = [*mpiexec_command(4, ft=True, oversubscribe=False, bind="none"),
                "--host", "localhost:4"]
    extra = ["--grow-back", "--epochs", "1"]
    out, metrics = _run(tmp_path, "shrunk", "2:step:5", extra=extra, launcher=launcher)
    assert out.returncode == 213, out.stderr[-3000:]   # prterun's record of the failed spawn
    s = last_summary(metrics)
    assert s["world_size"] == 3 and "rank_joins" not in s
    assert out.stderr.count("grow-back: spawning 1 replacement(s) failed") == 1
    out, _ = _run(tmp_path, "min", "2:step:5", extra=[*extra, "--min-ranks", "4"],
                  launcher=launcher)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if "fewer than --min-ranks 4" in ln]
    assert len(lines) == 1 and "rank(s) 2 died; 3 left and spawning 1 replacement(s) failed" \
        in lines[0], out.stderr[-3000:]


@pytest.mark.rank0
@pytest.mark.no_mpi
def test_grow_options_are_checked_before_mpi_and_the_places_of_the_joiners():
    from hpcasync.config import TrainConfig
    from hpcasync.errors import ConfigError
    from hpcasync.runtime import algorithms, join

    def check(algorithm="ssgd", **options):
        cfg = TrainConfig(algorithm=algorithm, options=options).validate(algorithms())
        join.validate(cfg)

    check(grow_back=True, max_ranks=4, min_ranks=2)
    for bad, says in ((dict(max_ranks=4), "give --grow-back too"),
                      (dict(grow_back=True, max_ranks=2, min_ranks=3), "above --max-ranks"),
                      (dict(grow_back=True, min_ranks=0), "--min-ranks must be")):
        with pytest.raises(ConfigError, match=says):
            check(**bad)
    # back to the size before the death: the joiners take the dead ranks' places
    assert join._order(4, [0, 1, 3], 3, 1) == ([0, 1, 3], [2], True)
    assert join._order(4, [1, 2], 2, 2) == ([1, 2], [0, 3], True)
    # another size: survivors first, in order, the joiners after them
    assert join._order(4, [0, 1, 3], 3, 2) == ([0, 1, 2], [3, 4], False)
