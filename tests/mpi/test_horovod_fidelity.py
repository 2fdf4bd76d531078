"""``hpcasync.horovod``: the small places where it must do what Horovod does (issue 22, item 6),
each against real Horovod when it imports, else the formula. Run under ``mpiexec -n 2``."""
from __future__ import annotations

import warnings

import pytest
import torch

import hpcasync.horovod as fh
from tests.mpi_util import COMM, HOROVOD_ERROR, RANK, SIZE

pytestmark = pytest.mark.timeout(60)




def test_broadcast_optimizer_state_keeps_a_tensor_lr(backends):
    model = torch.nn.Linear(3, 2)
    lr = torch.tensor(0.1)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    fh.broadcast_optimizer_state(opt, root_rank=0, model=model)
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.1)


def test_broadcast_optimizer_state_sets_non_tensor_state(backends):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    for st in opt.state.values():
        st["note"] = RANK                      # non-tensor per-parameter state
    fh.broadcast_optimizer_state(opt, root_rank=0)
    assert all(st["note"] == 0 for st in opt.state.values())


def test_broadcast_parameters_takes_a_list_of_tensors(backends):
    # the facade only: real Horovod names unnamed tensors by its per-process handle counter,
    # which differs between ranks once they ran uneven work (the join tests) and then hangs
    for hvd in (fh,):
        ts = [torch.full((2,), float(RANK)), torch.full((3,), float(RANK) + 1)]
        hvd.broadcast_parameters(ts, root_rank=0)
        assert torch.equal(ts[0], torch.zeros(2)) and torch.equal(ts[1], torch.ones(3))


def _one_step(hvd, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), **kw)
    g = torch.Generator().manual_seed(7 + RANK)
    model(torch.randn(5, 4, generator=g)).pow(2).sum().backward()
    opt.synchronize()
    return [p.grad.clone() for p in model.parameters()]


def test_gradient_predivide_factor_is_horovods(backends):
    f = 3.0
    mine = _one_step(fh, gradient_predivide_factor=f)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    g = torch.Generator().manual_seed(7 + RANK)
    model(torch.randn(5, 4, generator=g)).pow(2).sum().backward()
    everyone = COMM.allgather([p.grad.clone() for p in model.parameters()])   # local gradients
    for k, g in enumerate(mine):            # (sum of g/f) * f/size, in float32
        ref = sum(torch.mul(e[k], 1.0 / f) for e in everyone) * (f / SIZE)
        assert torch.allclose(g, ref, rtol=0, atol=1e-6)
    if "horovod" in backends:
        theirs = _one_step(backends["horovod"], gradient_predivide_factor=f)
        assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(mine, theirs))


def test_num_groups_and_groups_make_the_buckets(backends):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = fh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), num_groups=2)
    assert len(opt._hvd_reducer.buckets) == 2
    ps = list(model.parameters())
    opt = fh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), groups=[ps[:2]])
    assert len(opt._hvd_reducer.buckets) == 3            # the group, then the other two alone
    with pytest.raises(ValueError, match="contiguous"):
        fh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters(),
                                groups=[[ps[0], ps[2]]])
    a = _one_step(fh)
    b = _one_step(fh, num_groups=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))   # fusion changes nothing else


def test_frozen_integer_parameters_do_not_stop_the_optimizer(backends):
    model = torch.nn.Linear(3, 2)
    model.count = torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    opt = fh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert torch.equal(model.count, torch.zeros(2, dtype=torch.int64))


def test_step_after_synchronize_warns_in_horovods_words(backends):
    texts = {}
    for name, hvd in backends.items():
        model = torch.nn.Linear(3, 2)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        model(torch.ones(1, 3)).sum().backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt.step()
        texts[name] = [str(x.message) for x in w if "skip_synchronize" in str(x.message)]
    assert texts["facade"] and texts["facade"][0].startswith(
        "optimizer.step() called without optimizer.skip_synchronize() context after "
        "optimizer.synchronize(). This can cause training slowdown.")
    if "horovod" in texts:
        assert texts["facade"] == texts["horovod"]
