"""SSGD with ``compress=PowerSGD(...)`` equals DDP's ``powerSGD_hook`` (issue 32, item 2).

The reference runs in the same job: torch's DDP over a Gloo process group on the same ranks, the
hook's state seeded as ours, the same model, data and torch SGD. Two ranks sum in one order
(a + b = b + a), so there the parameters after every step are bitwise equal; with four the
sum's order is MPI's and Gloo's own choice, and they agree to 1e-6 relative. Rank 1 and 4 (the
QR path), with and without error feedback and warm start.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpcasync.errors import ConfigError
from hpcasync.ssgd import DistributedOptimizer
from hpcasync.ssgd.powersgd import PowerSGD, orthonormalize_, worth_compressing
from tests.mpi_util import COMM, RANK, SIZE, identical_everywhere

needs2 = pytest.mark.skipif(SIZE < 2, reason="needs 2 MPI ranks")
#: 2 ranks: bitwise when this thread and Gloo's callback thread, where the hook computes, reduce
#: at the same OpenMP thread count (a fresh process: 0 difference in every case); after
#: ``torch.set_num_threads`` in this process (any earlier test, hpcasync.init) rank 1's
#: Gram-Schmidt norms round differently there (seen: 2e-7 relative on lenet's 120 x 256 matrix)
THREADS_RTOL = 1e-6


class Net(nn.Module):
    """LeNet-shaped: four matrices worth compressing at rank 4, one conv kernel (6 × 25) and the
    biases that are not."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 6, 5), nn.Conv2d(6, 16, 5)
        self.f1, self.f2, self.f3 = nn.Linear(256, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.f3(F.relu(self.f2(F.relu(self.f1(x.flatten(1))))))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)


def _side_by_side(comm, steps: int, **options):
    """Yield (step, ours, DDP's) parameters after each step of both, trained alike."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = Net()
    ref, ours = copy.deepcopy(base), copy.deepcopy(base)
    ddp = DDP(ref, bucket_cap_mb=25)
    state = hook.PowerSGDState(None, matrix_approximation_rank=options["rank"],
                               start_powerSGD_iter=options["start_iter"],
                               use_error_feedback=options["error_feedback"],
                               warm_start=options["warm_start"], random_seed=options["seed"])
    ddp.register_comm_hook(state, hook.powerSGD_hook)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), ours,
                               comm, compress=PowerSGD(**options))
    for step in range(steps):
        x, y = _batch(step, comm.Get_rank())
        ref_opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        F.cross_entropy(ours(x), y).backward()
        opt.step()
        yield step, opt, list(ours.parameters()), list(ref.parameters())


CASES = [dict(rank=1, error_feedback=True, warm_start=True),
         dict(rank=4, error_feedback=True, warm_start=True),
         dict(rank=1, error_feedback=False, warm_start=True),
         dict(rank=4, error_feedback=True, warm_start=False),
         dict(rank=2, error_feedback=False, warm_start=False)]


@needs2
@pytest.mark.parametrize("gloo", [2], indirect=True)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "r{rank}-ef{error_feedback:d}-ws{warm_start:d}"
                         .format(**c))
def test_two_ranks_equal_the_ddp_hook_at_every_step(gloo, case):
    if gloo is None:
        return
    compressed = 0
    for step, opt, ours, ref in _side_by_side(gloo, 8, start_iter=2, seed=3, **case):
        worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, ref))
        assert worst <= THREADS_RTOL, f"step {step}: {worst:.3g} from DDP's powerSGD_hook"
        compressed += opt.powersgd.sent_numel < opt.powersgd.dense_numel
    assert compressed == 6          # steps 2..7 compressed (start_iter=2)


@pytest.mark.skipif(SIZE < 4, reason="needs 4 MPI ranks")
@pytest.mark.parametrize("gloo", [4], indirect=True)
def test_four_ranks_equal_the_ddp_hook_to_1e_6(gloo):
    worst = 0.0
    for _, opt, ours, ref in _side_by_side(gloo, 8, rank=1, start_iter=2, seed=0,
                                           error_feedback=True, warm_start=True):
        for a, b in zip(ours, ref):
            worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    assert worst < 1e-6, f"largest relative difference from DDP's hook {worst:.3g}"
    assert identical_everywhere(nn.ParameterList(ours))


def _opt(model, **options):
    return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                COMM, compress=PowerSGD(start_iter=2, **options))


def _train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        x, y = _batch(step, RANK)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def test_sends_p_and_q_and_keeps_replicas_equal():
    torch.manual_seed(0)
    model = Net()
    opt = _opt(model, rank=4)
    opt.broadcast_parameters()
    _train(model, opt, 1)
    dense = opt.powersgd.sent_numel
    _train(model, opt, 2, first=1)
    mats = [p.view(p.shape[0], -1).shape for p in model.parameters() if p.dim() > 1]
    kept = [(n, m) for n, m in mats if worth_compressing(n, m, min(n, m, 4), 2.0)]
    plain = sum(p.numel() for p in model.parameters()) - sum(n * m for n, m in kept)
    n_params = len(list(model.parameters()))
    assert dense == sum(p.numel() for p in model.parameters()) + n_params
    assert opt.powersgd.sent_numel == plain + n_params + sum((n + m) * 4 for n, m in kept)
    assert len(kept) == 4                # c1's 6 × 25 kernel stays plain
    assert identical_everywhere(model)


def test_a_state_dict_replays_in_its_own_process_and_keeps_this_ranks_error_from_another():
    torch.manual_seed(0)
    model = Net()
    opt = _opt(model, rank=1)
    opt.broadcast_parameters()
    _train(model, opt, 4)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    _train(model, opt, 3, first=4)
    after = [p.clone() for p in model.parameters()]
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])           # a rollback in this process: the same run again
    _train(model, opt, 3, first=4)
    assert all(torch.equal(a, b) for a, b in zip(after, model.parameters()))
    # the sync after a death: rank 0's state, each rank's own error memory
    own = opt.powersgd.error.clone()
    root = COMM.bcast(opt.state_dict(), root=0)
    opt.load_state_dict(root)
    assert torch.equal(opt.powersgd.error, own)
    assert opt.powersgd.iter == 7 and opt.powersgd.order == COMM.bcast(opt.powersgd.order)
    assert torch.equal(opt.powersgd.q, COMM.bcast(opt.powersgd.q, root=0))


def test_bad_options_are_one_line_errors():
    with pytest.raises(ConfigError, match="start_iter must be > 1"):
        PowerSGD(start_iter=1)
    PowerSGD(start_iter=0, error_feedback=False, warm_start=False)
    with pytest.raises(ConfigError, match="rank must be an integer >= 1"):
        PowerSGD(rank=0)
    model = Net()
    with pytest.raises(ConfigError, match="overlap=True is not supported"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, COMM,
                             compress="powersgd", overlap=True)
    with pytest.raises(ConfigError, match="compress must be"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, COMM,
                             compress="powerSGD")


def test_orthonormalize_gives_orthonormal_columns_on_both_paths():
    g = torch.Generator().manual_seed(0)
    for r in (1, 2, 4):
        batch = torch.randn(3, 20, r, generator=g, dtype=torch.float64)
        orthonormalize_(batch)
        eye = torch.eye(r, dtype=torch.float64).expand(3, r, r)
        assert torch.allclose(batch.transpose(1, 2) @ batch, eye, atol=1e-12)
