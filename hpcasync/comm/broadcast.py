"""Broadcast of a flat tensor, staged through host memory for device tensors."""
from __future__ import annotations

import torch


def broadcast(comm, tensor: torch.Tensor, *, root: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` (contiguous) on every rank of ``comm`` with ``root``'s; returns it."""
    if not tensor.is_contiguous():
        raise ValueError("broadcast needs a contiguous tensor")
    if tensor.device.type == "cpu":
        comm.Bcast(tensor.detach().view(torch.uint8).numpy(), root=root)
        return tensor
    host = tensor.detach().cpu()
    comm.Bcast(host.view(torch.uint8).numpy(), root=root)
    tensor.copy_(host)
    return tensor
