"""FlatModel's flat gradient buffer averaged across ranks by one allreduce. (FlatModel itself, one
process: tests/unit/test_flat.py.)"""
from __future__ import annotations

import torch

from hpcasync.comm import FlatModel, allreduce
from tests.mpi_util import COMM, RANK
from tests.unit.test_flat import make_net


def test_flat_grads_allreduce_averages_gradients():
    net = make_net(3)
    flat = FlatModel(net)
    x = torch.randn(4, 1, 6, 6, generator=torch.Generator().manual_seed(RANK))
    net(x).sum().backward()
    mine = flat.grads.clone()
    allreduce(COMM, flat.grads, average=True)
    grads = COMM.allgather(mine)
    assert torch.allclose(flat.grads, torch.stack(grads).mean(0), atol=1e-5)
    assert torch.equal(net.fc.bias.grad, flat.views("grads")[-1][1])
