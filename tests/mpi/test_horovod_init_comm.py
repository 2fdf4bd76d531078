"""``hvd.init(comm=...)`` on part of the job, as Horovod allows: a sub-communicator (each half of
the job its own Horovod world) or a list of ``COMM_WORLD`` ranks (only those ranks call ``init``).
Checked against numpy (re-initialising real Horovod in the same processes is what hung before:
tests/mpi/test_horovod_process_sets.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import hpcasync.horovod as fh
from hpcasync.topology import set_default_topology
from tests.mpi_util import COMM, RANK, SIZE

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def fresh_facade():
    """The facade shut down before the test; afterwards shut down again, with the default
    topology forgotten, so that later tests build theirs on COMM_WORLD."""
    fh.shutdown()
    yield
    fh.shutdown()
    set_default_topology(None)
    COMM.Barrier()


def _value(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32) * (rank + 1)


def test_init_on_a_split_communicator_is_a_world_of_its_own(fresh_facade):
    if SIZE < 2:
        pytest.skip("needs 2 ranks")
    colour = RANK % 2
    members = [r for r in range(SIZE) if r % 2 == colour]
    sub = COMM.Split(colour, RANK)
    fh.init(comm=sub)
    assert (fh.size(), fh.rank()) == (len(members), members.index(RANK))
    got = fh.allreduce(_value(RANK), op=fh.Sum, name="split.sum")
    assert torch.equal(got, sum(_value(r) for r in members))
    first = fh.broadcast(_value(RANK), root_rank=0, name="split.bcast")
    assert torch.equal(first, _value(members[0]))
    gathered = fh.allgather(torch.tensor([[RANK]]), name="split.gather")
    assert gathered.flatten().tolist() == members
    sub.Free()


def test_init_on_a_list_of_ranks_leaves_the_others_out(fresh_facade):
    if SIZE < 2:
        pytest.skip("needs 2 ranks")
    chosen = list(range(SIZE - 1))            # every rank but the last calls init
    if RANK in chosen:
        fh.init(comm=chosen)
        assert (fh.size(), fh.rank()) == (len(chosen), RANK)
        got = fh.allreduce(_value(RANK), op=fh.Average, name="list.avg")
        want = np.mean([_value(r).numpy() for r in chosen], axis=0)
        assert np.allclose(got.numpy(), want, rtol=0, atol=1e-6)
    else:
        assert not fh.is_initialized()


@pytest.mark.parametrize("bad", [[0, 0], [-1], ["0"], []], ids=["repeated", "negative", "text",
                                                                 "empty"])
def test_a_bad_rank_list_is_one_valueerror_before_mpi_traffic(fresh_facade, bad):
    with pytest.raises(ValueError, match="distinct ranks of COMM_WORLD"):
        fh.init(comm=bad)
    assert not fh.is_initialized()


def test_a_rank_outside_its_list_is_told(fresh_facade):
    if SIZE < 2:
        pytest.skip("needs 2 ranks")
    other = [(RANK + 1) % SIZE]
    with pytest.raises(ValueError, match=f"called on rank {RANK}, which is not in the list"):
        fh.init(comm=other)


def test_shutdown_frees_what_init_on_a_communicator_built(fresh_facade):
    """``init(comm=...)`` builds a topology (a duplicate world, node-local and global
    communicators) and registers an exit barrier on it; ``shutdown()`` frees all of it, so
    init/shutdown cycles (and elastic resets) leave no communicators or exit hooks behind."""
    from mpi4py import MPI

    from hpcasync import api
    from hpcasync.horovod import state

    sub = COMM.Split(RANK % 2, RANK)
    hooks = dict(api._EXIT_HOOKS)
    for _ in range(3):
        fh.init(comm=sub)
        st = state.current()
        topo = st.roles.topology
        built = [topo.world, topo.local, topo.glob, api._EXIT_HOOKS[id(topo.world)][1],
                 st.comm, st.local, st.cross]
        assert all(c != MPI.COMM_NULL for c in built)
        fh.shutdown()
        assert [c == MPI.COMM_NULL for c in built] == [True] * len(built)   # each one freed
        assert api._EXIT_HOOKS == hooks                  # its exit barrier is gone too
    assert sub != MPI.COMM_NULL                          # the user's communicator stays theirs
    sub.Free()
