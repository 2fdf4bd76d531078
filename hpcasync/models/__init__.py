"""Model zoo: ``build_model(name, input_shape, num_classes)`` for the networks the experiments use.

| name | network | params (1×28×28) | params (3×32×32) |
|---|---|---|---|
| ``mlp`` | 2 hidden layers (256, 128), ReLU | 235,146 | 820,874 |
| ``lenet`` | LeNet-5 style, ReLU + max-pool | 61,706 | 62,006 |
| ``resnet20`` | He et al. CIFAR ResNet-20, BatchNorm | 269,434 | 269,722 |

A name holding ``:`` is user code, ``MODULE:FACTORY`` (``pkg.module:factory`` or
``path/file.py:factory``), built by :func:`hpcasync.plugins.user_model` as
``factory(input_shape, num_classes)``; the contract: docs/design/plugins.md.

Models draw their initial weights from torch's global generator only, so ``torch.manual_seed(s)``
before ``build_model`` gives bitwise-identical models on every rank. No MPI here.

Example::

    torch.manual_seed(0)
    model = build_model("resnet20", (3, 32, 32))
    model = build_model("my_models:gru", (28, 28), 10)     # my_models.py in the working directory
"""
from __future__ import annotations

from torch import nn

from hpcasync.errors import ConfigError
from hpcasync.models.lenet import LeNet
from hpcasync.models.mlp import MLP
from hpcasync.models.resnet import ResNet20

__all__ = ["MODELS", "build_model", "count_parameters", "MLP", "LeNet", "ResNet20"]

_BUILDERS = {"mlp": MLP, "lenet": LeNet, "resnet20": ResNet20}
MODELS = tuple(_BUILDERS)


def build_model(name: str, input_shape, num_classes: int = 10) -> nn.Module:
    """A freshly initialised model.

    Args:
        name: one of :data:`MODELS`, or a user factory ``MODULE:FACTORY``.
        input_shape: (C, H, W) of one example, e.g. ``dataset.input_shape`` (a user factory gets
            it as a tuple of any length).
        num_classes: output width (default 10).

    Raises:
        ConfigError: unknown name, malformed shape or class count; for a user factory, a spec that
            does not import, a factory that raises or returns no nn.Module.
    """
    from hpcasync.plugins import is_spec

    if is_spec(name):
        from hpcasync.plugins import user_model

        return user_model(name, input_shape, num_classes)
    if name not in _BUILDERS:
        raise ConfigError(f"unknown model {name!r}; choose from {', '.join(MODELS)} "
                          "(or a user factory MODULE:FACTORY)")
    shape = tuple(input_shape) if isinstance(input_shape, (tuple, list)) else None
    if shape is None or len(shape) != 3 or not all(
            isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
        raise ConfigError(f"input shape must be (C, H, W) of positive integers, "
                          f"got {input_shape!r}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ConfigError(f"number of classes must be an integer >= 2, got {num_classes!r}")
    return _BUILDERS[name](shape, num_classes)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable scalars."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
