"""``import hpcasync.horovod as hvd``: Horovod's PyTorch API on hpcasync's MPI layer.

A script written for ``horovod.torch`` runs with its import line changed — no Horovod build, any
torch hpcasync runs on — and can switch algorithm with one keyword::

    import hpcasync.horovod as hvd                  # was: import horovod.torch as hvd

    hvd.init()                                      # PS algorithms: hvd.init(algorithm="smega2")
    sampler = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank())
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    #     ... algorithm="daso", epochs=E, steps_per_epoch=len(loader)   (or "odsgd", a PS rule)
    for x, y in loader:
        opt.zero_grad(); F.nll_loss(model(x), y).backward(); opt.step()

Where each part lives: :mod:`.basics` (init, ranks, the PS carve-out), :mod:`.collectives`
(allreduce, allgather, broadcast, alltoall, reducescatter, barrier, join, handles),
:mod:`.functions` (broadcast_parameters / _optimizer_state / _object, allgather_object),
:mod:`.compression`, :mod:`.optimizer` (DistributedOptimizer), :mod:`.server` (the server rank of
a PS algorithm), :mod:`.process_sets` (``ProcessSet``, ``add_process_set``, ``process_set=``),
:mod:`.adasum` (``op=hvd.Adasum``), :mod:`.sparse` (``sparse_allreduce_async``, sparse gradients),
:mod:`.timeline` (``HOROVOD_TIMELINE``, ``start_timeline``), :mod:`.sync_batch_norm`
(``SyncBatchNorm``), :mod:`.per_tensor` (custom compressors, non-float32 parameters),
:mod:`.elastic` (``hvd.elastic``: survives dead ranks under ULFM). Each module's docstring lists
where it differs from Horovod.
"""
from __future__ import annotations

from .basics import (ProcessSet, add_process_set, ccl_built, cross_rank, cross_size, cuda_built,
                     ddl_built, global_process_set, gloo_built, gloo_enabled, init,
                     is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                     mpi_enabled, mpi_threads_supported, nccl_built, rank, remove_process_set,
                     rocm_built, shutdown, size, start_timeline, stop_timeline)
from .collectives import (Adasum, Average, HorovodInternalError, Max, Min, Product, Sum,
                          allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                          allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
                          broadcast_, broadcast_async, broadcast_async_, grouped_allgather,
                          grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                          grouped_allreduce_async, grouped_allreduce_async_,
                          grouped_reducescatter, grouped_reducescatter_async, join, poll,
                          reducescatter, reducescatter_async, synchronize)
from . import elastic
from .compression import Compression, Compressor
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .optimizer import DistributedOptimizer
from .sparse import sparse_allreduce_async
from .sync_batch_norm import SyncBatchNorm

__all__ = [n for n in dir() if not n.startswith("_") and n != "annotations"]

