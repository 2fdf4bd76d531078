"""Small models that are not in the zoo, shared by the tests."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class SmallBN(nn.Module):
    """conv + BatchNorm + linear, for 28x28 single-channel images."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 5, stride=3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))
