"""Two models as a user of ``hpcasync train --model MODULE:FACTORY`` writes them.

A model factory is called as ``factory(input_shape, num_classes)``, where ``input_shape`` is the
shape of one item of the data and ``num_classes`` the largest label + 1, and returns a
``torch.nn.Module`` whose output on a batch of B items has shape (B, num_classes)::

    cd examples/plugins
    mpiexec -n 4 hpcasync train --model my_models:gru --dataset my_data:rows
    mpiexec -n 4 hpcasync train --model my_models:convbn --dataset fashion-mnist
"""
from __future__ import annotations

import torch
from torch import nn


class RowGRU(nn.Module):
    """A GRU that reads an image row by row: (N, H, W) or (N, 1, H, W) -> H steps of W features;
    its last hidden state goes through a Linear layer to the class scores."""

    def __init__(self, width: int, num_classes: int, hidden: int = 64):
        super().__init__()
        self.gru = nn.GRU(input_size=width, hidden_size=hidden, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:                 # (N, 1, H, W): one channel
            x = x.squeeze(1)
        _, h = self.gru(x)               # h: (layers=1, N, hidden)
        return self.head(h[-1])


def gru(input_shape, num_classes):
    """``--model my_models:gru``: for items of shape (H, W) or (1, H, W)."""
    if len(input_shape) not in (2, 3) or (len(input_shape) == 3 and input_shape[0] != 1):
        raise ValueError(f"gru reads (H, W) or (1, H, W) items, not {tuple(input_shape)}")
    return RowGRU(input_shape[-1], num_classes)


def convbn(input_shape, num_classes):
    """``--model my_models:convbn``: two conv3x3 + BatchNorm + ReLU + max-pool blocks (16, 32
    channels), then a Linear layer; for items of shape (C, H, W) or (H, W) (one channel)."""
    if len(input_shape) == 2:
        input_shape = (1, *input_shape)
    if len(input_shape) != 3:
        raise ValueError(f"convbn reads (C, H, W) or (H, W) items, not {tuple(input_shape)}")
    c, h, w = input_shape
    blocks = []
    for cin, cout in ((c, 16), (16, 32)):
        blocks += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                   nn.ReLU(inplace=True), nn.MaxPool2d(2)]
    return _ConvBN(nn.Sequential(*blocks), 32 * (h // 4) * (w // 4), num_classes)


class _ConvBN(nn.Module):
    def __init__(self, features: nn.Module, width: int, num_classes: int):
        super().__init__()
        self.features = features
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:                 # (N, H, W): add the channel
            x = x.unsqueeze(1)
        return self.head(self.features(x).flatten(1))
