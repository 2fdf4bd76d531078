"""Model zoo: output shapes on both input shapes, ResNet-20's size and structure, determinism
under torch.manual_seed, errors. No collectives."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hpcasync.errors import ConfigError
from hpcasync.models import MODELS, build_model, count_parameters

SHAPES = [(1, 28, 28), (3, 32, 32)]
PARAMS = {("mlp", (1, 28, 28)): 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10,
          ("lenet", (1, 28, 28)): 6 * 25 + 6 + 16 * 6 * 25 + 16 + 400 * 120 + 120 + 120 * 84 + 84
          + 84 * 10 + 10,
          ("lenet", (3, 32, 32)): 6 * 75 + 6 + 16 * 6 * 25 + 16 + 400 * 120 + 120 + 120 * 84 + 84
          + 84 * 10 + 10,
          ("resnet20", (3, 32, 32)): 269_722,          # He et al. Table 6: 0.27M
          ("resnet20", (1, 28, 28)): 269_722 - 2 * 16 * 9}


def test_names():
    assert MODELS == ("mlp", "lenet", "resnet20")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", MODELS)
def test_forward_backward_shapes(name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape)
    x = torch.randn(4, *shape)
    out = model(x)
    assert out.shape == (4, 10) and out.dtype == torch.float32 and torch.isfinite(out).all()
    out.logsumexp(1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    if (name, shape) in PARAMS:
        assert count_parameters(model) == PARAMS[(name, shape)]
    assert build_model(name, shape, num_classes=7)(x[:2]).shape == (2, 7)


def test_resnet20_structure():
    model = build_model("resnet20", (3, 32, 32))
    assert abs(count_parameters(model) / 1e6 - 0.27) < 0.005
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(convs) + len(linears) == 20                      # 6n + 2 with n = 3
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 19
    assert [c.out_channels for c in convs] == [16] * 7 + [32] * 6 + [64] * 6
    assert [c.stride[0] for c in convs if c.stride[0] != 1] == [2, 2]
    # option-A shortcut: stride-2 subsample + zero channels, no parameters
    block = model.layer2[0]
    x = torch.randn(2, 16, 8, 8)
    sc = block.shortcut(x)
    assert torch.equal(sc[:, :16], x[:, :, ::2, ::2]) and not sc[:, 16:].any()


@pytest.mark.parametrize("name", MODELS)
def test_deterministic_given_seed(name):
    def make(seed):
        torch.manual_seed(seed)
        return build_model(name, (3, 32, 32))
    a, b, c = make(3), make(3), make(4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())
    x = torch.randn(3, 3, 32, 32)
    assert torch.equal(a(x), b(x))


def test_errors():
    with pytest.raises(ConfigError) as info:
        build_model("vgg16", (3, 32, 32))
    assert "vgg16" in str(info.value) and "mlp, lenet, resnet20" in str(info.value)
    for bad in [(28, 28), (1, 0, 28), "1x28x28", (1.0, 28, 28)]:
        with pytest.raises(ConfigError, match="input shape"):
            build_model("mlp", bad)
    with pytest.raises(ConfigError, match="classes"):
        build_model("lenet", (1, 28, 28), num_classes=1)


def test_lenet_padding_reaches_lenet5_geometry():
    # 28x28 is padded to LeNet-5's 32x32: both shapes end in a 16x5x5 map (fc input 400)
    for shape in SHAPES:
        model = build_model("lenet", shape)
        assert model.features(torch.zeros(1, *shape)).shape == (1, 16, 5, 5)
    assert build_model("lenet", (1, 8, 8))(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


def test_user_factory_spec():
    """A name holding ':' is user code (hpcasync.plugins): factory(input_shape, num_classes)."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    spec = f"{repo / 'examples/plugins/my_models.py'}:gru"
    torch.manual_seed(0)
    model = build_model(spec, (28, 28), 7)
    assert model(torch.zeros(3, 28, 28)).shape == (3, 7)
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 7)
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        build_model(spec.replace(":gru", ":nope"), (28, 28), 7)
    with pytest.raises(ConfigError, match="the factory raised ValueError"):
        build_model(spec, (3, 32, 32), 10)           # gru reads (H, W) or (1, H, W) items
