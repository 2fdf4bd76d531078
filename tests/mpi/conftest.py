"""Fixtures shared by the MPI tests (the MPI machinery itself is tests/conftest.py's)."""
import pytest

from tests.mpi_util import HOROVOD_ERROR


@pytest.fixture(scope="module")
def backends():
    """{"facade": hpcasync.horovod, "horovod": horovod.torch (when it imports)}, both initialised:
    the Horovod facade tests run each case on both and compare."""
    import hpcasync.horovod as fh

    fh.init()
    found = {"facade": fh}
    if HOROVOD_ERROR is None:
        import horovod.torch as rh

        rh.init()
        found["horovod"] = rh
    return found
