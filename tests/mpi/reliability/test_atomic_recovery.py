"""A synchronous recovery is atomic (issue 23, item 3): it completes identically on every
survivor or starts again (:meth:`hpcasync.runtime.elastic.FaultTolerance.reset` over a
:class:`~hpcasync.runtime.recovery.SyncWorld`, its final
``MPI_Comm_agree``; docs/design/recovery.md).

Each hole with a real job under ``mpirun --with-ft ulfm`` and real SIGKILLs
(``HPCASYNC_INJECT_KILL_AT``): a second death inside the first one's recovery (after the state
broadcast, before the topology rebuild); a death at a DASO epoch end after the schedule closed
the epoch on the adopter (the epoch end is redone: counted once, its checkpoint written once);
survivors on both sides of a DASO epoch end (the schedule, batch counts and replicas of every
survivor are then an undisturbed run's).
"""
from __future__ import annotations

import pytest

from hpcasync.metrics import read_metrics
from tests.mpi.reliability.test_sync_failure import DASO, TRAIN, _run, _survived
from tests.mpi_util import last_summary, need_ulfm

HALF = TRAIN // 2
SHORT = ["--epochs", "1", "--train-limit", str(HALF)]     # (the later options win)


@pytest.mark.rank0
def test_ssgd_a_second_death_inside_the_first_recovery_restarts_it(tmp_path):
    """Rank 3 dies after step 10; rank 1 dies in that recovery once the adopted state has been
    broadcast (the others are in the topology rebuild). The recovery starts again on a fresh
    shrink: one recovery of two attempts, two dead, exit 0 on 2 ranks, replicas bitwise equal,
    the rest of epoch 1 re-sharded over the 2 survivors (steps counted exactly)."""
    need_ulfm()
    out, metrics, _ = _run(tmp_path, "ssgd", "3:step:10,1:recovery:1", extra=SHORT)
    assert out.returncode == 0, out.stderr[-3000:]
    s = last_summary(metrics)
    assert s["failed_ranks"] == [1, 3] and s["world_size"] == 2
    assert len(s["replica_sha256"]) == 2 and len(set(s["replica_sha256"])) == 1   # bitwise
    assert s["replica_sha256"][0] == s["params_sha256"]
    [f] = s["rank_failures"]
    assert f["survivors"] == [0, 2] and f["attempts"] == 2 and f["position"] == [1, 10, 1]
    rest = (HALF // 4 - 10 * 32) * 4 // 2 // 32          # the rest of epoch 1 over 2 ranks
    assert s["steps"] == 10 + rest, s["steps"]
    assert [r["epoch"] for r in read_metrics(metrics) if r["event"] == "epoch"] == [1]


@pytest.mark.rank0
def test_ssgd_an_attempt_that_failed_on_one_survivor_only_is_redone_by_all(tmp_path):
    """Rank 3 dies after step 10; in the recovery, rank 1's attempt fails after the attempt's
    last collective (injected ``recovered:...:fail``: an MPI call that reports a failure on one
    rank while it completed on the others). Only the final ``MPI_Comm_agree`` tells the others:
    every survivor starts a second attempt — one recovery of two attempts, one death, exit 0 on 3
    ranks, replicas bitwise equal. (Without the agreement the others train on while rank 1
    shrinks again alone: the job hung, measured.)"""
    need_ulfm()
    out, metrics, _ = _run(tmp_path, "ssgd", "3:step:10,1:recovered:1:0:fail", extra=SHORT)
    assert out.returncode == 0, out.stderr[-3000:]
    s = last_summary(metrics)
    assert s["failed_ranks"] == [3] and s["world_size"] == 3
    assert len(s["replica_sha256"]) == 3 and len(set(s["replica_sha256"])) == 1   # bitwise
    [f] = s["rank_failures"]
    assert f["survivors"] == [0, 1, 2] and f["attempts"] == 2 and f["position"] == [1, 10, 1]


def _checks_daso_schedule(tmp_path, kill: str, ckpt) -> tuple[dict, dict]:
    """One DASO job (2 nodes of 2; epoch 1 cycling, epoch 2 the cool-down) with ``kill`` and a
    checkpoint directory; rank 3 dies at epoch 1's end. Asserts what every survivor must hold
    after the recovery whichever side of the epoch end it was on: exit 0, replicas bitwise
    equal, and the schedule of an undisturbed run at the same position — each epoch record's
    own count (``daso_epoch``), phase, knobs, plateau and batch count equal those of a
    :class:`~hpcasync.daso.DasoSchedule` driven through the same epochs (their batch counts:
    4 ranks in epoch 1, the 3 survivors in epoch 2) with the same losses —, and epoch 1's
    checkpoint written once. Returns the summary and the one ``rank_failed`` record."""
    from hpcasync.checkpoint import checkpoint_name
    from hpcasync.daso import DasoSchedule

    out, metrics, _ = _run(tmp_path, "daso", kill, extra=[*DASO, "--checkpoint-dir", str(ckpt)])
    s = _survived(out, metrics, [3], params_digest=False)
    assert s["replicas_identical"]
    [f] = s["rank_failures"]
    records = read_metrics(metrics)
    epochs = [r for r in records if r["event"] == "epoch"]
    undisturbed = DasoSchedule(total_epochs=2, num_groups=2, warmup_epochs=0, cooldown_epochs=1)
    keys = ("daso_epoch", "daso_phase", "daso_plateau", "daso_batches", "daso_global_skip",
            "daso_local_skip", "daso_batches_to_wait")
    for r, n in zip(epochs, (TRAIN // 4 // 32, TRAIN // 3 // 32)):
        for _ in range(n):
            undisturbed.advance(n)
        want = undisturbed.end_epoch(r["train_loss"])
        assert {k: r[k] for k in keys} == {k: want[k] for k in keys}, (r, want)
    assert s["daso_schedule"] == [[r["epoch"], r["daso_phase"], r["daso_global_skip"],
                                   r["daso_local_skip"], r["daso_batches_to_wait"]]
                                  for r in epochs]
    assert s["steps"] == TRAIN // 4 // 32 + TRAIN // 3 // 32, s["steps"]
    step = TRAIN // 4 // 32                     # labelled with the epoch's last step
    assert (ckpt / checkpoint_name(1, step)).is_file()
    assert [r["epoch"] for r in records if r["event"] == "checkpoint"] == [1, 2]   # once each
    return s, f


@pytest.mark.rank0
def test_daso_a_death_after_the_schedule_closed_the_epoch_redoes_that_epoch_end_once(tmp_path):
    """Epoch 1's last collective (the checkpoint's barrier, after rank 0 wrote the checkpoint)
    fails on every survivor (``R:epoch_done:1:0.5:fail``), rank 3 dies right after it: all at
    (epoch 1, all batches done), DASO.epoch_end already done on rank 0, the adopter. The epoch
    end is redone from the schedule as it was before it (counted once, not twice) and rank 0
    does not write the checkpoint it has written (once)."""
    need_ulfm()
    fail = ",".join(f"{r}:epoch_done:1:0.5:fail" for r in range(3))
    _, f = _checks_daso_schedule(tmp_path, f"3:epoch_done:1,{fail}", tmp_path / "ckpt")
    assert f["position"] == [1, TRAIN // 4 // 32, 1] and -1 not in f["steps_behind"], f


@pytest.mark.rank0
def test_daso_survivors_on_both_sides_of_an_epoch_end(tmp_path):
    """Epoch 1's last collective (the checkpoint's barrier) completes on ranks 1 and 2 and fails
    on rank 0, the checkpoint's writer (``0:epoch_done:1:0.5:fail``: Open MPI does that now and
    then, 1 run in 7 here with a kill inside the collective; made deterministic), rank 3 dies
    right after it. Ranks 1 and 2 start epoch 2 and fail in its first collective: positions
    (2, 0) and (1, all batches done), the record's ``steps_behind`` holds -1. Every survivor
    takes epoch 2 planned over the 3 of them, rank 1's schedule and replica (the schedule checks
    above); epoch 1's checkpoint, written before the barrier, is not written again."""
    need_ulfm()
    _, f = _checks_daso_schedule(tmp_path, "3:epoch_done:1,0:epoch_done:1:0.5:fail",
                                 tmp_path / "ckpt")
    assert f["position"] == [2, 0, 1] and f["steps_behind"] == [-1, 0, 0], f
    assert f["adopted_from"] == 1
