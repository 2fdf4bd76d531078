"""Everything passes: exit 0."""
import pytest

from tests.mpi_util import COMM, RANK, SIZE


def test_allreduce():
    assert COMM.allreduce(RANK) == SIZE * (SIZE - 1) // 2


@pytest.mark.parametrize("root", [0, 1])
def test_bcast(root):
    assert COMM.bcast(root if RANK == root else None, root=root) == root


@pytest.mark.skipif(SIZE < 100, reason="skips on every rank alike")
def test_skipped():
    pass


@pytest.mark.rank0
def test_rank0_only():
    assert RANK == 0
