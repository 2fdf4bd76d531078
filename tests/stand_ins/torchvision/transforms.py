"""``torchvision.transforms`` stand-in: Compose, ToTensor, Normalize (package docstring)."""
from __future__ import annotations

import numpy as np
import torch


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    """uint8 HxW or HxWxC (tensor, array, or anything with ``__array__``) -> float CxHxW in [0, 1];
    float input is only moved to CxHxW."""

    def __call__(self, pic) -> torch.Tensor:
        t = pic if isinstance(pic, torch.Tensor) else torch.from_numpy(np.asarray(pic).copy())
        if t.dim() == 2:
            t = t.unsqueeze(-1)
        t = t.permute(2, 0, 1).contiguous()
        return t.float().div(255.0) if t.dtype == torch.uint8 else t.float()


class Normalize:
    """``(x - mean[c]) / std[c]`` per channel."""

    def __init__(self, mean, std, inplace: bool = False):
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return (t - self.mean) / self.std
