"""``localsgd`` equals torch's post-local SGD (issue 32): ``PostLocalSGDOptimizer`` with a
``PeriodicModelAverager(period, warmup_steps)`` over DDP with ``post_localSGD_hook``
(``start_localSGD_iter = warmup_steps``, no gradient allreduce after it), on a Gloo group over the
same ranks, the same model, data and optimizer. Two ranks: the parameters bitwise equal after every
step; four: to 1e-6 relative (the sums' order is MPI's and Gloo's own).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpcasync
from hpcasync.errors import ConfigError
from hpcasync.ssgd import LocalSGD
from tests.mpi_util import COMM, RANK, SIZE, identical_everywhere

needs2 = pytest.mark.skipif(SIZE < 2, reason="needs 2 MPI ranks")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def _side_by_side(comm, steps: int, period: int, warmup: int, make_opt):
    """Yield (step, ours, torch's) parameters after each step of both, trained alike."""
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    base = _model()
    ref, ours = copy.deepcopy(base), copy.deepcopy(base)
    ddp = DDP(ref)
    ddp.register_comm_hook(hook.PostLocalSGDState(None, None, warmup,
                                                  post_local_gradient_allreduce=False),
                           hook.post_localSGD_hook)
    ref_opt = PostLocalSGDOptimizer(make_opt(ref.parameters()),
                                    PeriodicModelAverager(period=period, warmup_steps=warmup))
    opt = LocalSGD(make_opt(ours.parameters()), ours, comm, period=period, warmup_steps=warmup)
    for step in range(steps):
        x, y = _batch(step, comm.Get_rank())
        ref_opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        F.cross_entropy(ours(x), y).backward()
        opt.step()
        yield step, opt, list(ours.parameters()), list(ref.parameters())


OPTS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p, lr=0.01)}


@needs2
@pytest.mark.parametrize("gloo", [2], indirect=True)
@pytest.mark.parametrize("period,warmup,kind", [(3, 4, "sgd"), (4, 0, "adam"), (1, 2, "sgd")])
def test_two_ranks_equal_torchs_post_local_sgd_bitwise_at_every_step(gloo, period, warmup, kind):
    if gloo is None:
        return
    with pytest.warns(UserWarning) if period == 1 else _nothing():
        seen = list(_side_by_side(gloo, 12, period, warmup, OPTS[kind]))
    for step, opt, ours, ref in seen:
        bad = [i for i, (a, b) in enumerate(zip(ours, ref)) if not torch.equal(a, b)]
        assert not bad, f"step {step}: parameters {bad} differ from torch's post-local SGD"
    opt = seen[-1][1]
    assert opt.averages == len([k for k in range(warmup, 12) if (k - warmup) % period == 0])


@pytest.mark.skipif(SIZE < 4, reason="needs 4 MPI ranks")
@pytest.mark.parametrize("gloo", [4], indirect=True)
def test_four_ranks_equal_torchs_post_local_sgd_to_1e_6(gloo):
    worst, differed = 0.0, False
    for step, opt, ours, ref in _side_by_side(gloo, 12, 3, 2, OPTS["sgd"]):
        for a, b in zip(ours, ref):
            worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
        if not opt.replicas_equal:
            differed |= not identical_everywhere(nn.ParameterList(ours))
    assert worst < 1e-6, f"largest relative difference from torch's {worst:.3g}"
    assert differed                   # between averages the replicas did drift apart


def _train(model, opt, steps):
    for step in steps:
        x, y = _batch(step, RANK)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def test_replicas_are_equal_after_each_average_and_a_checkpoint_between_keeps_every_replica(
        tmp_path):
    """hpcasync.save_checkpoint between two averages keeps each rank's replica and momentum
    (per_rank): a job that loads it goes on bitwise as the one that wrote it."""
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hpcasync.optimizer("localsgd", model, sgd, period=3, warmup_steps=2)
    assert isinstance(opt, LocalSGD)
    path = str(COMM.bcast(str(tmp_path)))
    for step in range(8):
        _train(model, opt, [step])
        assert opt.replicas_equal == (step < 2 or (step - 2) % 3 == 0)
        if opt.replicas_equal:
            assert identical_everywhere(model)
    assert not opt.replicas_equal                       # step 7: one local step after step 6's
    assert not identical_everywhere(model)
    hpcasync.save_checkpoint(path + "/ck", model, opt, epoch=1, step=8)
    _train(model, opt, range(8, 12))                    # averages at steps 8 and 11 (0-based)
    after = [p.detach().clone() for p in model.parameters()]

    model2 = _model()
    opt2 = hpcasync.optimizer("localsgd", model2,
                              torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9),
                              period=3, warmup_steps=2)
    assert hpcasync.load_checkpoint(path + "/ck", model2, opt2)["step"] == 8
    assert not opt2.replicas_equal
    _train(model2, opt2, range(8, 12))
    assert all(torch.equal(a, b) for a, b in zip(after, model2.parameters()))   # bitwise, per rank
    opt.average_parameters()
    assert opt.replicas_equal and identical_everywhere(model)
    assert opt.bytes_sent > 0
    state = opt.state_dict()["hpcasync"]
    assert (state["steps"], state["averages"], state["equal_since"]) == (12, 5, 12)


