"""A real deadlock: rank 0 never joins the barrier the others wait in (run with a short
HPCASYNC_TEST_TIMEOUT_PER_TEST)."""
import time

from tests.mpi_util import COMM, RANK


def test_passes_first():
    COMM.Barrier()


def test_deadlocks():
    if RANK == 0:
        time.sleep(1000)
    COMM.Barrier()


def test_never_reached():
    COMM.Barrier()
