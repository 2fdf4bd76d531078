"""Fixtures shared by the MPI tests (the MPI machinery itself is tests/conftest.py's)."""
import os
import tempfile

import pytest

from tests.mpi_util import COMM, HOROVOD_ERROR, RANK


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


@pytest.fixture
def gloo(request):
    """A sub-communicator of the first ``request.param`` ranks (None elsewhere) and a Gloo
    process group of torch.distributed on the same ranks (the references of the
    communication-efficient methods run on it, in the same job)."""
    import torch.distributed as dist
    from mpi4py import MPI

    n = request.param
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")       # one host: over the loopback
    if dist.is_initialized():         # left by another test (the bench's DDP column)
        dist.destroy_process_group()
    sub = COMM.Split(0 if RANK < n else MPI.UNDEFINED, RANK)
    path = COMM.bcast(tempfile.mktemp(prefix="hpcasync-gloo-") if RANK == 0 else None)
    if sub != MPI.COMM_NULL:
        dist.init_process_group("gloo", store=dist.FileStore(path, n), rank=RANK, world_size=n)
    yield None if sub == MPI.COMM_NULL else sub
    if sub != MPI.COMM_NULL:
        dist.destroy_process_group()
        sub.Free()
        if RANK == 0:           # (torch's FileStore may remove it as its last client leaves)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