class _TwoHeads(nn.Module):
    """A model with a head one forward leaves out (no gradient in that step)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = nn.Linear(64, 32), nn.Linear(32, 10), nn.Linear(32, 10)

    def forward(self, x, head):
        return getattr(self, head)(torch.tanh(self.body(x.flatten(1))))


def test_a_local_step_is_the_wrapped_optimizers_step_bitwise():
    """Between two averages each step is torch's own, bitwise: a parameter without a gradient
    keeps None and is skipped (no momentum made for it), two backward passes add up, and
    zero_grad(set_to_none=False) keeps zeros (then the step moves it by momentum, as torch)."""
    ours_m, ref_m = _TwoHeads(), _TwoHeads()
    make = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3))
    ref = make(ref_m.parameters())
    opt = LocalSGD(make(ours_m.parameters()), ours_m, COMM, period=10**6, warmup_steps=0)
    x, y = _batch(99, RANK)             # step 0 (the average after it), then torch's from there
    opt.zero_grad()
    F.cross_entropy(ours_m(x, "a"), y).backward()
    opt.step()
    assert opt.averages == 1
    ref_m.load_state_dict(ours_m.state_dict())
    ref.load_state_dict(copy.deepcopy(opt.optimizer.state_dict()))     # (not shared buffers)
    plan = [("a", True, 1), ("a", True, 2), ("b", True, 1), ("a", False, 1), ("b", True, 1)]
    for step, (head, none, passes) in enumerate(plan):
        for o, m in ((opt, ours_m), (ref, ref_m)):
            o.zero_grad(set_to_none=none)
            for k in range(passes):
                x, y = _batch(10 * step + k, RANK)
                F.cross_entropy(m(x, head), y).backward()
            o.step()
        for (name, p), q in zip(ours_m.named_parameters(), ref_m.parameters()):
            assert torch.equal(p, q), f"step {step}: {name} differs from torch's"
        assert [(p.grad is None) for p in ours_m.parameters()] == \
            [(q.grad is None) for q in ref_m.parameters()]
    assert len(opt.state) == len(ref.state)            # no momentum for a head never stepped
    assert opt.averages == 1 and opt.steps == 1 + len(plan)


def test_bad_options_are_one_line_errors():
    model = _model()
    for kw, said in ((dict(period=0), "period must be an integer >= 1"),
                     (dict(warmup_steps=-1), "warmup_steps must be an integer >= 0")):
        with pytest.raises(ConfigError, match=said):
            LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, COMM, **kw)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("algorithm, keywords, steps, said", [
    ("localsgd", {"period": 4, "warmup_steps": 100}, 23,
     "localsgd: the run's 23 steps per rank are all inside the 100 SSGD warm-up steps"),
    ("localsgd", {"period": 30, "warmup_steps": 5}, 23,
     "localsgd: period 30 (--localsgd-period) is more than the run's 18 local steps per rank"),
    ("slowmo", {"period": 48}, 23,
     "slowmo: period 48 (--slowmo-period) is more than the run's 23 local steps per rank"),
    ("ssgd", {"compress": hpcasync.PowerSGD(rank=1)}, 23,
     "PowerSGD: the run's 23 steps per rank are all inside its 1000 plain steps first"),
    ("localsgd", {"period": 4, "warmup_steps": 5}, 23, None),
    ("ssgd", {"compress": hpcasync.PowerSGD(rank=1, start_iter=2)}, 23, None),
])
def test_a_run_its_schedule_never_completes_is_said_once_on_rank_0(caplog, algorithm, keywords,
                                                                   steps, said):
    """The CLI's check before training (``runtime.driver.run`` calls ``check_run_length`` with
    epochs x batches per rank), as DASO and OD-SGD say theirs: a warm-up or a plain start that
    covers the run, a period longer than the local phase. Rank 0 only; nothing when the
    schedule completes."""
    model = _model()
    opt = hpcasync.optimizer(algorithm, model, torch.optim.SGD(model.parameters(), lr=0.1),
                             comm=COMM, **keywords)
    with caplog.at_level("WARNING", logger="hpcasync"):
        opt.check_run_length(steps)
    got = [r.getMessage() for r in caplog.records if r.name == "hpcasync"]
    if said is None or RANK != 0:
        assert got == []
    else:
        assert len(got) == 1 and got[0].startswith(said), got
