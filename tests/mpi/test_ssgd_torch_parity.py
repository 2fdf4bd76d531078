"""SSGD trains exactly as torch would (issue 21 items 1 and 2).

* Accumulation in Horovod's meaning: ``backward_passes_per_step=k`` with k ``backward()`` and one
  ``step()`` equals, bitwise, ``backward_passes_per_step=1`` where the user sums the same k passes
  himself and hands the sum over as ``p.grad``; and it learns.
* Frozen, outside-the-optimizer, unused-by-every-rank and used-on-one-rank parameters: parameters
  and optimizer state bitwise those of a one-process torch reference that replays both ranks'
  batches and averages the gradients as the allreduce does ((g0 + g1) / 2, a parameter no rank
  used keeping ``grad = None``). Bitwise needs two ranks: with three the sum's order is MPI's
  choice, so these tests run on a 2-rank sub-communicator (the other ranks idle).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from hpcasync.errors import ConfigError
from hpcasync.ssgd import DistributedOptimizer
from tests.mpi_util import COMM, RANK, SIZE

needs2 = pytest.mark.skipif(SIZE < 2, reason="needs 2 MPI ranks")


@pytest.fixture
def pair():
    """COMM's first two ranks (None on the others)."""
    sub = COMM.Split(0 if RANK < 2 else MPI.UNDEFINED, RANK)
    yield None if sub == MPI.COMM_NULL else sub
    if sub != MPI.COMM_NULL:
        sub.Free()


def _data(step: int, rank: int, micro: int = 0, bs: int = 6):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(bs, 8, generator=g), torch.randint(0, 4, (bs,), generator=g)


