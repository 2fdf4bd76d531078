"""``torchvision.models.resnet*`` stand-in: the ImageNet ResNets of He et al., "Deep Residual
Learning for Image Recognition" (CVPR 2016), Table 1 (package docstring)."""
from __future__ import annotations

from torch import nn


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]


class _Basic(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(cin, width, 3, stride), nn.ReLU(inplace=True),
                                  *_conv_bn(width, width, 3))
        self.skip = (nn.Sequential(*_conv_bn(cin, width, 1, stride))
                     if stride != 1 or cin != width else nn.Identity())

    def forward(self, x):
        return (self.body(x) + self.skip(x)).relu()


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        out = width * 4
        self.body = nn.Sequential(*_conv_bn(cin, width, 1), nn.ReLU(inplace=True),
                                  *_conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
                                  *_conv_bn(width, out, 1))
        self.skip = (nn.Sequential(*_conv_bn(cin, out, 1, stride))
                     if stride != 1 or cin != out else nn.Identity())

    def forward(self, x):
        return (self.body(x) + self.skip(x)).relu()


class ResNet(nn.Module):
    def __init__(self, block, depths, num_classes: int = 1000):
        super().__init__()
        layers: list[nn.Module] = [*_conv_bn(3, 64, 7, 2), nn.ReLU(inplace=True),
                                   nn.MaxPool2d(3, 2, 1)]
        cin = 64
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), depths)):
            for j in range(n):
                layers.append(block(cin, width, 2 if j == 0 and i > 0 else 1))
                cin = width * block.expansion
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


def resnet18(num_classes: int = 1000, **_):
    return ResNet(_Basic, (2, 2, 2, 2), num_classes)


def resnet34(num_classes: int = 1000, **_):
    return ResNet(_Basic, (3, 4, 6, 3), num_classes)


def resnet50(num_classes: int = 1000, **_):
    return ResNet(_Bottleneck, (3, 4, 6, 3), num_classes)


def resnet101(num_classes: int = 1000, **_):
    return ResNet(_Bottleneck, (3, 4, 23, 3), num_classes)


def resnet152(num_classes: int = 1000, **_):
    return ResNet(_Bottleneck, (3, 8, 36, 3), num_classes)
