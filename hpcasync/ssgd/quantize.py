"""The outer gradients of Streaming DiLoCo as 8-bit floats: a quantized mean over ranks.

Streaming DiLoCo (Douillard et al., 2025) sends its outer gradients in low precision and
accumulates them in float32. torchft's ``allreduce_quantized`` (its ``DiLoCo(...,
should_quantize=True)``) does it with FP8 (E4M3) and a float32 scale per row, in five steps; this
module does the same on MPI, per rank's chunk:

1. each rank cuts its vector into N chunks (:func:`~hpcasync.comm.shm.partition`) and quantizes
   each: ``scale = 448 / max|x|`` (1 when the chunk is all zero), ``q = fp8(x · scale)``;
2. an all-to-all gives rank r the r-th chunk of every rank (one byte an element, and the scales);
3. rank r dequantizes them (``q / scale``), sums them in float32 in rank order and divides by N;
4. it quantizes that mean again and an all-gather gives every rank every rank's mean chunk;
5. every rank dequantizes the whole vector.

So each element crosses the wire twice as one byte (float32: 4 bytes, twice, in a
reduce-scatter + all-gather allreduce) and is rounded twice to 3 mantissa bits: relative to the
chunk's largest value, each rounding errs by at most 2^-4 of that value's binade. Differences
from torchft: its rows are its kernel's blocks of each tensor, ours one chunk per rank of the
flat fragment; it needs Triton on a GPU, this runs on the CPU (tested against the same
formula replayed in one process, ``tests/mpi/test_diloco.py``; torchft's quantized path could not
be run beside it here). The paper's 4-bit E3M0 is not offered.
"""
from __future__ import annotations

import numpy as np
import torch

from ..comm.shm import partition

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0           # E4M3's largest finite value


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``x`` (float32) as FP8 bytes (uint8) and its scale: ``x ≈ q.view(fp8).float() / scale``."""
    top = float(x.abs().max()) if x.numel() else 0.0
    scale = FP8_MAX / top if 0.0 < top < float("inf") else 1.0
    return (x * scale).to(FP8).view(torch.uint8), scale


def dequantize(q: torch.Tensor, scale: float) -> torch.Tensor:
    return q.view(FP8).float() / scale


def quantized_mean(comm, flat: torch.Tensor) -> int:
    """In place: ``flat`` (1-D float32, on the CPU) becomes the mean over ``comm``'s ranks,
    exchanged as FP8 (module doc). Collective. Returns the bytes this rank handed to MPI."""
    from mpi4py import MPI

    n, rank = comm.Get_size(), comm.Get_rank()
    bounds = partition(flat.numel(), n)
    counts, displs = [hi - lo for lo, hi in bounds], [lo for lo, _ in bounds]
    q = torch.empty(flat.numel(), dtype=torch.uint8)
    scales = np.empty(n)                             # float64: a Python float's bits
    for i, (lo, hi) in enumerate(bounds):
        q[lo:hi], scales[i] = quantize(flat[lo:hi])
    mine = counts[rank]
    got = torch.empty(n * mine, dtype=torch.uint8)
    comm.Alltoallv([q.numpy(), counts, displs, MPI.BYTE],
                   [got.numpy(), [mine] * n, [i * mine for i in range(n)], MPI.BYTE])
    their = np.empty(n)                              # the scale of my chunk on each rank
    comm.Alltoall([scales, MPI.DOUBLE], [their, MPI.DOUBLE])
    acc = torch.zeros(mine, dtype=torch.float32)
    for i in range(n):                               # float32, in rank order
        acc += dequantize(got[i * mine:(i + 1) * mine], float(their[i]))
    acc /= n
    reduced, scale = quantize(acc)
    out = torch.empty(flat.numel(), dtype=torch.uint8)
    comm.Allgatherv([reduced.numpy(), MPI.BYTE], [out.numpy(), counts, displs, MPI.BYTE])
    every = np.empty(n)
    comm.Allgather([np.array([scale]), MPI.DOUBLE], [every, MPI.DOUBLE])
    for (lo, hi), s in zip(bounds, every):
        flat[lo:hi] = dequantize(out[lo:hi], float(s))
    return flat.numel() + mine + 8 * n + 8
