"""A sharded parameter server is the single server for one global order of pushes (issue 21, item 8).

4 ranks: servers 0 and 1 (``ps_ranks=2``), workers 2 and 3, every rule. Each worker pushes
gradients that depend only on (worker, step) and waits a few ms before its push to one shard or the
other, alternating, so the two servers see the workers' pushes ARRIVE in different orders. Then:

* both servers applied the pushes in the same order (shard 0's, :mod:`hpcasync.ps.ordering`);
* θ (shard 0's slice + shard 1's) equals, bitwise, one rule on the whole θ driven in process through
  that order, the server's lr warm-up included — so every order-dependent scalar (SHAT's α,
  LC-ASGD's loss prediction, SMEGA2's cycle counter, the warm-up clock) was the same on both slices.

Planted bug: ``ordered()`` returning the plain transport (each shard in its own arrival order)
fails the first assertion for every rule (seen: both shards applied other orders).
"""
from __future__ import annotations

import time

import pytest
import torch

from hpcasync.ps.optimizer import ALGORITHMS, ParameterServer
from hpcasync.rules import PushMeta, make_rule, ps_lr_factor
from tests.mpi_util import COMM, SIZE

pytestmark = pytest.mark.skipif(SIZE != 4, reason="needs 4 MPI ranks")

PUSHES, LR, WARMUP = 12, 0.05, 1.0
HYPER = {"asgd": {"momentum": 0.5}, "smega2": {"momentum": 0.9}, "dana": {"momentum": 0.9},
         "nag": {"momentum": 0.9}}


def _grad(w: int, k: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * w + k)
    return torch.randn(n, generator=gen) * 0.1


def _loss(w: int, k: int) -> float:
    return 2.0 - 0.05 * k + 0.01 * w


def _delayed(transport, delay_of):
    push = transport.push

    def slow(*args, **kw):
        time.sleep(delay_of())
        return push(*args, **kw)
    transport.push = slow


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_shards_apply_one_global_order_and_equal_one_server(algorithm):
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 7)                    # 707 parameters: 354 + 353
    theta0 = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    hyper = {"lr": LR, **HYPER.get(algorithm, {})}
    opt = ParameterServer(model, algorithm, comm=COMM, ps_rank=0, ps_ranks=2,
                          steps_per_epoch=PUSHES, warmup_epochs=WARMUP, **hyper)
    order: list[int] = []
    if opt.is_server:
        opt.serve(on_push=lambda w, tau, loss: order.append(w))
        mine = (opt.shard, order, opt.rule.theta.detach().clone())
    else:
        step = [0]
        w = opt.worker
        # worker w delays its push to shard (w + k) % 2 at step k: the shards see other orders
        for s, t in enumerate(opt.transports):
            _delayed(t, lambda s=s: 0.004 if (w + step[0]) % 2 == s else 0.0)
        for k in range(PUSHES):
            step[0] = k
            opt.push(_grad(w, k, opt.flat.numel), loss=_loss(w, k))
        opt.finish()
        mine = None
    got = COMM.allgather(mine)
    (_, order0, theta_a), (_, order1, theta_b) = got[0], got[1]
    assert len(order0) == 2 * PUSHES
    assert order0 == order1, f"shard 1 applied {order1}, shard 0 {order0}"

    # the single server, in process, through shard 0's order
    W = 2
    rule = make_rule(algorithm, theta0.clone(), W, **hyper)
    factor = ps_lr_factor(algorithm, W, WARMUP)
    version = {w: rule.initial_reply(w).version for w in range(W)}
    taken = {w: 0 for w in range(W)}
    for accepted, w in enumerate(order0):
        k = taken[w]
        taken[w] += 1
        g, meta = _grad(w, k, theta0.numel()), PushMeta(version=version[w], loss=_loss(w, k))
        assert rule.validate(w, g, meta) is None
        rule.lr = LR * factor(accepted / (W * PUSHES))
        version[w] = rule.on_push(w, g, meta).version
    whole = torch.cat([theta_a, theta_b])
    assert torch.equal(whole, rule.theta), \
        f"{algorithm}: max |Δ| {float((whole - rule.theta).abs().max()):.3g}"
