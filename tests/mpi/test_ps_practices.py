"""Everyday torch practices under the parameter-server algorithms and OD-SGD, against plain torch.

* A layer frozen before ``hpcasync.optimizer`` and unfrozen later is trained from then on (asgd
  with one worker and no momentum is torch's SGD, bitwise; smega2 on every worker: the layer is
  untouched while frozen and moves after), and the "got no gradient" warning stays silent (odsgd,
  daso, smega2, asgd).
* ``model.load_state_dict`` after ``hpcasync.optimizer`` (torch's usual resume order) is what
  trains; a worker-only change is one line; an in-place edit between two steps is one line.
* The torch SGD handed to ``hpcasync.optimizer`` and the returned object are one truth for the
  learning rate: lr 0 written into the SGD (or a scheduler built on it before wrapping) is honoured.
* Two PS optimizers in one job (a GAN) are served together (``hpcasync.serve``), never a hang.
* Integer buffers (``num_batches_tracked``, a counter of the user's) end equal on every rank and
  travel through a user-loop checkpoint.

Runs under ``mpiexec -n 4`` (rank 0 serves; the 1-worker tests use ranks 0 and 1). The models
live on ``HPCASYNC_TEST_DEVICE`` (default cpu; ``cuda`` on a GPU machine: the server's θ stays on
the host, so the one-worker comparison with torch's CUDA step is to float rounding there).
"""
from __future__ import annotations

import logging
import os
import time

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import hpcasync
from hpcasync.errors import ConfigError
from tests.mpi_util import COMM, RANK, SIZE

pytestmark = pytest.mark.skipif(SIZE < 3, reason="needs a server and 2+ workers")
W = SIZE - 1
DEVICE = os.environ.get("HPCASYNC_TEST_DEVICE", "cpu")


class Net(nn.Module):
    """A small conv net with BatchNorm and an integer counter the loop updates by hand."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 6 * 6, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.to(DEVICE)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return self.head(h.flatten(1))


def batch(step: int, worker: int = 0):
    g = torch.Generator().manual_seed(100 * worker + step)
    return (torch.randn(8, 1, 8, 8, generator=g).to(DEVICE),
            torch.randint(0, 3, (8,), generator=g).to(DEVICE))


def one_step(opt, model, x, y):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    model.seen += 1


def pair_comm():
    """Ranks 0 (server) and 1 (the one worker); None elsewhere."""
    comm = COMM.Split(0 if RANK < 2 else MPI.UNDEFINED, RANK)
    return None if comm == MPI.COMM_NULL else comm


def no_gradient_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "got no gradient" in r.getMessage()]


# -- 1. a layer unfrozen mid-training --------------------------------------------------------------

STEPS, UNFREEZE = 6, 3


def freeze(model, frozen: bool = True) -> None:
    """conv1 and bn1 (``requires_grad=not frozen``)."""
    model.conv1.requires_grad_(not frozen)
    model.bn1.requires_grad_(not frozen)


def torch_reference(lr: float) -> dict:
    model = Net()
    freeze(model)
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    for s in range(STEPS):
        if s == UNFREEZE:
            freeze(model, False)
        x, y = batch(s)
        sgd.zero_grad()
        F.cross_entropy(model(x), y).backward()
        sgd.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_unfrozen_layer_trains_as_in_torch_with_one_worker(caplog):
    """asgd, one worker, no momentum: torch's SGD step by step, bitwise, the unfreezing included."""
    comm = pair_comm()
    if comm is None:
        return
    model = Net()
    freeze(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="hpcasync"):
        opt = hpcasync.optimizer("asgd", model, sgd, comm=comm, ps_rank=0, ps_ranks=1)
        if opt.is_server:
            opt.serve()
        else:
            for s in range(STEPS):
                if s == UNFREEZE:
                    freeze(model, False)
                x, y = batch(s)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            opt.finish()
    assert no_gradient_warnings(caplog) == []
    ref = torch_reference(0.1)
    for name, p in model.named_parameters():
        if DEVICE == "cpu":
            assert torch.equal(p.detach(), ref[name]), name
        else:                     # θ updated on the host, torch's step on the device
            torch.testing.assert_close(p.detach(), ref[name], rtol=1e-5, atol=1e-6)
    comm.Free()


