"""``model.to(...)`` after ``hpcasync.optimizer(...)`` (issue 21 item 4): channels_last or
``.double()`` re-binds ``p.data`` off the flat buffer, so the algorithm would silently stop training
those layers. The next step (for SSGD already its backward) stops with one line on every training
rank (already its ``zero_grad()``), under ssgd, daso, odsgd and two PS rules; a model converted
*before* the optimizer trains.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpcasync
from hpcasync.errors import ConfigError
from tests.mpi_util import RANK, SIZE

needs2 = pytest.mark.skipif(SIZE < 2, reason="needs 2 MPI ranks")
ALGORITHMS = ["ssgd", "daso", "odsgd", "smega2", "dcasgd-a"]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 8 * 8, 4))


def _batch(step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 * step + RANK)
    return torch.randn(8, 1, 12, 12, generator=g).to(dtype), torch.randint(0, 4, (8,), generator=g)


def _build(algorithm: str, model: nn.Module):
    from hpcasync.topology import Topology

    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    topo = None
    kw = {}
    if algorithm == "daso":        # every epoch warm-up: blocking syncs, nothing left in flight
        topo = Topology.build(ranks_per_node=2 if SIZE % 2 == 0 and SIZE >= 4 else 1)
        kw = dict(epochs=4, steps_per_epoch=4, warmup_epochs=4, cooldown_epochs=0, topo=topo)
    elif algorithm == "odsgd":
        kw = dict(warmup_iters=1)
    elif algorithm == "smega2":
        kw = dict(steps_per_epoch=10)
    return hpcasync.optimizer(algorithm, model, sgd, **kw), topo


def _step(model, opt, step: int, dtype=torch.float32) -> None:
    x, y = _batch(step, dtype)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _end(algorithm, opt, topo) -> None:
    if algorithm not in ("ssgd", "daso"):
        opt.finish()
    if algorithm == "ssgd":
        opt.close()
    if topo is not None:
        topo.free()


@needs2
@pytest.mark.parametrize("convert", ["channels_last", "double"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_conversion_after_the_optimizer_stops_with_one_line(algorithm, convert):
    model = _net()
    opt, topo = _build(algorithm, model)
    if getattr(opt, "is_server", False):
        opt.serve()
        return
    _step(model, opt, 0)
    if convert == "channels_last":
        model.to(memory_format=torch.channels_last)
        dtype = torch.float32
    else:
        model.double()
        dtype = torch.float64
    with pytest.raises(ConfigError, match=r"after hpcasync\.optimizer") as err:
        _step(model, opt, 1, dtype)        # (raised by zero_grad(), before any communication)
    msg = str(err.value)
    assert "\n" not in msg and "channels_last" in msg and ".half()" in msg
    assert msg.startswith(f"{algorithm}: 0.weight is no longer a view"), msg   # the first moved
    _end(algorithm, opt, topo)


@needs2
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_channels_last_before_the_optimizer_trains(algorithm):
    model = _net().to(memory_format=torch.channels_last)
    opt, topo = _build(algorithm, model)
    if getattr(opt, "is_server", False):
        opt.serve()
        return
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(3):
        _step(model, opt, step)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters())), \
        "a layer did not train"
    _end(algorithm, opt, topo)
