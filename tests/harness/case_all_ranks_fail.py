"""Every rank fails the same assert: an ordinary pytest failure; the next tests still run."""
from tests.mpi_util import COMM, SIZE


def test_every_rank_fails():
    total = COMM.allreduce(1)
    assert total == SIZE + 1, "every rank fails here"


def test_next_one_passes():
    assert COMM.allreduce(1) == SIZE
