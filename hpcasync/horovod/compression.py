"""``hvd.Compression``: how a tensor travels in an allreduce (Horovod's compressor interface).

A compressor has ``compress(tensor) -> (wire, ctx)`` and ``decompress(wire, ctx) -> tensor``.
``Compression.fp16`` casts floating tensors to float16 on the wire (as Horovod's), ``bf16`` to
bfloat16 (hpcasync's addition: float32's range, so no overflow of large sums); integer tensors pass
unchanged. In :class:`~hpcasync.horovod.DistributedOptimizer` the two 16-bit compressors become the
gradient buckets' wire format (hpcasync's ``compress="fp16"|"bf16"``: see
:mod:`hpcasync.comm.compress` for where the average divides).
"""
from __future__ import annotations

import torch


class Compressor:
    """Interface: subclass and implement both static methods."""

    wire = None          # hpcasync's compress= name, for DistributedOptimizer's buckets

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def _cast_compressor(dtype: torch.dtype, wire: str):
    class Cast(Compressor):
        @staticmethod
        def compress(tensor):
            if tensor.dtype.is_floating_point:
                return tensor.type(dtype), tensor.dtype
            return tensor, tensor.dtype

        @staticmethod
        def decompress(tensor, ctx):
            return tensor.type(ctx) if ctx is not None and ctx.is_floating_point else tensor

    Cast.wire = wire
    Cast.__name__ = Cast.__qualname__ = f"{wire.upper()}Compressor"
    Cast.__doc__ = f"Floating tensors travel as {dtype} (integers unchanged)."
    return Cast


FP16Compressor = _cast_compressor(torch.float16, "fp16")
BF16Compressor = _cast_compressor(torch.bfloat16, "bf16")


class Compression:
    """The compressors, as ``hvd.Compression.none`` / ``.fp16`` / ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
