"""LeNet-5 style convolutional network (LeCun, Bottou, Bengio, Haffner, "Gradient-based learning
applied to document recognition", Proc. IEEE 1998), with ReLU and max-pooling:

    conv5×5(6) → ReLU → maxpool2 → conv5×5(16) → ReLU → maxpool2 → fc120 → ReLU → fc84 → ReLU → fc

The first convolution pads its input by p = max(0, ⌊(32 − min(H, W)) / 2⌋), so a 28×28 image is
seen as LeNet-5's 32×32 input: both 1×28×28 and 3×32×32 reach a 16×5×5 feature map (fc input 400).

Differences from the paper: ReLU instead of scaled tanh, max-pooling instead of trainable
average subsampling, full C1→C3 connectivity instead of the sparse connection table, and a plain
linear output instead of RBF units.

Example::

    model = LeNet((3, 32, 32))
    model(torch.zeros(2, 3, 32, 32)).shape   # (2, 10)
"""
from __future__ import annotations

from torch import nn

__all__ = ["LeNet"]


class LeNet(nn.Module):
    """Args: input_shape (C, H, W); num_classes (default 10)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int = 10):
        super().__init__()
        c, h, w = input_shape
        pad = max(0, (32 - min(h, w)) // 2)
        # conv5 (pad) -> pool2 -> conv5 -> pool2; the padding makes every side at least 31
        fh, fw = ((h + 2 * pad - 4) // 2 - 4) // 2, ((w + 2 * pad - 4) // 2 - 4) // 2
        self.features = nn.Sequential(
            nn.Conv2d(c, 6, 5, padding=pad), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * fh * fw, 120), nn.ReLU(inplace=True),
            nn.Linear(120, 84), nn.ReLU(inplace=True), nn.Linear(84, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))
