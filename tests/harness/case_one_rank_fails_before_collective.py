"""Rank 2 fails an assert while the other ranks go on into a collective: must end the job fast."""
from tests.mpi_util import COMM, RANK


def test_rank2_fails_before_barrier():
    assert RANK != 2, "rank 2 disagrees before the barrier"
    COMM.Barrier()
    COMM.allreduce(1)


def test_never_reached():
    COMM.Barrier()
