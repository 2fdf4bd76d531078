"""Rank 1 alone fails, with no collective after the assert: the suite goes on, the run fails."""
from tests.mpi_util import COMM, RANK, SIZE


def test_rank1_fails_alone():
    assert RANK != 1, "only rank 1 fails this one"


def test_next_one_passes():
    assert COMM.allreduce(1) == SIZE
