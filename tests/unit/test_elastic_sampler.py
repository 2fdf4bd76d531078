"""``hpcasync.elastic.ElasticSampler`` (hpcasync/data/sharding.py), pure: what "resume" means.

The position ``processed`` counts the samples of epoch e the world has trained; the rest of π_e
is dealt round-robin in whole batches. Properties: a step of every rank trains exactly the next
``S·B`` samples of π_e; resuming at a committed position on a world of another size trains the
rest of π_e, never a sample twice, and leaves out only a tail shorter than ``S·B``.
"""
from __future__ import annotations

import pytest
import torch

from hpcasync.data.sharding import ElasticSampler, epoch_permutation
from hpcasync.errors import ConfigError


def _world(length, size, b, **kw):
    return [ElasticSampler(length, batch_size=b, rank=r, num_replicas=size, **kw)
            for r in range(size)]


def _step(samplers, j):
    """Batch j of every rank."""
    b = samplers[0].batch_size
    return [s.indices()[j * b:(j + 1) * b].tolist() for s in samplers]


def test_each_step_of_the_world_is_the_next_slice_of_the_epoch_order():
    samplers = _world(100, 4, 3, seed=7)
    for s in samplers:
        s.set_epoch(2)
    order = epoch_permutation(100, seed=7, epoch=2).tolist()
    assert len(samplers[0]) == (100 // 12) * 3 and samplers[0].num_batches == 8
    for j in range(samplers[0].num_batches):
        batch = [i for rank in _step(samplers, j) for i in rank]
        assert sorted(batch) == sorted(order[j * 12:(j + 1) * 12])


@pytest.mark.parametrize("sizes", [(4, 3), (4, 3, 1), (3, 4), (5, 2, 2)])
def test_resuming_on_another_world_trains_the_rest_exactly_once(sizes):
    """Train some steps on each world in turn (the position committed and handed on, as
    State.sync does), then the last world to the end of the epoch."""
    length, b, steps_each = 203, 4, 3
    order = epoch_permutation(length, seed=3, epoch=0).tolist()
    trained, state = [], None
    for k, size in enumerate(sizes):
        samplers = _world(length, size, b, seed=3)
        if state is not None:
            for s in samplers:
                s.load_state_dict(state)
        stop = samplers[0].num_batches if k == len(sizes) - 1 else steps_each
        dealt = [s.indices().tolist() for s in samplers]       # a loader's iterator, once
        for j in range(stop):
            for rank in dealt:
                trained += rank[j * b:(j + 1) * b]
            for s in samplers:
                s.record_batch()
        state = samplers[0].state_dict()
    assert len(trained) == len(set(trained))                       # never twice
    assert sorted(trained) == sorted(order[:len(trained)])         # a prefix of π_e: none lost
    assert length - len(trained) < sizes[-1] * b                  # only the tail is left out
    assert state["processed"] == len(trained)


def test_rank_and_size_survive_a_restore_and_state_of_another_sampler_is_refused():
    s = ElasticSampler(50, batch_size=5, rank=1, num_replicas=2, seed=0)
    saved = s.state_dict()
    s.set_world(0, 3)
    s.record_batch()
    s.load_state_dict(saved)
    assert (s.rank, s.num_replicas, s.processed) == (0, 3, 0)
    with pytest.raises(ConfigError, match="batch_size=4"):
        s.load_state_dict({**saved, "batch_size": 4})
    with pytest.raises(ConfigError, match="batches of 5"):
        s.record_batch(0, 6)
    with pytest.raises(ConfigError, match="rank"):
        s.set_world(3, 3)


def test_unshuffled_order_and_an_epoch_restart():
    s = ElasticSampler(10, batch_size=2, rank=1, num_replicas=2, shuffle=False)
    assert list(s) == [1, 3, 5, 7]                    # 10 // 4 = 2 batches of 2
    s.record_batch()
    assert list(s) == [5, 7]
    s.set_epoch(1)
    assert s.processed == 0 and list(s) == [1, 3, 5, 7]
    assert torch.equal(s.order(), torch.arange(10))
    with pytest.raises(ConfigError, match="past the end"):
        for _ in range(3):
            s.record_batch()
