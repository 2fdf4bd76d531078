"""Multi-layer perceptron: flatten, then ReLU hidden layers, then a linear classifier.

    y = W_k · ReLU(… ReLU(W_1 · vec(x) + b_1) …) + b_k

Default hidden sizes (256, 128): 235,146 parameters on 1×28×28 input with 10 classes.

Example::

    model = MLP((1, 28, 28), num_classes=10)
    model(torch.zeros(4, 1, 28, 28)).shape   # (4, 10)
"""
from __future__ import annotations

import math

from torch import nn

__all__ = ["MLP"]


class MLP(nn.Sequential):
    """Args: input_shape (C, H, W); num_classes (default 10); hidden widths (default (256, 128))."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int = 10,
                 hidden: tuple[int, ...] = (256, 128)):
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(inplace=True)]
            width = h
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)
