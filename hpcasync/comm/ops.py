"""MPI datatypes and reduction ops for torch tensors, including 16-bit floats.

**The raw-bytes trap.** MPI has no bfloat16 or float16 datatype (Open MPI 5 / MPI 4.1). A bf16
tensor handed straight to mpi4py is exported through DLPack/the buffer protocol as plain bytes, and
``MPI_SUM`` then adds those bytes (or, through an ``int16`` view, the bit patterns) as integers.
Open MPI reports no error: 1.5 + 1.5 comes back as 1.7e38 or inf. Every 16-bit reduction in hpcasync
therefore goes through its own op, created with ``MPI.Op.Create`` over 2-byte integer elements, that
reinterprets the bytes as bf16/fp16 and adds them in float32 (torch computes 16-bit CPU arithmetic
in float32 and rounds once, to nearest even), i.e.::

    inout[i] = round16(float32(in[i]) + float32(inout[i]))

The elements travel as ``MPI_INT16_T``, not ``MPI_BYTE``: MPI may hand a user op any whole number
of elements, and with a 1-byte type a segmenting algorithm could cut a value in half.

The op is commutative (MPI may reorder operands); it is not associative after rounding, so the
result depends on the reduction tree, like any floating-point allreduce. Ops are created lazily, on
first use, never at import (creating them needs an initialised MPI; Heat's DASO creates them at
import time).

Example::

    buf, op = mpi_buffer(t), sum_op(t.dtype)    # t: contiguous CPU tensor of a supported dtype
    comm.Allreduce(MPI.IN_PLACE, buf, op=op)
"""
from __future__ import annotations

import torch

from ..errors import ConfigError

HALF_DTYPES = (torch.bfloat16, torch.float16)

# torch dtype -> (name of the MPI datatype, numpy-viewable torch dtype holding the same bytes)
_MPI_TYPES = {
    torch.float32: ("FLOAT", torch.float32),
    torch.float64: ("DOUBLE", torch.float64),
    torch.int32: ("INT32_T", torch.int32),
    torch.int64: ("INT64_T", torch.int64),
    torch.uint8: ("UINT8_T", torch.uint8),
    # 16-bit floats travel as opaque 2-byte integers; only the ops below may reduce them.
    torch.bfloat16: ("INT16_T", torch.int16),
    torch.float16: ("INT16_T", torch.int16),
}

_ops: dict[torch.dtype, object] = {}
_datatypes: dict[torch.dtype, object] = {}


def check_dtype(dtype: torch.dtype) -> None:
    """Raise :class:`ConfigError` unless ``dtype`` can be reduced by hpcasync's collectives."""
    if dtype not in _MPI_TYPES:
        supported = ", ".join(str(d).replace("torch.", "") for d in _MPI_TYPES)
        raise ConfigError(f"cannot allreduce a {str(dtype).replace('torch.', '')} tensor; "
                          f"supported dtypes: {supported}")


def mpi_datatype(dtype: torch.dtype):
    """The MPI datatype that carries ``dtype`` (a 2-byte integer type for bf16/fp16)."""
    found = _datatypes.get(dtype)
    if found is None:
        from mpi4py import MPI

        check_dtype(dtype)
        found = _datatypes[dtype] = getattr(MPI, _MPI_TYPES[dtype][0])
    return found


def mpi_buffer(tensor: torch.Tensor) -> list:
    """``[numpy view, MPI datatype]`` over a contiguous CPU tensor's memory (no copy)."""
    check_dtype(tensor.dtype)
    if tensor.device.type != "cpu":
        raise ConfigError(f"an MPI host buffer must be on the CPU, got a tensor on {tensor.device}")
    if not tensor.is_contiguous():
        raise ConfigError("an MPI buffer must be a contiguous tensor")
    if tensor.requires_grad:
        tensor = tensor.detach()
    carrier = _MPI_TYPES[tensor.dtype][1]
    view = tensor if carrier == tensor.dtype else tensor.view(carrier)
    return [view.numpy(), mpi_datatype(tensor.dtype)]


def sum16_inplace(inp: torch.Tensor, inout: torch.Tensor) -> torch.Tensor:
    """``inout += inp`` for 16-bit float tensors, computed in float32 and rounded once.

    This is the reference math of the MPI op; the tests compare it bit for bit with
    ``(inp.float() + inout.float()).to(dtype)``.
    """
    return inout.add_(inp)


def _make_op(dtype: torch.dtype):
    from mpi4py import MPI

    def reduce16(inbuf, inoutbuf, datatype):
        if datatype.Get_size() != 2:  # pragma: no cover - only ever paired with INT16_T
            raise TypeError(f"16-bit sum op used with a {datatype.Get_size()}-byte datatype")
        if len(memoryview(inbuf)) == 0:
            return
        sum16_inplace(torch.frombuffer(inbuf, dtype=dtype), torch.frombuffer(inoutbuf, dtype=dtype))

    return MPI.Op.Create(reduce16, commute=True)


def sum_op(dtype: torch.dtype):
    """The op that sums ``dtype`` correctly: ``MPI.SUM``, or the 16-bit op (made on first use)."""
    op = _ops.get(dtype)
    if op is None:
        from mpi4py import MPI

        check_dtype(dtype)
        op = _ops[dtype] = _make_op(dtype) if dtype in HALF_DTYPES else MPI.SUM
    return op


def bf16_sum_op():
    """The bfloat16 sum op (see the module docstring for why ``MPI.SUM`` is wrong)."""
    return sum_op(torch.bfloat16)


def fp16_sum_op():
    """The float16 sum op."""
    return sum_op(torch.float16)
