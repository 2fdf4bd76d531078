"""After a recovery every survivor's :class:`~hpcasync.runtime.recovery.EpochCursor` has the
same plan, whichever side of an epoch end it was on (issue 23, item 3; the MPI jobs:
tests/mpi/reliability/test_atomic_recovery.py). No MPI: the cursor is bookkeeping over
:class:`~hpcasync.data.sharding.EpochShards`; its context carries only sizes and the seed.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hpcasync.runtime.context import Progress
from hpcasync.runtime.recovery import EpochCursor

N, B, SEED = 6000, 32, 7


def _cursor(size: int) -> EpochCursor:
    ctx = SimpleNamespace(train=range(N), topo=SimpleNamespace(size=size, rank=0),
                          cfg=SimpleNamespace(seed=SEED, batch_size=B, epochs=3),
                          progress=Progress(False))
    return EpochCursor(ctx)


def _at(epoch: int, done: int, *, size: int = 4) -> EpochCursor:
    """A cursor of a 4-rank world that has planned ``epoch`` and trained ``done`` batches."""
    cur = _cursor(size)
    cur.epoch = epoch
    cur.begin_epoch()
    cur.done = done
    return cur


def _survive(cur: EpochCursor, adopted: tuple, keep) -> EpochCursor:
    cur.ctx.topo.size = 3                        # ranks 0, 1, 2 of 4 survive
    cur.adopt(adopted, keep=keep, size_before=4)
    cur.begin_epoch()
    return cur


@pytest.mark.parametrize("keep", [None, [0, 1, 2]], ids=["reshard", "keep"])
def test_both_sides_of_an_epoch_end_adopt_the_next_epoch_planned_over_the_survivors(keep):
    """Adopted (2, 0): nobody trained a batch of epoch 2, so it is planned over the 3
    survivors on every rank — also on one that had planned it over 4 before the death."""
    nb4 = _at(1, 0).nbatches
    ahead, behind = _at(2, 0), _at(1, nb4)           # past the epoch end / still before it
    for cur in (ahead, behind):
        _survive(cur, (2, 0, 1), keep)
    fresh = _at(2, 0, size=3)
    for cur in (ahead, behind):
        assert (cur.epoch, cur.done, cur.nbatches) == (2, 0, fresh.nbatches)
        assert all(torch.equal(a, b) for a, b in zip(cur.plan.shards, fresh.plan.shards))
    assert fresh.nbatches == N // 3 // B != nb4


@pytest.mark.parametrize("keep", [None, [0, 1, 2]], ids=["reshard", "keep"])
def test_a_rank_behind_the_epoch_start_makes_the_plan_the_others_made(keep):
    """Adopted (2, 5): the ranks ahead trained 5 batches of epoch 2 on its 4-rank plan (DASO's
    node-local steps need no rank of another node); the one behind has no plan for epoch 2 and
    makes that same plan before re-sharding (or keeping shards), so all end equal."""
    nb4 = _at(1, 0).nbatches
    ahead, behind = _at(2, 5), _at(1, nb4)
    for cur in (ahead, behind):
        _survive(cur, (2, 5, 1), keep)
    assert (ahead.epoch, ahead.done, ahead.nbatches) == (behind.epoch, behind.done,
                                                         behind.nbatches)
    assert all(torch.equal(a, b) for a, b in zip(ahead.plan.shards, behind.plan.shards))
    assert ahead.done == (5 if keep else 0)


@pytest.mark.parametrize("keep", [None, [0, 1, 3]])
def test_a_moved_plan_goes_into_a_checkpoint_and_a_resume_takes_it(keep):
    """A checkpoint inside an epoch a recovery re-sharded (or kept, DASO) carries the plan and
    the count of the epoch's losses; a cursor resumed from it (the survivors' size) trains the
    rest of that plan, not a fresh deal. A start's plan is not carried; another size is refused."""
    from hpcasync.errors import CheckpointError

    assert "shards" not in _at(1, 5).plan_state()
    cur = _survive(_at(1, 17), (1, 17, 1), keep)
    cur.done, cur.loss_n, cur.loss_sum = 4, 21, 9.5
    saved = {"epoch": 1, "batch": 4, **cur.plan_state()}
    assert saved["loss_n"] == 21 and len(saved["shards"]) == 3
    saved["loss_sums"] = [saved.pop("loss_sum"), 8.0, 7.0]      # (consistent_point's gather)
    resumed = _cursor(3)
    resumed.ctx.topo.rank = 1
    resumed.done = saved["batch"]
    resumed.resume_plan(saved)
    resumed.begin_epoch()
    assert (resumed.loss_n, resumed.loss_sum) == (21, 8.0) and resumed.moved
    assert all(torch.equal(a, b) for a, b in zip(resumed.plan.shards, cur.plan.shards))
    assert not torch.equal(resumed.plan.shards[0], _at(1, 0, size=3).plan.shards[0])
    resumed.next_epoch()
    resumed.begin_epoch()
    assert not resumed.moved and "shards" not in resumed.plan_state()
    with pytest.raises(CheckpointError, match="3 shards, this run has 4 ranks"):
        _cursor(4).resume_plan(saved)


def test_a_checkpoint_inside_an_epoch_resumed_with_other_batches_is_a_one_line_error():
    """A mid-epoch checkpoint holds its batch size, training-set size and seed; resumed with
    another (``--batch-size``, ``--train-limit``, ``--seed``), its batch count would point into
    other batches, or another permutation (at
    64 a checkpoint at batch 18 of 32 ended the epoch at once, its rest untrained): one line.
    The same sizes resume; a checkpoint without them (older files) is taken as it is."""
    from hpcasync.errors import CheckpointError

    state = {**_at(2, 18).plan_state(), "epoch": 2, "batch": 18}
    assert (state["batch_size"], state["train_size"]) == (B, N)
    _cursor(4).resume_plan(state)
    for change in ({"batch_size": 2 * B}, {"train": range(N // 2)}, {"seed": SEED + 1}):
        cur = _cursor(4)
        if "train" in change:
            cur.ctx.train = change["train"]
        else:
            vars(cur.ctx.cfg).update(change)
        with pytest.raises(CheckpointError, match=r"inside epoch 2 \(batch 18\) with "
                           rf"--batch-size {B} over {N} training examples, --seed {SEED}") as err:
            cur.resume_plan(state)
        assert "\n" not in str(err.value)
    old = {k: v for k, v in state.items() if k not in ("batch_size", "train_size", "data_seed")}
    cur = _cursor(4)
    cur.ctx.cfg.batch_size = 2 * B
    cur.resume_plan(old)


def test_a_parameter_server_checkpoint_resumed_with_other_batches_is_a_one_line_error():
    """The CLI's PS resume (``ps.runtime.check_resumed_data``): another batch count per worker
    or another seed is one line; the same resumes; a file without the seed is taken."""
    from hpcasync.errors import CheckpointError
    from hpcasync.ps.runtime import check_resumed_data

    cfg = SimpleNamespace(seed=SEED)
    state = {"batches_per_worker": 16, "data_seed": SEED}
    check_resumed_data(state, cfg, 16)
    check_resumed_data({"batches_per_worker": 16}, SimpleNamespace(seed=SEED + 1), 16)
    with pytest.raises(CheckpointError, match="16 batches per worker and epoch, this run 8"):
        check_resumed_data(state, cfg, 8)
    with pytest.raises(CheckpointError, match=f"--seed {SEED}, this run has --seed {SEED + 1}"):
        check_resumed_data(state, SimpleNamespace(seed=SEED + 1), 16)
