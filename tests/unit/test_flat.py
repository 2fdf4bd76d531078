"""FlatModel: parameters, gradients and BatchNorm buffers as views of flat buffers (split from
test_comm.py; the allreduce of the flat gradients: tests/mpi/test_flat.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hpcasync.comm import FlatModel, flatten, unflatten_into
from hpcasync.errors import ConfigError


# -- FlatModel ----------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def make_net(seed=0):
    torch.manual_seed(seed)
    return Net()


def test_flat_params_are_views_of_one_buffer():
    net, x = make_net(), torch.randn(2, 1, 6, 6)
    before = [p.detach().clone() for p in net.parameters()]
    flat = FlatModel(net)
    assert flat.params.dtype == torch.float32 and flat.params.dim() == 1
    assert flat.numel == sum(p.numel() for p in before) == flat.params.numel()
    assert flat.nbytes == 4 * flat.numel
    assert torch.equal(flat.params, flatten(before))          # values kept, in parameter order
    assert [n for n, _ in flat.views()] == [n for n, _ in net.named_parameters()]
    net.eval()
    out = net(x)
    flat.params.mul_(2.0)                                      # mutate the flat buffer ...
    assert torch.equal(net.fc.bias, 2 * before[-1])           # ... the module sees it
    assert not torch.allclose(net(x), out)
    flat.params.zero_()
    assert torch.equal(net(x), torch.zeros(2, 5))
    flat.load_flat(flatten(before))
    assert torch.equal(net(x), out) and flat.check() == []


def test_backward_writes_into_the_flat_grad_buffer():
    net, ref_net = make_net(1), make_net(1)
    flat = FlatModel(net)
    x, y = torch.randn(4, 1, 6, 6), torch.randint(0, 5, (4,))
    for model in (net, ref_net):
        nn.functional.cross_entropy(model(x), y).backward()
    expect = flatten([p.grad for p in ref_net.parameters()])
    assert torch.allclose(flat.grads, expect, atol=1e-6) and flat.grads.abs().sum() > 0
    for (_, g), p in zip(flat.views("grads"), net.parameters()):
        assert p.grad.data_ptr() == g.data_ptr()
    nn.functional.cross_entropy(net(x), y).backward()          # accumulates in place
    assert torch.allclose(flat.grads, 2 * expect, atol=1e-5)
    flat.zero_grad()
    assert flat.grads.abs().sum() == 0 and flat.check() == []
    for p in net.parameters():                                 # what zero_grad(set_to_none=True)
        p.grad = None                                          # does: it drops the views
    assert flat.check() == [f"{n}.grad" for n in flat.names]
    nn.functional.cross_entropy(net(x), y).backward()
    flat.rebind_grads()                                        # keeps the fresh grads
    assert flat.check() == [] and torch.allclose(flat.grads, expect, atol=1e-6)
    before = flat.params.clone()
    with torch.no_grad():                                      # an optimizer's in-place step
        for p in net.parameters():                             # (torch.optim imports take
            p.add_(p.grad, alpha=-0.1)                         # seconds, so done by hand)
    assert torch.allclose(flat.params, before - 0.1 * flat.grads)


def test_batchnorm_buffers_are_flat_and_counters_listed():
    net = make_net(2)
    flat = FlatModel(net)
    assert flat.buffer_names == ["bn.running_mean", "bn.running_var"]
    assert flat.int_buffers == ["bn.num_batches_tracked"]
    assert torch.equal(flat.buffers, torch.cat([torch.zeros(3), torch.ones(3)]))
    net.train()
    net(torch.randn(4, 1, 6, 6))                               # updates the running stats
    assert torch.equal(flat.buffers[:3], net.bn.running_mean)
    assert not torch.equal(flat.buffers[:3], torch.zeros(3))
    flat.buffers.copy_(torch.cat([torch.full((3,), 5.0), torch.full((3,), 2.0)]))
    assert torch.equal(net.bn.running_var, torch.full((3,), 2.0))
    assert int(net.bn.num_batches_tracked) == 1 and flat.check() == []


def test_flatten_unflatten_and_load_errors():
    ts = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 2)]
    flat = flatten(ts)
    outs = [torch.empty_like(t) for t in ts]
    unflatten_into(flat, outs)
    assert all(torch.equal(a, b) for a, b in zip(ts, outs))
    with pytest.raises(ConfigError, match="elements"):
        unflatten_into(flat[:-1], outs)
    with pytest.raises(ConfigError, match="elements"):
        FlatModel(make_net()).load_flat(torch.zeros(3))