class Branchy(nn.Module):
    """A frozen input layer, a layer outside the optimizer, a branch every rank skips on odd
    steps and a branch only rank 0 uses."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.trunk = nn.Linear(8, 8)
        self.outside = nn.Linear(8, 8)
        self.sometimes = nn.Linear(8, 4)
        self.rank0_only = nn.Linear(8, 4)
        self.head = nn.Linear(8, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x, step: int, rank: int):
        h = torch.tanh(self.trunk(torch.tanh(self.frozen(x))))
        h = h + torch.tanh(self.outside(h))
        out = self.head(h)
        if step % 2 == 0:
            out = out + self.sometimes(h)
        if rank == 0:
            out = out + self.rank0_only(h)
        return out


def _trained(model):
    return [p for n, p in model.named_parameters() if not n.startswith("outside")]


def _make_opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.05)
    return torch.optim.Adam(params, lr=0.01, weight_decay=0.05)


def _state_equal(opt_a, params_a, opt_b, params_b) -> None:
    for (name, pa), pb in zip(params_a, params_b):
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert sa.keys() == sb.keys(), f"{name}: state keys {sorted(sa)} vs torch {sorted(sb)}"
        for key in sa:
            va, vb = sa[key], sb[key]
            same = torch.equal(va, vb) if torch.is_tensor(va) else va == vb
            assert same, f"{name}: optimizer state {key!r} differs from torch's"


@needs2
@pytest.mark.parametrize("kind,overlap", [("sgd", False), ("sgd", True), ("adam", False),
                                          ("adam", True)])
def test_unused_frozen_and_outside_parameters_as_torch(pair, kind, overlap):
    if pair is None:
        return
    rank, size = pair.Get_rank(), pair.Get_size()
    torch.manual_seed(3)
    model = Branchy()
    ref = copy.deepcopy(model)                          # before flattening: plain torch tensors
    frozen0 = model.frozen.weight.detach().clone()
    outside0 = model.outside.weight.detach().clone()
    opt = DistributedOptimizer(_make_opt(kind, _trained(model)), model, pair, overlap=overlap,
                               bucket_bytes=64)
    assert len(opt.reducer.buckets) > 2
    ref_opt = _make_opt(kind, _trained(ref))
    grad_none = []
    for step in range(5):
        x, y = _data(step, rank)
        opt.zero_grad()
        F.cross_entropy(model(x, step, rank), y).backward()
        opt.step()
        # the reference: every rank's gradient in one process, averaged as the allreduce does
        grads = []
        for r in range(size):
            ref.zero_grad(set_to_none=True)
            xr, yr = _data(step, r)
            F.cross_entropy(ref(xr, step, r), yr).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in ref.parameters()])
        for k, p in enumerate(ref.parameters()):
            got = [g[k] for g in grads]
            if all(g is None for g in got):
                p.grad = None
            else:
                total = torch.zeros_like(p)
                for g in got:
                    total = total + (torch.zeros_like(p) if g is None else g)
                p.grad = total / size
        ref_opt.step()
        grad_none.append(model.sometimes.weight.grad is None)
    assert torch.equal(model.frozen.weight, frozen0), "a requires_grad=False parameter moved"
    assert torch.equal(model.outside.weight, outside0), "a parameter outside the optimizer moved"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{name} differs from torch: max |d| {(p - q).abs().max():.3g}"
    _state_equal(opt, [(n, p) for n, p in model.named_parameters() if not n.startswith("outside")],
                 ref_opt, _trained(ref))
    assert grad_none == [s % 2 == 1 for s in range(5)], \
        "a parameter no rank used must end the step with grad None (torch skips it)"
    opt.close()


def _horovod_loop(comm, passes: int, steps: int, *, overlap: bool, user_sums: bool):
    """k backward passes then one step (``user_sums``: bpps=1, the k passes summed in a plain
    torch mirror and handed over as p.grad). Returns the final flat parameters."""
    rank = comm.Get_rank()
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    mirror = copy.deepcopy(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9,
                                               weight_decay=0.01), model, comm,
                               backward_passes_per_step=1 if user_sums else passes,
                               overlap=overlap, bucket_bytes=256)
    for step in range(steps):
        opt.zero_grad()
        if user_sums:
            with torch.no_grad():
                for p, q in zip(mirror.parameters(), model.parameters()):
                    p.copy_(q)
            mirror.zero_grad(set_to_none=False)
            for p in mirror.parameters():        # accumulate into zeros, as the flat buffer does
                p.grad = torch.zeros_like(p)
        for micro in range(passes):
            x, y = _data(step, rank, micro)
            F.cross_entropy((mirror if user_sums else model)(x), y).backward()
        if user_sums:
            for p, q in zip(model.parameters(), mirror.parameters()):
                p.grad = q.grad.clone()
        opt.step()
    assert opt.steps == steps
    opt.close()
    return opt.flat.params.clone()


@needs2
@pytest.mark.parametrize("overlap", [False, True])
def test_horovod_style_accumulation_equals_user_accumulation(overlap):
    ours = _horovod_loop(COMM, 3, 4, overlap=overlap, user_sums=False)
    theirs = _horovod_loop(COMM, 3, 4, overlap=False, user_sums=True)
    assert torch.equal(ours, theirs), (
        f"bpps=3 differs from the user's own accumulation: max |d| {(ours - theirs).abs().max():.3g}")
    replicas = COMM.allgather(ours)
    assert all(torch.equal(replicas[0], r) for r in replicas), "replicas diverged"


def test_overrun_is_one_line_error_and_recoverable():
    model = nn.Sequential(nn.Linear(8, 4))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, COMM,
                               backward_passes_per_step=2)
    x, y = _data(0, RANK)
    opt.zero_grad()
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
    with pytest.raises(ConfigError, match=r"more than backward_passes_per_step=2 times") as err:
        F.cross_entropy(model(x), y).backward()
    assert "\n" not in str(err.value)
    opt.zero_grad()                                     # starts afresh
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.steps == 1 and opt.passes == 0
    opt.close()


@needs2
def test_horovod_style_accumulation_learns():
    """bpps=2, the Horovod loop, a small classification task: the loss falls (the old meaning,
    counting step() calls, stepped every other call on 4 summed passes and diverged)."""
    torch.manual_seed(0)
    centers = torch.randn(4, 8) * 2
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), model,
                               COMM, backward_passes_per_step=2)
    opt.broadcast_parameters()

    def batch(step, micro):
        g = torch.Generator().manual_seed(7919 * step + 31 * RANK + micro)
        y = torch.randint(0, 4, (16,), generator=g)
        return centers[y] + torch.randn(16, 8, generator=g), y

    losses = []
    for step in range(40):
        opt.zero_grad()
        total = 0.0
        for micro in range(2):
            x, y = batch(step, micro)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total / 2)
    opt.close()
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert opt.steps == 40


@needs2
@pytest.mark.parametrize("unscale,overlap", [(True, False), (False, False), (True, True)])
def test_grad_scaler_skips_or_steps_every_rank_alike_as_torch_on_the_average(pair, unscale,
                                                                             overlap):
    """``torch.amp.GradScaler`` in Horovod's pattern (``synchronize``, ``unscale_`` or not,
    ``scaler.step`` inside ``skip_synchronize``): an inf in rank 1's batch at step 1 makes every
    rank skip that step and halve its scale; parameters, momentum and scales bitwise those of a
    one-process torch reference that runs the scaler on the averaged gradient (DDP's meaning).
    ``scaler.step(opt)`` on gradients not averaged yet is a one-line error on every rank."""
    if pair is None:
        return
    rank, size = pair.Get_rank(), pair.Get_size()
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    opt = DistributedOptimizer(_make_opt("sgd", model.parameters()), model, pair,
                               overlap=overlap, bucket_bytes=256)
    ref_opt = _make_opt("sgd", ref.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)

    def batch(step, r):
        x, y = _data(step, r)
        return (x * float("inf") if (step, r) == (1, 1) else x), y

    scales, stepped = [], []
    for step in range(6):
        x, y = batch(step, rank)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        if unscale:
            scaler.unscale_(opt)
        before = opt.steps
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        stepped.append(opt.steps > before)
        grads = []                                  # the reference: the scaler on the average
        for r in range(size):
            ref.zero_grad(set_to_none=True)
            xr, yr = batch(step, r)
            ref_scaler.scale(F.cross_entropy(ref(xr), yr)).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for k, p in enumerate(ref.parameters()):
            p.grad = (grads[0][k] + grads[1][k]) / size
        if unscale:
            ref_scaler.unscale_(ref_opt)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        assert scales[-1] == ref_scaler.get_scale(), (step, scales, ref_scaler.get_scale())
    assert stepped == [True, False, True, True, True, True], stepped
    assert scales[:3] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9] and scales[3] == 2.0 ** 10, scales
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{name} differs from torch: max |d| {(p - q).abs().max():.3g}"
    _state_equal(opt, list(model.named_parameters()), ref_opt, list(ref.parameters()))
    assert pair.allgather(scales) == [scales] * size

    x, y = _data(9, rank)                           # the plain pattern: one line, every rank
    opt.zero_grad()
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    with pytest.raises(ConfigError, match=r"GradScaler.step\(opt\) on gradients not averaged"):
        scaler.step(opt)
    before = opt.steps
    opt.step()                                      # a plain step after it: no scaler left over
    assert opt.steps == before + 1
    opt.close()
