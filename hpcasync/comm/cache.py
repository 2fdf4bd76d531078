"""Per-communicator cache (MPI attribute caching): private duplicates, shm engines, shm-ness.

Objects are stored as an MPI attribute of the communicator, so they live exactly as long as it: when
the communicator is freed (``Topology.free()``), MPI calls our delete callback, which frees every
cached object that has a ``free()`` (a duplicate communicator, a shared-memory window).
Attributes of ``COMM_WORLD`` are left to ``MPI_Finalize``.

Creating an entry is collective when its factory is (``Dup``, ``Win.Allocate_shared``): call these
helpers at the same point on every rank of the communicator, as every collective.
"""
from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger(__name__)

_keyval = None
#: called with a communicator's handle when it is freed (modules that keep per-communicator
#: state in dicts of their own, e.g. :mod:`.direct`'s decisions, register here)
_on_free: list[Callable[[int], None]] = []


def on_free(callback: Callable[[int], None]) -> None:
    """Call ``callback(comm.handle)`` whenever a communicator with a cache is freed."""
    if callback not in _on_free:
        _on_free.append(callback)


def _delete(comm, keyval, cache) -> None:
    for callback in _on_free:
        callback(comm.handle)
    for key in reversed(list(cache)):
        obj = cache.pop(key)
        free = getattr(obj, "free", None) or getattr(obj, "Free", None)
        if callable(free):
            try:
                free()
            except Exception as exc:  # pragma: no cover - MPI already shutting down
                log.debug("freeing cached %s failed: %s", key, exc)


def comm_cache(comm) -> dict:
    """The dict cached on ``comm`` (created empty on first use; local, not collective)."""
    global _keyval
    from mpi4py import MPI

    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval(delete_fn=_delete)
    cache = comm.Get_attr(_keyval)
    if cache is None:
        cache = {}
        comm.Set_attr(_keyval, cache)
    return cache


def cached(comm, key: str, factory: Callable[[], object]):
    """``comm_cache(comm)[key]``, made by ``factory()`` on first use (collective if it is)."""
    cache = comm_cache(comm)
    if key not in cache:
        cache[key] = factory()
    return cache[key]


def private_dup(comm):
    """A duplicate of ``comm`` reserved for hpcasync's multi-stage collectives.

    A nonblocking reduction issues its later stages from ``test()``/``wait()``, whose timing differs
    between ranks; on the caller's own communicator these could interleave with the caller's
    collectives in a different order on different ranks. On the private duplicate they cannot.
    """
    return cached(comm, "private_dup", comm.Dup)


def is_shared_memory(comm) -> bool:
    """True when all ranks of ``comm`` can share memory (one physical node). Collective on first
    call per communicator, cached afterwards."""
    from mpi4py import MPI

    def probe() -> bool:
        if comm.Get_size() == 1:
            return True
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            same = node.Get_size() == comm.Get_size()
        finally:
            node.Free()
        return bool(comm.allreduce(same, op=MPI.LAND))

    return cached(comm, "is_shared_memory", probe)


def cached_comms(comm) -> list:
    """The communicators cached on ``comm`` (private duplicates, the shm engine's), for a ULFM
    recovery that must revoke every communicator a survivor may be blocked on. Local."""
    from mpi4py import MPI

    out = []
    for obj in list(comm_cache(comm).values()):
        for c in (obj, getattr(obj, "comm", None)):
            if isinstance(c, MPI.Comm) and c != MPI.COMM_NULL:
                out.append(c)
    return out