@pytest.mark.parametrize("late", [False, True])
def test_ssgd_unfrozen_layer_is_bitwise_torch(late):
    """Every rank trains the same batches: SSGD's average is the one gradient, so torch's SGD
    step for step, bitwise; ``late``: unfrozen after ``zero_grad()``, so no gradient hook was on
    it during that backward."""
    model = Net()
    freeze(model)
    opt = hpcasync.optimizer("ssgd", model, torch.optim.SGD(model.parameters(), lr=0.1))
    for s in range(STEPS):
        if s == UNFREEZE and not late:
            freeze(model, False)
        x, y = batch(s)
        opt.zero_grad()
        if s == UNFREEZE and late:
            freeze(model, False)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    ref = torch_reference(0.1)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ref[name]), name


@pytest.mark.parametrize("algorithm", ["smega2", "asgd", "odsgd", "daso"])
def test_unfrozen_layer_trains_and_no_false_warning(algorithm, caplog):
    model = Net()
    model.conv1.requires_grad_(False)
    start = model.conv1.weight.detach().clone()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hyper = {"daso": {"epochs": 1, "steps_per_epoch": STEPS},
             "odsgd": {"warmup_iters": 2}}.get(algorithm, {"warmup_epochs": 0})
    server = algorithm in ("smega2", "asgd") and RANK == 0
    trainers = COMM.Split(MPI.UNDEFINED if server else 0, RANK)
    with caplog.at_level(logging.WARNING, logger="hpcasync"):
        opt = hpcasync.optimizer(algorithm, model, sgd, **hyper)
        if server:
            opt.serve()
        else:
            for s in range(STEPS):
                if s == UNFREEZE:               # every trainer here: what all pushed was frozen
                    trainers.Barrier()
                    assert torch.equal(model.conv1.weight.detach(), start)    # frozen: untouched
                    trainers.Barrier()
                    model.conv1.requires_grad_(True)
                x, y = batch(s, RANK)
                one_step(opt, model, x, y)
            if hasattr(opt, "finish"):
                opt.finish()
            trainers.Free()
    assert no_gradient_warnings(caplog) == []
    assert not torch.equal(model.conv1.weight.detach(), start)              # unfrozen: trained


# -- 2. the model changed after hpcasync.optimizer -------------------------------------------------

@pytest.mark.parametrize("algorithm", ["smega2", "asgd"])
def test_load_state_dict_after_the_optimizer_is_what_trains(algorithm):
    """torch's resume order: model, optimizer, then model.load_state_dict on every rank. The
    workers start from the loaded weights (the server takes its model at serve())."""
    ckpt = {k: v + 0.5 if v.is_floating_point() else v for k, v in Net(seed=7).state_dict().items()}
    model = Net()
    opt = hpcasync.optimizer(algorithm, model, torch.optim.SGD(model.parameters(), lr=0.05,
                                                               momentum=0.9), warmup_epochs=0)
    model.load_state_dict(ckpt)
    if opt.is_server:
        opt.serve()
    else:
        opt.start()                                   # the first reply: the server's θ
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), ckpt[name]), name
        one_step(opt, model, *batch(0, RANK))
        opt.finish()


def test_a_change_on_the_workers_only_is_one_line():
    model = Net()
    opt = hpcasync.optimizer("asgd", model, torch.optim.SGD(model.parameters(), lr=0.05))
    if opt.is_server:
        opt.serve()
        return
    with torch.no_grad():
        model.head.bias.add_(1.0)                     # not on the server
    with pytest.raises(ConfigError, match="changed after hpcasync.optimizer.*server"):
        opt.start()
    opt.finish()


@pytest.mark.parametrize("algorithm", ["asgd", "smega2"])
def test_an_in_place_edit_between_steps_is_one_line(algorithm):
    model = Net()
    opt = hpcasync.optimizer(algorithm, model, torch.optim.SGD(model.parameters(), lr=0.05,
                                                               momentum=0.9), warmup_epochs=0)
    if opt.is_server:
        opt.serve()
        return
    one_step(opt, model, *batch(0, RANK))
    with torch.no_grad():
        model.head.weight.clamp_(-0.01, 0.01)         # a max-norm style edit after step()
    with pytest.raises(ConfigError, match="changed in place between two steps"):
        one_step(opt, model, *batch(1, RANK))
    opt.finish()


