"""Flat allreduce: sum or average one contiguous tensor in place, blocking or nonblocking.

For ranks i = 0 … N-1 holding x_i, every rank ends with  Σ_i x_i  (``average=False``) or
(1/N)·Σ_i x_i  (``average=True``). Two algorithms, chosen by ``algorithm``:

* ``"shm"``: :class:`~hpcasync.comm.shm.ShmAllreduce` — all ranks on one node reduce straight out
  of a shared-memory window (a reduce-scatter then an allgather through memory).
* ``"mpi"``: ``MPI_Allreduce`` / ``MPI_Iallreduce`` in place (with ``HPCASYNC_PERSISTENT=1``, a
  persistent request Start()ed instead where the buffer is a registered one: :mod:`.persistent`).
* ``"auto"`` (default): ``mpi``, except where the communicator lives on one node and the window
  was *measured* on this machine to be faster for the message's size class, beyond the
  measurement's spread (:mod:`.tune`: its margins, measured once per class, kept in a file so
  later runs choose the same). Deciding
  is collective the first time a communicator / size class is seen.

Buffers are cut into consecutive pieces of at most ``bucket_bytes`` bytes (on the wire) and at most
``chunk_elems`` elements, each reduced on its own; cutting does not change the result beyond float
rounding (tests check it). DASO sends its global messages in chunks of :data:`DASO_CHUNK_ELEMS`.
A nonblocking MPI reduction starts all its pieces at once.

Compression (``compress="bf16"|"fp16"``) wraps the reduction: encode to 16 bits, reduce with the
16-bit sum op (:mod:`~hpcasync.comm.ops` — never ``MPI.SUM`` on raw 16-bit bytes), decode; fp16
averages divide before the reduction against overflow, bf16 after (see :mod:`.compress`). A tensor
that already is bf16/fp16 is reduced with the same 16-bit op.

CUDA tensors are staged through (pinned) host memory unless ``cuda_aware=True`` (an MPI built with
CUDA support), which hands device memory to MPI directly; 16-bit reductions are always staged, since
the 16-bit op runs on the host. The shm path copies device memory straight into the window.

Example::

    allreduce(comm, flat.grads, average=True)                      # blocking, in place
    h = iallreduce(topo.glob, flat.params, compress="bf16", chunk_elems=DASO_CHUNK_ELEMS,
                   name="daso-global", step=step)
    ...
    h.wait()
"""
from __future__ import annotations

import logging

import torch

from ..errors import ConfigError, TopologyError
from . import persistent
from .compress import decode, encode, wire_dtype
from .direct import try_direct
from .handle import Allreduce, Handle, Started, run_blocking
from .ops import HALF_DTYPES, check_dtype, mpi_datatype, mpi_buffer, sum_op
from .engine import ALGORITHMS, pick_engine  # noqa: F401 (ALGORITHMS re-exported)
from .shm import ShmAllreduce

log = logging.getLogger(__name__)

DASO_CHUNK_ELEMS = 10_000_000     # DASO (Coquelin et al.) sends global messages in 10 M-elem chunks


