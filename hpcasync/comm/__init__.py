"""Communication layer: flat model buffers, (non)blocking flat / shared-memory / hierarchical
allreduce, 16-bit reduction ops.

* :mod:`.flat`         ``FlatModel`` — parameters, grads, BN buffers as flat float32 vectors (views)
* :mod:`.allreduce`    ``allreduce`` / ``iallreduce`` — auto-picks the shm window or MPI
* :mod:`.shm`          ``ShmAllreduce`` — node-local allreduce through ``MPI.Win.Allocate_shared``
* :mod:`.hierarchical` node reduce-scatter -> across-node allreduce -> node allgather
* :mod:`.ops`          bf16/fp16 MPI sum ops (never ``MPI.SUM`` on raw 16-bit bytes), dtype maps
* :mod:`.compress`     16-bit compression as encode/decode around a reduction
* :mod:`.handle`       ``Handle`` — one reduction in flight (``wait``/``test``, ``name``, ``step``)
* :mod:`.persistent`   ``MPI_Allreduce_init`` on fixed buffers (off unless ``HPCASYNC_PERSISTENT=1``)

Design notes and measurements: docs/design/comm.md.
"""
from .allreduce import DASO_CHUNK_ELEMS, allreduce, iallreduce
from .flat import FlatModel, flatten, unflatten_into
from .handle import Handle
from .hierarchical import hierarchical_allreduce, ihierarchical_allreduce
from .ops import bf16_sum_op, fp16_sum_op, mpi_buffer, mpi_datatype, sum_op
from .shm import ShmAllreduce

__all__ = [
    "DASO_CHUNK_ELEMS", "FlatModel", "Handle", "ShmAllreduce", "allreduce", "bf16_sum_op",
    "flatten", "fp16_sum_op", "hierarchical_allreduce", "iallreduce", "ihierarchical_allreduce",
    "mpi_buffer", "mpi_datatype", "sum_op", "unflatten_into",
]
