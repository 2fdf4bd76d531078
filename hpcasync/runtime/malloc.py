"""glibc's allocator tuned for training loops: no page-fault churn on every step.

What it does: ``mallopt(M_MMAP_THRESHOLD, 32 MiB)`` (glibc's maximum: blocks below it come from
the heap and are reused) and ``mallopt(M_TRIM_THRESHOLD, 1 GiB)`` (freed memory stays mapped up
to 1 GiB), once per process, before MPI starts (:func:`hpcasync.topology.init_mpi`). The price: a
process keeps up to 1 GiB of freed heap mapped, and blocks below 32 MiB can fragment the heap.
Off with ``HPCASYNC_MALLOC=default``; left alone when the user set ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` (glibc reads those at start), and on non-glibc systems.

Example::

    from hpcasync.runtime.malloc import tune_malloc
    tune_malloc()          # True where it applied the settings (glibc), once per process

Design: docs/design/malloc.md#malloc-tuning (what it fixes, measured).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

from .. import environ

log = logging.getLogger("hpcasync")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3          # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20                            # glibc's maximum on 64-bit
TRIM_THRESHOLD = 1 << 30
_state: dict = {}


def tune_malloc() -> bool:
    """Apply the settings (module docstring) once; returns whether they are in force."""
    if "done" in _state:
        return _state["done"]
    _state["done"] = False
    if environ.word("HPCASYNC_MALLOC") == "default":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):          # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    _state["done"] = ok
    return ok
