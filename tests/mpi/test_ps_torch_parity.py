"""The parameter-server rules in a user's loop treat parameters as plain torch does (issue 21).

* two param groups (weight decay on weights, none on biases; the biases' group at lr 0), a frozen
  layer (``requires_grad=False``) and a parameter outside the optimizer: the frozen layer and the
  outside parameter stay bitwise equal to their initial values on every worker after every step
  (replies, SMEGA2's look-ahead, SHAT's mix) and on every rank at the end; the lr-0 group too at
  the end (every rank then holds the server's θ); the weights train; the server gets each group's
  lr with every push;
* ``OneCycleLR`` (it cycles ``momentum``) drives the server's lr and momentum push for push;
* ``warmup_epochs=0`` needs no ``steps_per_epoch``.

Runs under ``mpiexec -n 3`` (one server, two workers); any size >= 2 works.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpcasync
from tests.mpi_util import COMM, RANK, SIZE

pytestmark = pytest.mark.skipif(SIZE < 2, reason="needs a server and a worker")
STEPS = 6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(6, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.outside = nn.Parameter(torch.randn(3))        # trained by nobody: not in the SGD
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(self.body(torch.relu(self.frozen(x))))) + self.outside


def batch(step: int):
    g = torch.Generator().manual_seed(1000 * RANK + step)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def snapshot(model, names):
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.split(".")[0] in names}


def unchanged(model, before) -> list[str]:
    now = dict(model.named_parameters())
    return [n for n, p in before.items() if not torch.equal(now[n].detach(), p)]


@pytest.mark.parametrize("algorithm", ["smega2", "dcasgd-a", "shat", "asgd"])
def test_groups_frozen_and_outside_parameters(algorithm):
    model = Net()
    never = snapshot(model, ("frozen", "outside"))
    weights = [model.body.weight, model.head.weight]
    biases = [model.body.bias, model.head.bias]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    sgd = torch.optim.SGD([{"params": weights, "weight_decay": 1e-3},
                           {"params": biases, "weight_decay": 0.0, "lr": 0.0}],
                          lr=0.05, momentum=0.9)
    opt = hpcasync.optimizer(algorithm, model, sgd, steps_per_epoch=STEPS)
    assert len(opt.param_groups) == 2
    if opt.is_server:
        lrs = []
        opt.serve(on_push=lambda w, tau, loss: lrs.append(opt.rule.lr))
        assert len(lrs) == STEPS * (SIZE - 1)
        assert all(isinstance(lr, tuple) and lr[1] == 0.0 and lr[0] > 0 for lr in lrs)
        if algorithm != "smega2":                    # smega2 warms up (×factor) by default
            assert set(lrs) == {(0.05, 0.0)}
    else:
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step(loss=loss)
            moved = unchanged(model, never)
            assert not moved, f"{algorithm}: step {step} moved {moved} on worker {opt.worker}"
        opt.finish()
    moved = unchanged(model, never)
    assert not moved, f"{algorithm}: rank {RANK} ends with {moved} moved"
    lr0 = {n: start[n] for n in ("body.bias", "head.bias")}
    assert not unchanged(model, lr0), f"{algorithm}: the lr-0 group moved"
    assert not torch.equal(model.body.weight.detach(), start["body.weight"])


def test_onecycle_drives_lr_and_momentum_and_no_warmup_needs_no_clock():
    model = Net()
    opt = hpcasync.optimizer("smega2", model, lr=0.1, momentum=0.9, warmup_epochs=0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS)
    ref_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)
    ref = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=0.1, total_steps=STEPS)
    want = []
    for _ in range(STEPS):
        want.append((ref_opt.param_groups[0]["lr"], ref_opt.param_groups[0]["momentum"]))
        ref_opt.step()
        ref.step()
    if opt.is_server:
        seen = []
        # the frozen layer makes the rule grouped (one group): its lr is a 1-tuple
        opt.serve(on_push=lambda w, tau, loss: seen.append((*opt.rule.lr, opt.rule.momentum)))
        assert sorted(seen) == sorted(want * (SIZE - 1))          # no warm-up factor, no clock
        assert len({m for _, m in seen}) > 1
    else:
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
        opt.finish()
    COMM.Barrier()
