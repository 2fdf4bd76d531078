"""``slowmo`` applies SlowMo's update (Wang et al., ICLR 2020; fairscale's
``_perform_local_optimization``) exactly: on 2 ranks the parameters after every step are bitwise
those of a one-process replay of both ranks' local SGD and, after every H-th step, the exact
average x̄ = θ_0/2 + θ_1/2 and u ← β·u − x̄/γ + x₀/γ, x₀ ← x₀ − α·γ·u, θ ← x₀ (fairscale itself is
not installed here; the formula is the reference).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import hpcasync
from hpcasync.errors import ConfigError
from hpcasync.ssgd.slowmo import SlowMo
from tests.mpi.test_localsgd import _batch, _model
from tests.mpi_util import COMM, RANK, SIZE

needs2 = pytest.mark.skipif(SIZE < 2, reason="needs 2 MPI ranks")


def _replay(steps: int, period: int, beta: float, alpha: float, lr: float, warmup: int):
    """Both ranks' parameters after each step, in one process."""
    models = [_model(), _model()]
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in models]
    x0 = [p.detach().clone() for p in models[0].parameters()]
    u = [torch.zeros_like(p) for p in x0]
    out = []
    for k in range(steps):
        grads = []
        for r, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            x, y = _batch(k, r)
            F.cross_entropy(m(x), y).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        if k < warmup:                           # SSGD: g/2 summed (pre-divided)
            for m in models:
                for p, g0, g1 in zip(m.parameters(), *grads):
                    p.grad = g0 / 2 + g1 / 2
        for o in opts:
            o.step()
        if k == warmup - 1:
            x0 = [p.detach().clone() for p in models[0].parameters()]
        if k >= warmup and (k + 1 - warmup) % period == 0:
            with torch.no_grad():
                for i, (p0, p1) in enumerate(zip(models[0].parameters(), models[1].parameters())):
                    xbar = p0 / 2 + p1 / 2
                    u[i].mul_(beta).sub_(xbar.reshape(-1).view_as(u[i]), alpha=1 / lr)
                    u[i].add_(x0[i], alpha=1 / lr)
                    x0[i].add_(u[i], alpha=-lr * alpha)
                    p0.copy_(x0[i])
                    p1.copy_(x0[i])
        out.append([[p.detach().clone() for p in m.parameters()] for m in models])
    return out


@needs2
@pytest.mark.parametrize("period,beta,alpha,warmup", [(3, 0.5, 1.0, 0), (2, 0.7, 0.5, 3)])
def test_two_ranks_equal_the_slowmo_formula_bitwise(period, beta, alpha, warmup):
    sub = COMM.Split(0 if RANK < 2 else MPI.UNDEFINED, RANK)
    if sub == MPI.COMM_NULL:
        return
    try:
        expect = _replay(10, period, beta, alpha, 0.1, warmup)
        model = _model()
        opt = SlowMo(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, sub,
                     period=period, slow_momentum=beta, slow_lr=alpha, warmup_steps=warmup)
        for k in range(10):
            x, y = _batch(k, RANK)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            bad = [i for i, (a, b) in enumerate(zip(model.parameters(), expect[k][RANK]))
                   if not torch.equal(a, b)]
            assert not bad, f"step {k}: parameters {bad} differ from the SlowMo formula"
        assert opt.averages == len([k for k in range(warmup, 10) if (k + 1 - warmup) % period == 0])
    finally:
        sub.Free()


def test_with_no_slow_momentum_and_slow_lr_1_it_is_local_sgd():
    a, b = _model(), _model()
    slow = hpcasync.optimizer("slowmo", a, torch.optim.SGD(a.parameters(), lr=0.1), period=3,
                              slow_momentum=0.0, slow_lr=1.0)
    local = SlowMo(torch.optim.SGD(b.parameters(), lr=0.1), b, COMM, period=3,
                   slow_momentum=0.5, slow_lr=1.0)
    ref = copy.deepcopy(_model())
    avg = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k in range(6):
        x, y = _batch(k, RANK)
        for m, o in ((a, slow), (b, local), (ref, avg)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        if (k + 1) % 3 == 0:                   # plain local SGD's average
            with torch.no_grad():
                for p in ref.parameters():
                    t = p.detach().clone().div_(SIZE)
                    COMM.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)
                    p.copy_(t)
    assert all(torch.allclose(p, q, rtol=1e-5, atol=1e-6)
               for p, q in zip(a.parameters(), ref.parameters()))
    assert not all(torch.allclose(p, q, rtol=1e-5, atol=1e-6)     # β 0.5 moved elsewhere
                   for p, q in zip(b.parameters(), ref.parameters()))


def test_bad_options_are_one_line_errors():
    model = _model()
    for kw, said in ((dict(slow_momentum=1.0), r"slow_momentum must be in \[0, 1\)"),
                     (dict(slow_lr=0), "slow_lr must be a number > 0")):
        with pytest.raises(ConfigError, match=said):
            SlowMo(torch.optim.SGD(model.parameters(), lr=0.1), model, COMM, **kw)
