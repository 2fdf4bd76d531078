"""FlatModel's binding checks and SSGD's backward-pass counter, in one process (issue 21).

* ``FlatModel.unbound()`` names the first parameter or buffer that ``.to()``/``.double()``/
  channels_last moved off the flat buffer, and nothing while the model is untouched;
* a model whose parameters or floating buffers are not float32, or are on several devices, is
  refused with one line naming the first (the flat buffer would train it in float32 and leave
  it float32, or move every tensor to one device);
* ``presence`` lies right in front of ``grads`` in one storage (SSGD's last bucket carries both);
* :class:`~hpcasync.passes.BackwardPasses` counts passes per parameter as Horovod does,
  refuses an overrun with one line, and says which parameters got a gradient.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpcasync.comm import FlatModel
from hpcasync.errors import ConfigError
from hpcasync.passes import BackwardPasses


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(12, 2))


def _loss(net):
    return F.cross_entropy(net(torch.randn(4, 2, 4, 4)), torch.tensor([0, 1, 0, 1]))


def test_untouched_model_is_bound():
    flat = FlatModel(_net())
    assert flat.unbound() is None
    flat.zero_grad()
    assert flat.unbound() is None


@pytest.mark.parametrize("convert,first", [
    (lambda m: m.double(), "0.weight"),
    (lambda m: m.half(), "0.weight"),
    (lambda m: m.to(memory_format=torch.channels_last), "0.weight"),
])
def test_conversion_after_flattening_is_named(convert, first):
    net = _net()
    flat = FlatModel(net)
    convert(net)
    assert flat.unbound() == first


@pytest.mark.parametrize("convert,named", [
    (lambda m: m.double(), "parameter 0.weight is float64"),
    (lambda m: m.half(), "parameter 0.weight is float16"),
    (lambda m: m.to(torch.bfloat16), "parameter 0.weight is bfloat16"),
    (lambda m: m[3].double(), "parameter 3.weight is float64"),
    (lambda m: m[1].double(), "parameter 1.weight is float64"),
])
def test_a_model_that_is_not_float32_is_refused_not_cast(convert, named):
    net = _net()
    convert(net)
    dtypes = [p.dtype for p in net.parameters()]
    with pytest.raises(ConfigError, match=named) as err:
        FlatModel(net)
    assert "\n" not in str(err.value) and "model.float()" in str(err.value)
    assert [p.dtype for p in net.parameters()] == dtypes      # left as the user made it


def test_a_floating_buffer_that_is_not_float32_is_refused():
    net = _net()
    net[1].running_var = net[1].running_var.double()
    with pytest.raises(ConfigError, match="buffer 1.running_var is float64"):
        FlatModel(net)


def test_a_model_on_several_devices_is_refused_not_moved():
    net = _net()
    net[3].to("meta")                    # (a second device without a GPU: meta)
    with pytest.raises(ConfigError, match=r"on 2 devices \(cpu: 0.weight, meta: 3.weight\)"):
        FlatModel(net)
    assert net[0].weight.device.type == "cpu" and net[3].weight.device.type == "meta"


def test_replaced_buffer_is_named():
    net = _net()
    flat = FlatModel(net)
    net[1].running_mean = torch.zeros(3)
    assert flat.unbound() == "1.running_mean"


def test_presence_travels_ahead_of_the_gradients():
    flat = FlatModel(_net())
    n = len(flat.parameters)
    assert flat.presence.numel() == n
    assert flat.presence_and_grads.numel() == n + flat.numel
    assert flat.presence_and_grads.data_ptr() == flat.presence.data_ptr()
    assert flat.presence_and_grads[n:].data_ptr() == flat.grads.data_ptr()


def test_passes_counted_per_parameter_and_overrun_refused():
    net = _net()
    flat = FlatModel(net)
    passes = BackwardPasses(flat, 2, [True] * len(flat.parameters))
    _loss(net).backward()
    assert passes.counts == [1] * len(flat.parameters) and not passes.last
    _loss(net).backward()
    assert passes.seen == 2 and passes.last
    with pytest.raises(ConfigError, match=r"more than backward_passes_per_step=2 times") as err:
        _loss(net).backward()
    assert "\n" not in str(err.value)
    passes.reset()
    assert passes.seen == 0
    passes.close()


def test_presence_marks_hooked_and_hand_set_gradients_only():
    net = _net()
    net[0].weight.requires_grad_(False)
    flat = FlatModel(net)
    passes = BackwardPasses(flat, 1, [True] * len(flat.parameters))
    assert passes.presence() == [0.0] * len(flat.parameters)
    out = net[3](torch.randn(4, 12)).sum()          # only the head takes part
    out.backward()
    assert passes.presence() == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    passes.reset()
    net[1].weight.grad = torch.ones(3)              # set by hand: a gradient of its own
    assert passes.presence() == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    passes.close()


def test_a_parameter_unfrozen_later_is_counted():
    net = _net()
    net[0].weight.requires_grad_(False)
    flat = FlatModel(net)
    passes = BackwardPasses(flat, 1, [True] * len(flat.parameters))
    net[0].weight.requires_grad_(True)
    passes.reset()                                   # a step boundary hooks it
    _loss(net).backward()
    assert passes.presence()[0] == 1.0
    passes.close()