# -- 4. one truth for the learning rate ------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ["asgd", "smega2", "odsgd"])
def test_lr_written_into_the_users_sgd_is_honoured(algorithm):
    """lr 0 written into the SGD after wrapping (a hand-written warm-up's first value): nothing
    moves, on any rank, as in torch."""
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hyper = {"warmup_iters": 1} if algorithm == "odsgd" else {"warmup_epochs": 0}
    opt = hpcasync.optimizer(algorithm, model, sgd, **hyper)
    assert opt.param_groups is sgd.param_groups
    for g in sgd.param_groups:
        g["lr"] = 0.0
        if algorithm == "odsgd":
            g["lr_local"] = 0.0
    start = [p.detach().clone() for p in model.parameters()]
    if getattr(opt, "is_server", False):
        opt.serve()
    else:
        for s in range(4):
            one_step(opt, model, *batch(s, RANK))
        opt.finish()
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), start))


def test_scheduler_built_on_the_sgd_before_wrapping_drives_the_server():
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 0.5 ** step)   # the usual order
    opt = hpcasync.optimizer("asgd", model, sgd)
    if opt.is_server:
        lrs = []
        opt.serve(on_push=lambda w, tau, loss: lrs.append(opt.rule.lr))
        assert sorted(set(lrs)) == pytest.approx([0.025, 0.05, 0.1])
    else:
        for s in range(3):
            one_step(opt, model, *batch(s, RANK))
            sched.step()
        opt.finish()


def test_a_keyword_beside_the_sgd_is_written_into_it():
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hpcasync.optimizer("asgd", model, sgd, lr=0.02)
    assert sgd.param_groups[0]["lr"] == opt.lr() == 0.02
    if opt.is_server:
        opt.serve()
    else:
        opt.finish()


@pytest.mark.parametrize("epochs, warmup", [(2, None), (6, None)])
def test_a_warm_up_longer_than_the_run_is_said_where_the_rule_is_described(epochs, warmup):
    """The server describes its rule at construction; a warm-up (SMEGA2's paper schedule, 5
    epochs) longer than the run's epochs says where the lr ends (lr/W rising linearly)."""
    said = (f"over 5 epochs (warmup_epochs, longer than the run's 2 epoch(s): the lr ends at "
            f"{1 / W + (1 - 1 / W) * 2 / 5:.0%} of its full value)" if epochs == 2 else
            "over 5 epochs (warmup_epochs);")
    model = Net()
    opt = hpcasync.optimizer("smega2", model, lr=0.1, momentum=0.9, steps_per_epoch=1,
                             epochs=epochs, warmup_epochs=warmup)
    assert said in opt.describe(), opt.describe()
    if opt.is_server:
        opt.serve()
    else:
        opt.finish()


def test_a_rennala_batch_beyond_the_run_is_refused_on_every_rank_before_any_collective():
    """Rennala steps once per B fresh pushes; with fewer pushes in the whole run (W workers ×
    steps_per_epoch × epochs) θ would never move: a one-line ConfigError on every rank from the
    constructor (no collective made: the job goes on to the next test)."""
    pushes = W * 3 * 2
    with pytest.raises(ConfigError, match=f"more than the run's {pushes} pushes in all"):
        hpcasync.optimizer("rennala", Net(), lr=0.1, batch=pushes + 1, steps_per_epoch=3,
                           epochs=2)
    opt = hpcasync.optimizer("rennala", Net(), lr=0.1, batch=pushes, steps_per_epoch=3, epochs=2)
    if opt.is_server:
        opt.serve()
    else:
        opt.finish()


def test_maximize_is_refused_by_the_ps():
    model = Net()
    with pytest.raises(ConfigError, match="maximize"):
        hpcasync.optimizer("asgd", model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                          maximize=True))


