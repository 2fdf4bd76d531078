"""ResNet-20 for CIFAR (He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition",
CVPR 2016, section 4.2), with n = 3:

    conv3×3(16) → BN → ReLU → 3 stages × n basic blocks (16, 32, 64 channels; the first block of
    stages 2 and 3 has stride 2) → global average pool → fc

    basic block: y = ReLU(BN(conv3×3(ReLU(BN(conv3×3(x))))) + shortcut(x))

6n + 2 = 20 weighted layers. Shortcuts are the paper's option A (identity; when the shape changes,
subsample by 2 and zero-pad the new channels), so they add no parameters: 269,722 parameters on
3×32×32 with 10 classes ("0.27M" in the paper's Table 6). Convolutions get He (Kaiming) normal
initialisation with fan-out, BatchNorm starts at γ = 1, β = 0.

Differences from the paper: 1×28×28 input is accepted as is (stages then run at 28, 14, 7 pixels).

Example::

    model = ResNet20((3, 32, 32))
    model(torch.zeros(2, 3, 32, 32)).shape   # (2, 10)
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

__all__ = ["ResNet20", "BasicBlock"]


class BasicBlock(nn.Module):
    """Two 3×3 conv + BN layers with an option-A shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.stride, self.extra = stride, planes - in_planes

    def shortcut(self, x):
        if self.stride != 1:
            x = x[:, :, ::self.stride, ::self.stride]
        if self.extra:
            x = F.pad(x, (0, 0, 0, 0, 0, self.extra))
        return x

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """Args: input_shape (C, H, W); num_classes (default 10); blocks per stage n (default 3)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int = 10, n: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(input_shape[0], 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        stages, in_planes = [], 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            blocks = []
            for i in range(n):
                blocks.append(BasicBlock(in_planes, planes, stride if i == 0 else 1))
                in_planes = planes
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)
