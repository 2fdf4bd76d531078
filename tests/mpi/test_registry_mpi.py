"""A registered 15th algorithm trains through the front door (issue 25): ``asgd-copy`` (ASGD
under another name, registered on every rank) runs as a parameter server in a user's loop and,
with one worker (2 ranks, a fixed push order), ends bitwise where ``asgd`` ends."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hpcasync
import hpcasync.ps.optimizer  # noqa: F401 - imported before the registration, as in a real job
from hpcasync import registry
from tests.models import SmallBN
from tests.mpi_util import COMM, SIZE

pytestmark = pytest.mark.skipif(SIZE < 2, reason="needs a server and a worker (2+ ranks)")


def _train(algorithm: str) -> torch.Tensor:
    from hpcasync.data import load_dataset

    train, _ = load_dataset("fashion-mnist-mini", train_limit=256, test_limit=10)
    torch.manual_seed(0)
    model = SmallBN()
    opt = hpcasync.optimizer(algorithm, model, torch.optim.SGD(model.parameters(), lr=0.05))
    assert opt.algorithm == algorithm
    if opt.is_server:
        opt.serve()
    else:
        w = COMM.Get_rank() - 1
        for step in range(4):
            lo = (step * (SIZE - 1) + w) * 16
            x = torch.stack([train[i][0] for i in range(lo, lo + 16)])
            y = torch.tensor([train[i][1] for i in range(lo, lo + 16)])
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        opt.finish()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_registered_algorithm_trains_as_the_rule_it_copies():
    registry.register(registry.ps_algorithm("asgd-copy", "hpcasync.rules.asgd:ASGD"))
    try:
        copy = _train("asgd-copy")
    finally:
        registry.unregister("asgd-copy")
    asgd = _train("asgd")
    assert "asgd-copy" not in hpcasync.algorithms()
    torch.manual_seed(0)
    theta0 = torch.cat([p.detach().reshape(-1) for p in SmallBN().parameters()])
    assert not torch.equal(copy, theta0)                        # it trained
    ends = COMM.allgather(copy)
    assert all(torch.equal(ends[0], e) for e in ends)           # every rank has the server's θ
    if SIZE == 2:                                               # one worker: a fixed push order
        assert torch.equal(copy, asgd)
