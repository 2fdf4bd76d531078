"""DASO leaves alone what torch leaves alone (issue 21 items 2 and 3), under mpiexec -n 2..4.

Virtual nodes: one rank per node (P = size) at 2 or 3 ranks, 2 x 2 at 4 ranks, so the global
phase (bf16 sends, merges, the epoch-end average) always runs. Parameters with
``requires_grad=False``, outside the optimizer, or in a param group with lr 0 stay bitwise
unchanged through cycling epochs; replicas stay identical at every epoch end; a two-group "no weight
decay on biases and norms" SGD in blocking epochs is plain torch on the same gradient.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpcasync.comm import FlatModel
from hpcasync.daso import DASO
from tests.mpi_util import COMM, RANK, SIZE

pytestmark = pytest.mark.skipif(SIZE < 2, reason="DASO's global phase needs 2+ ranks")
B, NBATCH = 8, 6


@pytest.fixture(scope="module")
def topo():
    from hpcasync.topology import Topology

    t = Topology.build(ranks_per_node=2 if SIZE % 2 == 0 and SIZE >= 4 else 1)
    assert t.num_nodes >= 2
    yield t
    t.free()


class Net(nn.Module):
    """frozen conv -> BatchNorm -> head, plus a layer outside the optimizer and one at lr 0."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Conv2d(1, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.outside = nn.Linear(3 * 6 * 6, 16)
        self.still = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = F.relu(self.bn(self.frozen(x))).flatten(1)
        return self.head(torch.tanh(self.still(torch.tanh(self.outside(x)))))


def batch(epoch, step, rank):
    g = torch.Generator().manual_seed(1000 * epoch + 10 * step + rank)
    return torch.randn(B, 1, 8, 8, generator=g), torch.randint(0, 4, (B,), generator=g)


def snapshot(model, names):
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if n.split(".")[0] in names}


def test_untouched_parameters_stay_bitwise_under_cycling_bf16(topo):
    torch.manual_seed(7 + RANK)                   # different inits: the broadcast makes them equal
    model = Net()
    model.frozen.requires_grad_(False)
    flat = FlatModel(model)
    sgd = torch.optim.SGD([
        {"params": list(model.frozen.parameters()) + list(model.head.parameters())},
        {"params": model.still.parameters(), "lr": 0.0},
    ], lr=0.1, momentum=0.9, weight_decay=1e-2)
    epochs = 3
    opt = DASO(sgd, flat, topo, total_epochs=epochs, batches_per_epoch=NBATCH, warmup_epochs=0,
               cooldown_epochs=0, global_skip=1, batches_to_wait=1, cast="bf16")
    opt.broadcast_parameters(root=0)
    held = ("frozen", "outside", "still")
    before = snapshot(model, held)
    head0 = model.head.weight.detach().clone()
    merges = 0
    for e in range(epochs):
        for s in range(NBATCH):
            x, y = batch(e, s, RANK)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            merges += opt.last_plan.receive_group == topo.local_rank
        opt.epoch_end(1.0)
        sums = COMM.allgather(opt.checksum())
        assert len(set(sums)) == 1, f"replicas differ after epoch {e + 1}"
        after = snapshot(model, held)
        moved = {n: (after[n] - v).abs().max().item() for n, v in before.items()
                 if not torch.equal(after[n], v)}
        assert not moved, f"epoch {e + 1}: untouched parameters moved: {moved}"
    assert merges > 0 and not torch.equal(model.head.weight, head0), "nothing was trained/merged"
    assert all(p.grad is not None for p in model.parameters())   # views again after the step


def test_frozen_parameter_gets_no_weight_decay_or_momentum(topo):
    """requires_grad=False inside a param group: torch skips it (p.grad is None), so weight decay
    and momentum never reach it — in blocking epochs too (gradient averages only)."""
    torch.manual_seed(3)
    model = Net()
    model.frozen.requires_grad_(False)
    flat = FlatModel(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    opt = DASO(sgd, flat, topo, total_epochs=1, batches_per_epoch=3, warmup_epochs=1,
               cooldown_epochs=0)
    opt.broadcast_parameters(root=0)
    w0 = model.frozen.weight.detach().clone()
    for s in range(3):
        x, y = batch(0, s, RANK)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.epoch_end(1.0)
    assert torch.equal(model.frozen.weight, w0)
    assert model.frozen.weight not in sgd.state or not sgd.state[model.frozen.weight]


def test_two_groups_no_decay_on_biases_and_norms_is_torch(topo):
    """Blocking epochs, the same batch on every rank: DASO's step is torch's SGD step with each
    group's lr and weight decay (bitwise at a power-of-two size, where averaging P equal
    gradients is exact)."""
    def build():
        torch.manual_seed(11)
        net = Net()
        decay = [p for n, p in net.named_parameters() if p.dim() > 1]
        no_decay = [p for n, p in net.named_parameters() if p.dim() <= 1]
        sgd = torch.optim.SGD([{"params": decay, "weight_decay": 5e-2},
                               {"params": no_decay, "weight_decay": 0.0, "lr": 0.05}],
                              lr=0.2, momentum=0.9)
        return net, sgd

    model, sgd = build()
    opt = DASO(sgd, FlatModel(model), topo, total_epochs=2, batches_per_epoch=4,
               warmup_epochs=2, cooldown_epochs=0)
    ref, ref_sgd = build()
    for e in range(2):
        for s in range(4):
            x, y = batch(e, s, 0)                  # the same batch everywhere
            for net, o in ((model, opt), (ref, ref_sgd)):
                o.zero_grad()
                F.cross_entropy(net(x), y).backward()
                o.step()
        opt.epoch_end(1.0)
    exact = SIZE & (SIZE - 1) == 0
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if exact:
            assert torch.equal(p, q), n
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
