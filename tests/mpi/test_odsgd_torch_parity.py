"""OD-SGD with torch's param groups and frozen parameters (issue 21 items 2, 3, 9), mpiexec -n 2+.

Parameters with ``requires_grad=False``, outside the SGD, or in a group with lr 0 stay bitwise
unchanged (global and local weights, momentum, mean square) through warm-up and OD rounds; a
two-group SGD ("no weight decay on biases") gives torch's SGD in warm-up (bitwise at a power-of-two
size) and the per-group local step after it; a scheduler on the ODSGD object drives every group;
the short-run warning.
"""
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpcasync
from hpcasync.odsgd import ODSGD
from tests.mpi_util import COMM, RANK, SIZE

pytestmark = pytest.mark.skipif(SIZE < 2, reason="OD-SGD rounds need 2+ ranks")
B = 8
EXACT = SIZE & (SIZE - 1) == 0      # averaging equal gradients is exact at 2, 4, ... ranks


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(6, 8)
        self.outside = nn.Linear(8, 8)
        self.still = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = torch.tanh(self.outside(torch.tanh(self.frozen(x))))
        return self.head(torch.tanh(self.still(x)))


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(B, 6, generator=g), torch.randint(0, 3, (B,), generator=g)


def train(opt, model, steps, *, same_data=False, sched=None):
    for s in range(steps):
        x, y = batch(s, 0 if same_data else RANK)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()


def slices(opt, names):
    """(offset, numel) of the named parameters in the flat vector."""
    return [(o, int(torch.Size(s).numel())) for n, o, s in
            zip(opt.flat.names, opt.flat.offsets, opt.flat.shapes) if n.split(".")[0] in names]


@pytest.mark.parametrize("local_opt", ["sgd", "dc-adaptive"])
def test_untouched_parameters_stay_bitwise(local_opt):
    torch.manual_seed(5 + RANK)                     # the broadcast makes them equal
    model = Net()
    model.frozen.requires_grad_(False)
    sgd = torch.optim.SGD([
        {"params": list(model.frozen.parameters()) + list(model.head.parameters())},
        {"params": model.still.parameters(), "lr": 0.0},
    ], lr=0.1, momentum=0.9, weight_decay=1e-2)
    opt = hpcasync.optimizer("odsgd", model, sgd, warmup_iters=3, local_opt=local_opt)
    held = ("frozen", "outside", "still")
    before = {n: p.detach().clone() for n, p in model.named_parameters()
              if n.split(".")[0] in held}
    head0 = model.head.weight.detach().clone()
    train(opt, model, 9)                            # 3 warm-up steps, then OD rounds

    def check(where):
        moved = [n for n, p in model.named_parameters() if n in before
                 and not torch.equal(p, before[n])]
        assert not moved, f"{where}: moved {moved}"
    check("local weights")
    with opt.global_weights():
        check("global weights")
    ws, glob = opt.worker.ws, opt.worker.glob
    for o, n in slices(opt, held):
        assert not glob.buf[o:o + n].any(), "momentum of a held parameter"
        if ws.ms is not None:
            assert not ws.ms[o:o + n].any(), "mean square of a held parameter"
    opt.finish()
    check("after finish")
    assert not torch.equal(model.head.weight, head0)


def two_groups(seed=11):
    torch.manual_seed(seed)
    net = Net()
    decay = [p for p in net.parameters() if p.dim() > 1]
    no_decay = [p for p in net.parameters() if p.dim() <= 1]
    sgd = torch.optim.SGD([{"params": decay, "weight_decay": 5e-2},
                           {"params": no_decay, "weight_decay": 0.0, "lr": 0.05,
                            "momentum": 0.5}], lr=0.2, momentum=0.9)
    return net, sgd


def assert_same(model, ref):
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if EXACT:
            assert torch.equal(p, q), n
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_two_groups_warmup_is_torch_sgd_with_a_scheduler():
    """Warm-up rounds are SSGD with each group's lr, momentum and weight decay; a scheduler on
    the ODSGD object scales every group's lr, as on the SGD."""
    model, sgd = two_groups()
    opt = hpcasync.optimizer("odsgd", model, sgd, warmup_iters=100)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref, ref_sgd = two_groups()
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_sgd, lambda s: 1.0 / (1 + s))
    train(opt, model, 5, same_data=True, sched=sched)
    train(ref_sgd, ref, 5, same_data=True, sched=ref_sched)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_sgd.param_groups]
    assert_same(model, ref)
    opt.finish()


def test_two_groups_local_step_uses_each_groups_values():
    """First OD round (local_opt sgd): W^l = W_t − η_l·(g/N + wd·W_t) with each group's wd and
    its own lr_local."""
    model, sgd = two_groups()
    opt = hpcasync.optimizer("odsgd", model, sgd, warmup_iters=1, local_opt="sgd",
                             lr_local=0.5)
    opt.param_groups[1]["lr_local"] = 0.25
    train(opt, model, 1)                           # warm-up: W_1
    W1 = [p.detach().clone() for p in model.parameters()]
    x, y = batch(1, RANK)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()                                     # round 1 in flight; params = W^l_2
    for (n, p), w, g in zip(model.named_parameters(), W1, grads):
        wd, lr_local = (5e-2, 0.5) if p.dim() > 1 else (0.0, 0.25)
        torch.testing.assert_close(p.detach(), w - lr_local * (g / SIZE + wd * w),
                                   rtol=1e-6, atol=1e-7, msg=n)
    opt.finish()


def test_short_run_warns_on_rank_0(caplog):
    model, sgd = two_groups()
    with caplog.at_level(logging.WARNING, logger="hpcasync"):
        opt = hpcasync.optimizer("odsgd", model, sgd, epochs=2, steps_per_epoch=93)
        opt.finish()
        ok = hpcasync.optimizer("odsgd", model, torch.optim.SGD(model.parameters(), lr=0.1),
                                epochs=2, steps_per_epoch=93, warmup_iters=50)
        ok.finish()
    warned = [r.getMessage() for r in caplog.records if "warm-up" in r.getMessage()]
    if RANK == 0:
        assert len(warned) == 1 and "warmup_iters" in warned[0] and "186" in warned[0], warned
    else:
        assert not warned
