"""Persistent allreduce: ``MPI_Allreduce_init`` once per fixed buffer span, then Start/Wait.

A buffer that stays at one address for the whole run (a :class:`~hpcasync.comm.FlatModel` storage:
SSGD reduces the same gradient buckets every step) can be reduced by an MPI 4 persistent
collective. Only *registered* storages qualify (:func:`register`; FlatModel registers its own),
and a request is keyed by the span's offset in its storage, never by a raw address: building one
is a collective call, so every rank must build at the same call (docs/design/comm.md says why).
Requests are freed with their communicator (:func:`~hpcasync.comm.cache.on_free`) or storage.

Switch: ``HPCASYNC_PERSISTENT=1`` makes ``allreduce``/``iallreduce`` use them where MPI reduces a
registered CPU span (``algorithm="auto"`` chose MPI, or ``"mpi"``); ``0`` never; unset:
:data:`DEFAULT`. Set it alike on every rank.

Example::

    flat = FlatModel(net)                              # registers flat's storages
    persistent.allreduce(comm, flat.grads, average=True)   # first call builds, later ones start
"""
from __future__ import annotations

import weakref

import torch

from .. import environ
from ..errors import ConfigError
from .cache import on_free, private_dup
from .ops import check_dtype, mpi_datatype, sum_op

#: the default of ``HPCASYNC_PERSISTENT`` (off: no faster than MPI_Allreduce in the comparisons
#: of docs/design/comm.md, "Default: off")
DEFAULT = False
#: requests one storage may hold; later new spans take the plain path (the same on every rank)
MAX_PER_STORAGE = 1024
_ENV = "HPCASYNC_PERSISTENT"

_regions: dict[int, "_Region"] = {}     # id(base tensor) -> its region
_on: bool | None = None                 # resolved switch (None: read the environment first)
_supported: bool | None = None


class _Region:
    """A registered storage: a weak reference to its base tensor and the requests on its spans."""

    __slots__ = ("ref", "requests", "__weakref__")

    def __init__(self, base: torch.Tensor):
        self.ref = weakref.ref(base)
        self.requests: dict[tuple, object] = {}   # (comm, offset, nbytes, datatype, op) -> request


def register(tensor: torch.Tensor) -> torch.Tensor:
    """Mark the storage under ``tensor`` as fixed for the persistent path (returns ``tensor``).

    Every rank must register the same layout (persistent requests are built collectively); the
    registration ends, and its requests are freed, when the base tensor is garbage."""
    base = tensor if tensor._base is None else tensor._base
    key = id(base)
    region = _regions.get(key)
    if region is None or region.ref() is not base:
        region = _regions[key] = _Region(base)
        weakref.finalize(base, _release, key, weakref.ref(region)).atexit = False
    return tensor


def registered(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` lies in a registered storage."""
    return _region_of(tensor) is not None


def enabled() -> bool:
    """Whether allreduce()/iallreduce() take the persistent path (``HPCASYNC_PERSISTENT``)."""
    global _on
    if _on is None:
        _on = environ.switch(_ENV, DEFAULT) and supported()
    return _on


def set_enabled(flag: bool | None) -> None:
    """Force the switch (True/False) or go back to the environment (None); alike on every rank."""
    global _on
    _on = None if flag is None else bool(flag) and supported()


def supported() -> bool:
    """True when the MPI library implements ``MPI_Allreduce_init`` (probed once, locally)."""
    global _supported
    if _supported is None:
        from mpi4py import MPI

        try:
            x = torch.zeros(1)
            buf = MPI.buffer.fromaddress(x.data_ptr(), x.nbytes)
            MPI.COMM_SELF.Allreduce_init(MPI.IN_PLACE, [buf, MPI.FLOAT], op=MPI.SUM).Free()
            _supported = True
        except (NotImplementedError, AttributeError, MPI.Exception):
            _supported = False
    return _supported


def request(comm, tensor: torch.Tensor, datatype, op):
    """The persistent in-place allreduce of ``tensor`` (built on first use: collective), or None
    when ``tensor`` is not a registered CPU span (the caller then takes the plain path)."""
    if not tensor.is_cpu or not tensor.nbytes:
        return None
    region = _region_of(tensor)
    if region is None:
        return None
    base = region.ref()
    key = (comm.handle, tensor.data_ptr() - base.data_ptr(), tensor.nbytes, datatype.handle,
           op.handle)
    req = region.requests.get(key)
    if req is None:
        if len(region.requests) >= MAX_PER_STORAGE:
            return None
        from mpi4py import MPI

        # on comm's private duplicate (an attribute of comm: freeing comm calls forget() first,
        # then frees the duplicate). On comm itself MPICH would defer freeing comm, and so the
        # callback, until the requests that reference it are freed: never.
        dup = private_dup(comm)
        buf = MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes)  # no reference held:
        req = region.requests[key] = dup.Allreduce_init(        # the region's finalizer frees
            MPI.IN_PLACE, [buf, datatype], op=op)
    return req


def allreduce(comm, tensor: torch.Tensor, *, average: bool = False) -> torch.Tensor:
    """Sum (or average) a registered CPU ``tensor`` in place with a persistent request; always
    this path (the benchmark's ``persistent`` column), whatever :func:`enabled` says."""
    check_dtype(tensor.dtype)
    if not supported():
        raise ConfigError("this MPI has no MPI_Allreduce_init (persistent collectives, MPI 4)")
    if not tensor.is_contiguous():
        raise ConfigError("persistent allreduce needs a contiguous tensor (FlatModel buffers are)")
    if tensor.nbytes:
        req = request(comm, tensor, mpi_datatype(tensor.dtype), sum_op(tensor.dtype))
        if req is None:
            raise ConfigError("persistent allreduce needs a registered CPU tensor "
                              "(hpcasync.comm.persistent.register on every rank)")
        req.Start()
        req.Wait()
    n = comm.Get_size()
    if average and n > 1:
        tensor.div_(n) if tensor.is_floating_point() else tensor.floor_divide_(n)
    return tensor


def held() -> int:
    """Persistent requests alive in this process (for tests)."""
    return sum(len(r.requests) for r in list(_regions.values()))


def forget(handle: int) -> None:
    """Free the requests on a communicator being freed (called by :mod:`.cache`)."""
    for region in list(_regions.values()):
        for key in [k for k in list(region.requests) if k[0] == handle]:
            _free(region.requests.pop(key, None))


on_free(forget)


def _region_of(tensor: torch.Tensor) -> _Region | None:
    base = tensor if tensor._base is None else tensor._base
    region = _regions.get(id(base))
    return region if region is not None and region.ref() is base else None


def _release(key: int, region_ref) -> None:
    """The base tensor of a region is garbage: free its requests (they are inactive: a request in
    flight belongs to a handle that holds a view of the storage)."""
    region = region_ref()
    if region is None:
        return
    if _regions.get(key) is region:
        del _regions[key]
    for req in list(region.requests.values()):
        _free(req)
    region.requests.clear()


def _free(req) -> None:
    from mpi4py import MPI

    if req is None or MPI.Is_finalized():
        return
    try:
        req.Free()
    except Exception:  # noqa: BLE001 - a revoked communicator (ULFM) or MPI finalised
        pass
