"""Broadcast of a flat tensor, staged through host memory for device tensors, in pieces of at
most 1 GiB (:func:`~.objects.bcast_bytes`: a model over 2 GiB too)."""
from __future__ import annotations

import torch

from .objects import bcast_bytes


def broadcast(comm, tensor: torch.Tensor, *, root: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` (contiguous) on every rank of ``comm`` with ``root``'s; returns it."""
    if not tensor.is_contiguous():
        raise ValueError("broadcast needs a contiguous tensor")
    host = tensor.detach() if tensor.device.type == "cpu" else tensor.detach().cpu()
    bcast_bytes(comm, host.reshape(-1).view(torch.uint8).numpy(), root)
    if tensor.device.type != "cpu":
        tensor.copy_(host)
    return tensor
