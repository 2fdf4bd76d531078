"""The direct path of :func:`hpcasync.comm.allreduce`: one ``MPI_Allreduce``, nothing around it.

Where ``algorithm="auto"`` chose MPI for a message (:mod:`.tune`), a CPU float32/64 or integer
tensor without compression or piecing is reduced by a single mpi4py call -- no step generator, no
handle (those cost ~10 us a call, more than a 4 KiB allreduce takes). What remains is bookkeeping
of about a microsecond, kept small by caching per communicator and per buffer:

* the decision "MPI for (bytes, dtype)" per communicator, in a dict keyed by the communicator's
  handle (the entry is dropped when the communicator is freed, see :mod:`.cache`);
* the ``[numpy view, MPI datatype]`` of buffers up to :data:`VIEW_MAX_BYTES`, keyed by (address,
  bytes, dtype): ``Tensor.numpy()`` alone costs ~1.3 us. A cached view keeps its memory alive, so
  an address in the cache is never reused by another tensor; at most :data:`VIEW_SLOTS` views
  (``VIEW_SLOTS * VIEW_MAX_BYTES`` = 16 MiB) are held, the oldest dropped first;
* the whole call per tensor *object* (:data:`_calls`, keyed by ``id(tensor)``; the entry holds
  the tensor, so the id is not reused while it lives): a repeat call on the same tensor and
  communicator re-checks only what can change under the same object -- its address (``set_``,
  ``.data =``), its size (``resize_``), its dtype (``.data =`` a view of another dtype),
  ``requires_grad`` and contiguity (``transpose_``) -- and
  calls ``MPI_Allreduce``. That halves the bookkeeping (docs/design/comm.md).

With ``HPCASYNC_PERSISTENT=1`` a span of a registered storage (a FlatModel's) is instead reduced by
starting its persistent request (:mod:`.persistent`).

Example::

    from hpcasync.comm.direct import try_direct
    if not try_direct(comm, grads, average=True):
        ...                               # the general path
"""
from __future__ import annotations

import torch

from . import persistent
from .cache import on_free
from .ops import mpi_datatype, sum_op

VIEW_MAX_BYTES = 1 << 20
VIEW_SLOTS = 16
NATIVE = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8)

_decisions: dict[int, dict] = {}     # comm handle -> {(nbytes, dtype): (datatype, op) | None}
_views: dict[tuple, list] = {}       # (data_ptr, nbytes, dtype) -> [numpy view, datatype]
#: id(tensor) -> (tensor, comm, data_ptr, nbytes, [numpy view, datatype], op, dtype)
_calls: dict[int, tuple] = {}
_in_place = None


def forget(handle: int) -> None:
    """Drop the decisions of a communicator being freed (called by :mod:`.cache`)."""
    _decisions.pop(handle, None)
    _calls.clear()                   # rare (a communicator freed): forget every cached call


on_free(forget)


def try_direct(comm, tensor: torch.Tensor, average: bool) -> bool:
    """Reduce ``tensor`` in place with one MPI_Allreduce if ``auto`` chose MPI for it; return
    False (nothing done) when it takes the general path."""
    call = _calls.get(id(tensor))
    if (call is not None and call[1] is comm and call[0] is tensor
            and tensor.data_ptr() == call[2] and tensor.nbytes == call[3]
            and tensor.dtype is call[6] and not tensor.requires_grad and tensor.is_contiguous()):
        comm.Allreduce(_in_place, call[4], op=call[5])       # a repeat call: the checks above
    elif not _first_call(comm, tensor):
        return False
    if average:
        n = comm.Get_size()
        if n > 1:
            tensor.div_(n) if tensor.is_floating_point() else tensor.floor_divide_(n)
    return True


def _first_call(comm, tensor: torch.Tensor) -> bool:
    """:func:`try_direct` without a cached call: decide, reduce, and cache the call."""
    per = _decisions.get(comm.handle)
    key = (tensor.nbytes, tensor.dtype)
    hit = per.get(key, False) if per is not None else False
    if hit is False:
        hit = _decide(comm, tensor, key)
    if hit is None or not tensor.is_cpu or tensor.requires_grad or not tensor.is_contiguous():
        return False
    req = persistent.request(comm, tensor, *hit) if persistent.enabled() else None
    if req is not None:              # a registered span, HPCASYNC_PERSISTENT=1 (:mod:`.persistent`)
        req.Start()
        req.Wait()
    elif key[0] <= VIEW_MAX_BYTES:
        vkey = (tensor.data_ptr(), *key)
        buf = _views.get(vkey)
        if buf is None:
            if len(_views) >= VIEW_SLOTS:
                del _views[next(iter(_views))]
            buf = _views[vkey] = [tensor.numpy(), hit[0]]
        comm.Allreduce(_in_place, buf, op=hit[1])
        if len(_calls) >= VIEW_SLOTS:
            del _calls[next(iter(_calls))]
        _calls[id(tensor)] = (tensor, comm, vkey[0], key[0], buf, hit[1], key[1])
    else:
        comm.Allreduce(_in_place, [tensor.numpy(), hit[0]], op=hit[1])
    return True


def _decide(comm, tensor: torch.Tensor, key: tuple):
    """(datatype, op) when ``auto`` sends this (bytes, dtype) to MPI, else None (cached)."""
    global _in_place
    from mpi4py import MPI

    from .cache import comm_cache
    from .engine import pick_engine

    _in_place = MPI.IN_PLACE
    comm_cache(comm)          # an attribute on comm, so that freeing it calls forget()
    per = _decisions.setdefault(comm.handle, {})
    if len(per) > 256:
        per.clear()
    mpi = tensor.dtype in NATIVE and pick_engine(comm, key[0], "auto", False, tensor.dtype) is None
    per[key] = (mpi_datatype(tensor.dtype), sum_op(tensor.dtype)) if mpi else None
    return per[key]
