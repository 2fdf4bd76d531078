"""Which engine reduces a message: MPI's own ``MPI_Allreduce`` or our shared-memory window.

``algorithm`` is ``"mpi"``, ``"shm"`` (one node only) or ``"auto"``: the window where
:mod:`.tune` measured it faster on this machine for that size, else MPI. Used by the allreduce
paths (:mod:`.allreduce`, :mod:`.direct`, :mod:`.hierarchical`)::

    engine = pick_engine(comm, nbytes, "auto", cuda_aware=False)    # None: MPI
"""
from __future__ import annotations

import torch

from ..errors import ConfigError, TopologyError
from .shm import ShmAllreduce
from .tune import use_shm

ALGORITHMS = ("auto", "mpi", "shm")


def pick_engine(comm, nbytes: int, algorithm: str, cuda_aware: bool,
                wire: torch.dtype = torch.float32) -> ShmAllreduce | None:
    """The shm engine to use for this reduction, or None for MPI (collective on first use)."""
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
    if algorithm == "mpi" or comm.Get_size() == 1 or (algorithm == "auto" and cuda_aware):
        return None
    engine = ShmAllreduce.for_comm(comm)
    if engine is None and algorithm == "shm":
        raise TopologyError("algorithm='shm' needs all ranks of the communicator on one node")
    if engine is not None and algorithm == "auto" and not use_shm(comm, nbytes, wire):
        return None
    return engine