# -- 5. several PS optimizers in one job; integer buffers ------------------------------------------

class Gen(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6)).to(DEVICE)

    def forward(self, z):
        return self.net(z)


class Disc(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)).to(DEVICE)

    def forward(self, x):
        return self.net(x)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["asgd", "smega2"])
def test_a_gan_with_two_ps_optimizers_is_served_together(algorithm):
    gen, disc = Gen(), Disc()
    hyper = {"warmup_epochs": 0}
    opt_d = hpcasync.optimizer(algorithm, disc, torch.optim.SGD(disc.parameters(), lr=0.01,
                                                                momentum=0.5), **hyper)
    opt_g = hpcasync.optimizer(algorithm, gen, torch.optim.SGD(gen.parameters(), lr=0.01,
                                                               momentum=0.5), **hyper)
    steps = 5
    t0 = time.monotonic()
    if opt_d.is_server:
        with pytest.raises(ConfigError, match="hpcasync.serve"):
            opt_d.serve()                                  # one at a time would hang: refused
        hpcasync.serve(opt_d, opt_g)
        assert opt_d.rule.version == opt_g.rule.version == W * steps
    else:
        g = torch.Generator().manual_seed(RANK)
        for _ in range(steps):
            real = torch.randn(16, 6, generator=g).to(DEVICE) + 2.0
            fake = gen(torch.randn(16, 4, generator=g).to(DEVICE))
            opt_d.zero_grad()
            d_loss = (F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean())
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            F.softplus(-disc(fake)).mean().backward()
            opt_g.step()
        opt_d.finish()
        opt_g.finish()
    assert time.monotonic() - t0 < 45
    for m in (gen, disc):                                  # every rank: the servers' final θ
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).cpu()
        assert all(torch.equal(flat, other) for other in COMM.allgather(flat))


@pytest.mark.parametrize("algorithm", ["asgd", "smega2"])
def test_integer_buffers_end_equal_and_travel_through_a_checkpoint(algorithm, tmp_path):
    directory = COMM.bcast(str(tmp_path / "ck") if RANK == 0 else None, root=0)
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hpcasync.optimizer(algorithm, model, sgd, warmup_epochs=0)
    steps = {w: 3 + w for w in range(W)}                   # uneven: counters differ per worker
    if opt.is_server:
        opt.serve()
    else:
        for s in range(steps[opt.worker]):
            one_step(opt, model, *batch(s, RANK))
        hpcasync.save_checkpoint(directory, model, opt, epoch=1)
        mine = (int(model.seen), int(model.bn1.num_batches_tracked))
        assert mine == (steps[opt.worker],) * 2
        opt.finish()
    mean = sum(steps.values()) // W
    assert int(model.seen) == int(model.bn1.num_batches_tracked) == mean    # every rank
    COMM.Barrier()
    fresh = Net()
    opt2 = hpcasync.optimizer(algorithm, fresh, torch.optim.SGD(fresh.parameters(), lr=0.05,
                                                                momentum=0.9), warmup_epochs=0)
    hpcasync.load_checkpoint(directory, fresh, opt2)
    if opt2.is_server:
        assert int(fresh.seen) == mean                     # the checkpoint's model: the mean
        opt2.serve()
    else:
        assert int(fresh.seen) == int(fresh.bn1.num_batches_tracked) == steps[opt2.worker]
        opt2.finish()


# -- 7. a clip between backward() and step() under SSGD --------------------------------------------

@pytest.mark.parametrize("how", ["clip", "synchronized", "none", "none-overlap"])
def test_ssgd_says_once_when_a_clip_acts_on_local_gradients(how, caplog):
    model = Net()
    opt = hpcasync.optimizer("ssgd", model, torch.optim.SGD(model.parameters(), lr=0.1),
                             overlap=how == "none-overlap")
    with caplog.at_level(logging.WARNING, logger="hpcasync"):
        for s in range(3):
            x, y = batch(s, RANK)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if how == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                opt.step()
            elif how == "synchronized":
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
    said = [r.getMessage() for r in caplog.records if "clip_grad_norm_" in r.getMessage()]
    assert len(said) == (how == "clip" and RANK == 0), said