def piece_elems(itemsize: int, bucket_bytes: int | None, chunk_elems: int | None) -> int | None:
    """Elements per piece from the two limits (None = unlimited)."""
    limits = []
    if bucket_bytes is not None:
        if bucket_bytes < itemsize:
            raise ConfigError(f"bucket_bytes must be at least one element ({itemsize} bytes), "
                              f"got {bucket_bytes}")
        limits.append(bucket_bytes // itemsize)
    if chunk_elems is not None:
        if chunk_elems < 1:
            raise ConfigError(f"chunk_elems must be >= 1, got {chunk_elems}")
        limits.append(chunk_elems)
    return min(limits) if limits else None


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as 1-D without copying; raises :class:`ConfigError` for unusable tensors."""
    check_dtype(tensor.dtype)
    if not tensor.is_contiguous():
        raise ConfigError("allreduce needs a contiguous tensor (FlatModel buffers are)")
    if tensor.requires_grad:
        tensor = tensor.detach()
    return tensor if tensor.dim() == 1 else tensor.view(-1)


class PinnedPool:
    """Reusable pinned host buffers for staging CUDA tensors; one per reduction in flight."""

    def __init__(self):
        self._free: list[torch.Tensor] = []

    def acquire(self, like: torch.Tensor) -> torch.Tensor:
        """A pinned host copy of ``like`` (a buffer from the pool when one is big enough)."""
        nbytes = like.numel() * like.element_size()
        for i, buf in enumerate(self._free):
            if buf.numel() >= nbytes:
                host = self._free.pop(i)
                break
        else:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        staged = host[:nbytes].view(like.dtype)
        staged.copy_(like)
        return staged

    def release(self, staged: torch.Tensor) -> None:
        base = staged._base if staged._base is not None else staged
        self._free.append(base if base.dtype == torch.uint8 else staged.view(torch.uint8))


_pinned = PinnedPool()


def staged_steps(flat: torch.Tensor, inner):
    """Run the step generator ``inner(host)`` on a host copy of CUDA tensor ``flat``
    (copied back at the end), or on ``flat`` itself when it is on the CPU."""
    if flat.device.type == "cpu":
        yield from inner(flat)
        return
    host = _pinned.acquire(flat)
    try:
        yield from inner(host)
        flat.copy_(host)
    finally:
        _pinned.release(host)


def mpi_steps(comm, flat: torch.Tensor, *, wire: torch.dtype, divisor: int = 1,
              piece: int | None = None, cuda_aware: bool = False):
    """Step generator of the MPI path: encode, one (I)allreduce per piece, decode."""
    w = encode(flat, wire_dtype=wire, divisor=divisor)
    op = sum_op(wire)

    def reduce(buf: torch.Tensor):
        if buf.numel():
            step = piece or buf.numel()
            pieces = [buf[s: s + step] for s in range(0, buf.numel(), step)]
            if buf.device.type != "cpu":   # CUDA-aware MPI: DLPack / the CUDA array interface
                yield tuple(Allreduce(comm, [p, mpi_datatype(wire)], op) for p in pieces)
            elif persistent.enabled():        # registered spans: their persistent requests
                reqs = [persistent.request(comm, p, mpi_datatype(wire), op) for p in pieces]
                yield tuple(Allreduce(comm, mpi_buffer(p), op) if r is None else Started(r)
                            for p, r in zip(pieces, reqs))
            else:
                yield tuple(Allreduce(comm, mpi_buffer(p), op) for p in pieces)

    if cuda_aware and wire not in HALF_DTYPES:      # the 16-bit op runs on the host
        yield from reduce(w)
    else:
        yield from staged_steps(w, reduce)
    decode(w, flat, divisor=divisor)


def allreduce_steps(comm, tensor: torch.Tensor, *, average: bool = False,
                    bucket_bytes: int | None = None, chunk_elems: int | None = None,
                    compress: str | None = None, algorithm: str = "auto", cuda_aware: bool = False):
    """The step generator behind :func:`allreduce` and :func:`iallreduce`, plus its engine."""
    flat = flat_view(tensor)
    wire = wire_dtype(flat.dtype, compress)
    divisor = comm.Get_size() if average else 1
    piece = piece_elems(wire.itemsize, bucket_bytes, chunk_elems)
    engine = pick_engine(comm, flat.numel() * wire.itemsize, algorithm, cuda_aware, wire)
    if engine is not None:
        return engine.steps(flat, wire=wire, divisor=divisor, piece_elems=piece), engine
    return mpi_steps(comm, flat, wire=wire, divisor=divisor, piece=piece,
                     cuda_aware=cuda_aware), None


def allreduce(comm, tensor: torch.Tensor, *, average: bool = False,
              bucket_bytes: int | None = None, chunk_elems: int | None = None,
              compress: str | None = None, algorithm: str = "auto",
              cuda_aware: bool = False) -> torch.Tensor:
    """Sum (or average) ``tensor`` in place over ``comm``; returns ``tensor``.

    Args:
        comm: an mpi4py intracommunicator; every rank passes a tensor of the same size and dtype.
        tensor: contiguous tensor (float32/64, bf16, fp16, int32/64, uint8), any device.
        average: divide the sum by ``comm.size`` (default False).
        bucket_bytes / chunk_elems: largest piece reduced at once, in wire bytes / elements
            (default None: one piece, or the shm window size).
        compress: None, ``"bf16"`` or ``"fp16"``: reduce in 16 bits (see module doc).
        algorithm: ``"auto"`` (default), ``"mpi"`` or ``"shm"``.
        cuda_aware: hand CUDA memory to MPI directly instead of staging it (default False).
    """
    if (algorithm == "auto" and compress is None and bucket_bytes is None and chunk_elems is None
            and try_direct(comm, tensor, average)):
        return tensor          # one MPI_Allreduce where auto chose MPI (:mod:`.direct`)
    steps, _ = allreduce_steps(comm, tensor, average=average, bucket_bytes=bucket_bytes,
                               chunk_elems=chunk_elems, compress=compress, algorithm=algorithm,
                               cuda_aware=cuda_aware)
    run_blocking(steps)
    return tensor


def iallreduce(comm, tensor: torch.Tensor, *, average: bool = False,
               bucket_bytes: int | None = None, chunk_elems: int | None = None,
               compress: str | None = None, algorithm: str = "auto", cuda_aware: bool = False,
               name: str = "", step: int | None = None) -> Handle:
    """Start :func:`allreduce` and return a :class:`~hpcasync.comm.handle.Handle` at once.

    ``tensor`` must not be touched until ``handle.wait()`` (or a ``test()`` that returned True);
    ``name`` and ``step`` are recorded on the handle. On the shm path at most one reduction per
    node communicator is in flight: starting another first completes the previous one.
    """
    steps, engine = allreduce_steps(comm, tensor, average=average, bucket_bytes=bucket_bytes,
                                    chunk_elems=chunk_elems, compress=compress,
                                    algorithm=algorithm, cuda_aware=cuda_aware)
    handle = Handle(steps, tensor, name=name, step=step)
    return engine.track(handle) if engine is not None else handle
