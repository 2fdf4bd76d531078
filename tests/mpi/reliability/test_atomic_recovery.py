"""A synchronous recovery is atomic (issue 23, item 3): it completes identically on every
survivor or starts again (:meth:`hpcasync.runtime.recovery.SyncRecovery.recover`, its final
``MPI_Comm_agree``; docs/design/recovery.md).

Two holes, each with a real job under ``mpirun --with-ft ulfm`` and real SIGKILLs
(``HPCASYNC_INJECT_KILL_AT``): a second death inside the first one's recovery (after the state
broadcast, before the topology rebuild), and a death inside an epoch end's last collective that
leaves the survivors on both sides of the epoch end (DASO, whose batch counts must then agree).
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
def test_daso_a_death_inside_an_epoch_ends_last_collective(tmp_path):
    """Epoch 1 (cycling) ends with the preemption agreement, an allreduce: rank 1 comes to it
    1 s late, rank 3 is SIGKILLed inside it 0.2 s after entering. Open MPI may complete it on
    some survivors (they start epoch 2, planned over 4 ranks) and fail it on others (the
    record's ``steps_behind`` then holds -1; seen in 1 of 7 runs here, timing-dependent — the
    deterministic check of the plan is tests/unit/test_recovery_cursor.py). Either way every
    survivor plans epoch 2 over the 3 survivors: exit 0, the 3-rank batch count, replicas
    bitwise equal at the end."""
    need_ulfm()
    out, metrics, _ = _run(tmp_path, "daso", "3:epoch_agree:1:0.2:bg,1:epoch_agree:1:1:sleep",
                           extra=DASO)
    s = _survived(out, metrics, [3], params_digest=False)
    assert s["replicas_identical"]
    [f] = s["rank_failures"]
    assert f["position"] in ([2, 0, 1], [1, TRAIN // 4 // 32, 1]), f
    assert s["steps"] == TRAIN // 4 // 32 + TRAIN // 3 // 32, s["steps"]
    assert [r["world_size"] for r in read_metrics(metrics) if r["event"] == "epoch"] == [4, 3]
