"""16-bit compression as a transform around an allreduce: encode -> reduce (16-bit op) -> decode.

With ``compress="bf16"`` or ``"fp16"`` the tensor is cast to the 16-bit *wire* dtype, summed with
the 16-bit op of :mod:`hpcasync.comm.ops` (float32 arithmetic, one rounding per addition), and cast
back.
When an average is asked for, where the division by N happens depends on the format:

* **fp16 divides before** (encode computes ``x / N`` in float32, then rounds): fp16 stops at 65504,
  so a sum of N gradients can overflow where their mean would not. This is what PyTorch's
  ``fp16_compress_hook`` does (it divides first "to avoid overflow"). The cost is underflow of
  values below ~6e-8·N, which is far below anything an SGD step can resolve.
* **bf16 divides after** (decode casts to float32, then divides): bf16 has float32's exponent
  range, so the sum cannot overflow where float32 would not, and dividing in float32 after the
  reduction saves one rounding.
* **no compression** divides after, in the tensor's own dtype.

Example::

    wire = encode(grads, wire_dtype=torch.bfloat16, divisor=n)   # new tensor (or fill ``out``)
    comm.Allreduce(MPI.IN_PLACE, mpi_buffer(wire), op=sum_op(wire.dtype))
    decode(wire, grads, divisor=n)
"""
from __future__ import annotations

import torch

from ..errors import ConfigError

COMPRESS = {None: None, "none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def wire_dtype(dtype: torch.dtype, compress: str | None) -> torch.dtype:
    """The dtype that is reduced: the 16-bit format for ``compress``, else ``dtype`` itself."""
    if compress not in COMPRESS:
        raise ConfigError(f"compress must be one of none, bf16, fp16; got {compress!r}")
    wire = COMPRESS[compress]
    if wire is not None and not dtype.is_floating_point:
        raise ConfigError(f"compress={compress} needs a floating-point tensor, got {dtype}")
    return dtype if wire is None else wire


def predivides(wire: torch.dtype) -> bool:
    """True when an average is divided before the reduction (fp16, against overflow)."""
    return wire == torch.float16


def encode(src: torch.Tensor, *, wire_dtype: torch.dtype, divisor: int = 1,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Cast ``src`` to the wire dtype (pre-dividing by ``divisor`` for fp16), into ``out`` if given.

    Without ``out`` and with nothing to do (same dtype, no pre-division) ``src`` itself is returned.
    """
    if out is not None and divisor == 1:
        return out.copy_(src)
    pre = divisor != 1 and predivides(wire_dtype)
    if out is None:
        if src.dtype == wire_dtype and not pre:
            return src
        out = torch.empty(src.shape, dtype=wire_dtype, device=src.device)
    if pre and out.device == src.device:
        # division in src's dtype (float32), rounded once on the store into the 16-bit out
        torch.div(src, divisor, out=out)
    elif pre:
        out.copy_(src / divisor)
    else:
        out.copy_(src)
    return out


def decode(wire: torch.Tensor, dst: torch.Tensor, *, divisor: int = 1) -> torch.Tensor:
    """Write the reduced ``wire`` into ``dst``, dividing by ``divisor`` afterwards unless fp16
    already divided before."""
    post = divisor != 1 and not predivides(wire.dtype)
    if post and wire.dtype == dst.dtype and wire.device == dst.device and dst.is_floating_point():
        return torch.div(wire, divisor, out=dst)          # one pass, in the wire's (= dst's) dtype
    if wire.data_ptr() != dst.data_ptr() or wire.device != dst.device:
        dst.copy_(wire)                                   # a 16-bit wire is widened here first
    if post:
        dst.div_(divisor) if dst.is_floating_point() else dst.floor_divide_(divisor)
    return dst
