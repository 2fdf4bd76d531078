"""A parameter the optimizer trains that gets no gradient in a step (issue 21 item 2, "an
unused-this-step parameter"): ssgd gives it ``p.grad = None`` as torch does
(tests/mpi/test_ssgd_torch_parity.py); daso, odsgd and the parameter-server rules apply a zero
gradient there, so they SAY so, once per parameter, naming it (never silently). 2+ ranks.
Planted: ``_warns_unused = False`` on the base class: the warning tests fail."""
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpcasync
from hpcasync.api import PS_ALGORITHMS
from tests.mpi_util import COMM, RANK, SIZE

pytestmark = pytest.mark.skipif(SIZE < 2, reason="needs 2+ ranks")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.branch = nn.Linear(8, 8)          # used on even steps only
        self.head = nn.Linear(8, 3)
        self.step = 0

    def forward(self, x):
        h = torch.tanh(self.body(x))
        if self.step % 2 == 0:
            h = torch.tanh(self.branch(h))
        return self.head(h)


def _run(algorithm, caplog, **hyper):
    torch.manual_seed(0)
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with caplog.at_level(logging.WARNING, logger="hpcasync"):
        if algorithm in PS_ALGORITHMS:
            opt = hpcasync.ParameterServer(model, algorithm, lr=0.05, comm=COMM, ps_rank=0,
                                           ps_ranks=1, warmup_epochs=0)
            if opt.is_server:
                opt.serve()
                return []
        else:
            opt = hpcasync.optimizer(algorithm, model, sgd, **hyper)
        for s in range(4):
            model.step = s
            g = torch.Generator().manual_seed(10 * s + RANK)
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if algorithm in PS_ALGORITHMS:
            opt.finish()
    return [r.getMessage() for r in caplog.records if "got no gradient" in r.getMessage()]


@pytest.mark.parametrize("algorithm", ["odsgd", "daso", "smega2", "asgd"])
def test_unused_parameter_is_said_once(algorithm, caplog):
    hyper = {"epochs": 1, "steps_per_epoch": 4} if algorithm == "daso" else {}
    said = _run(algorithm, caplog, **hyper)
    if algorithm in PS_ALGORITHMS and RANK == 0:
        assert said == []                    # the server trains nothing itself
        return
    assert len(said) == 1, said               # step 1 (odd): branch unused; said once only
    assert "branch.weight, branch.bias" in said[0] and algorithm in said[0]


def test_ssgd_says_nothing_it_skips_like_torch(caplog):
    assert _run("ssgd", caplog) == []
