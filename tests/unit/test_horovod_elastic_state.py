"""``hvd.elastic`` state objects in one process (no MPI): commit / restore / attribute access,
Horovod's semantics (horovod/common/elastic.py, horovod/torch/elastic/state.py)."""
from __future__ import annotations

import torch
from torch import nn

import hpcasync.horovod as hvd


def _setup():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def _train_step(model, opt):
    opt.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()


def test_restore_brings_back_the_last_commit_bitwise():
    model, opt = _setup()
    state = hvd.elastic.TorchState(model, opt, epoch=0, batch=0)
    assert (state.model, state.optimizer, state.epoch, state.batch) == (model, opt, 0, 0)
    _train_step(model, opt)
    state.batch = 1
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state[model.weight]["momentum_buffer"].clone()
    _train_step(model, opt)
    state.epoch, state.batch = 5, 7
    state.restore()
    assert (state.epoch, state.batch) == (0, 1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, committed[k]), k
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], momentum)


def test_restore_drops_the_gradients_of_the_interrupted_step():
    """A loop that zeroes after ``step()`` (or accumulates) holds gradients when a death
    interrupts it: after ``restore()`` none is left (as in a process started afresh from the
    commit), so the redone step is bitwise the step a fresh copy of the commit takes. Horovod's
    TorchState keeps them (they add to the redone backward's)."""
    model, opt = _setup()
    state = hvd.elastic.TorchState(model, opt)
    _train_step(model, opt)
    state.commit()
    fresh, fresh_opt = _setup()
    fresh.load_state_dict(model.state_dict())
    fresh_opt.load_state_dict(opt.state_dict())
    opt.zero_grad()
    model(2 * torch.ones(4, 3)).sum().backward()    # the interrupted step's backward
    state.restore()
    assert all(p.grad is None for p in model.parameters())
    for m, o in ((model, opt), (fresh, fresh_opt)):     # the redone step, zero_grad after it
        m(torch.ones(4, 3)).sum().backward()
        o.step()
        o.zero_grad()
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_restore_without_commit_goes_back_to_construction():
    model, opt = _setup()
    before = model.weight.detach().clone()
    state = hvd.elastic.TorchState(model, opt, epoch=3)
    _train_step(model, opt)
    state.epoch = 4
    state.restore()
    assert state.epoch == 3 and torch.equal(model.weight, before)
    assert opt.state_dict()["state"] == {}


def test_assigning_a_tracked_object_saves_it():
    """Horovod's TorchState.__setattr__: a new model given to the state is saved at once."""
    model, opt = _setup()
    state = hvd.elastic.TorchState(model, opt)
    other = nn.Linear(3, 2)
    state.model = other
    saved = other.weight.detach().clone()
    with torch.no_grad():
        other.weight.add_(1.0)
    state.restore()
    assert state.model is other and torch.equal(other.weight, saved)


def test_object_state_sync_takes_the_broadcast_value_and_callbacks_run_on_reset():
    seen, calls = [], []
    state = hvd.elastic.ObjectState(bcast_object=lambda obj: (seen.append(dict(obj)),
                                                              {"epoch": 9, "lr": obj["lr"]})[1],
                                    get_rank=lambda: 0, epoch=1, lr=0.5)
    state.epoch = 2
    state.commit()                  # check_host_updates: a no-op, no broadcast
    assert seen == []
    state.sync()
    assert seen == [{"epoch": 2, "lr": 0.5}] and (state.epoch, state.lr) == (9, 0.5)
    state.register_reset_callbacks([lambda: calls.append(1), lambda: calls.append(2)])
    state.on_reset()
    assert calls == [1, 2]


class _FailingStateDict(torch.optim.SGD):
    """An optimizer whose ``state_dict`` fails once when told to (as DASO's or OD-SGD's may
    while completing a message in flight to a dead rank)."""
    fail = False

    def state_dict(self):
        if self.fail:
            raise RuntimeError("a peer died")
        return super().state_dict()


def test_a_commit_that_fails_keeps_the_previous_commit_whole_and_is_not_counted():
    """The model's copy is taken before the optimizer's: a commit whose optimizer copy fails
    must not leave the new model beside the old optimizer state (all or nothing), nor count."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = _FailingStateDict(model.parameters(), lr=0.1, momentum=0.9)
    state = hvd.elastic.TorchState(model, opt, batch=0)
    _train_step(model, opt)
    state.batch = 1
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    assert state._commit_count == 1
    _train_step(model, opt)
    state.batch = 2
    opt.fail = True
    try:
        state.commit()
    except RuntimeError:
        pass
    opt.fail = False
    assert state._commit_count == 1
    state.restore()
    assert state.batch == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, committed[k]), k


def test_an_optimizer_stepping_tensors_no_model_of_the_state_holds_is_one_line():
    """The commit keeps an optimizer's state, not the tensors it steps: without their model a
    death would roll the momentum back and leave the parameters (a replacement's at its own
    initial values), silently. Measured before this check: SSGD on 4 ranks, grow-back, the
    example loop with ``State(optimizer=opt, sampler=...)``: exit 0 and the replacement's final
    parameters unlike the survivors'."""
    import pytest

    from hpcasync.errors import ConfigError

    model, opt = _setup()
    with pytest.raises(ConfigError, match=r"the optimizer 'optimizer' steps 2 tensor\(s\) that "
                                          "no model of the state holds"):
        hvd.elastic.TorchState(optimizer=opt, epoch=0)
    hvd.elastic.TorchState(net=model, optimizer=opt)            # a module under any keyword
    halves = nn.ModuleList([nn.Linear(3, 2), nn.Linear(2, 1)])
    both = torch.optim.SGD(halves.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="steps 2 tensor"):
        hvd.elastic.TorchState(first=halves[0], optimizer=both)
    hvd.elastic.TorchState(first=halves[0], second=halves[1], optimizer=both)


def test_a_scheduler_left_out_of_the_state_is_said_once(caplog, monkeypatch):
    """An LR scheduler built on the state's optimizer but not given to the state: after a
    death the optimizer's lr goes back to the commit's, the scheduler's count does not (its lr
    goes on from a later point, silently), so the first commit says it in one line. Given to
    the state (or built on the optimizer an algorithm wraps, and given), nothing is said."""
    import logging

    from hpcasync.runtime import elastic as core

    monkeypatch.setattr(hvd.elastic.TorchState, "default_rank", lambda self: 0)
    said = []
    for tracked in (False, True):
        monkeypatch.setattr(core.TorchState, "_said_scheduler", False)
        model, opt = _setup()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9 ** step)
        state = (hvd.elastic.TorchState(model, opt, scheduler=sched) if tracked
                 else hvd.elastic.TorchState(model, opt))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hpcasync"):
            for _ in range(2):
                _train_step(model, opt)
                sched.step()
                state.commit()
        said.append([r.getMessage() for r in caplog.records if "LR scheduler" in r.getMessage()])
        if tracked:         # the property the line is about: the count is rolled back with lr
            _train_step(model, opt)
            sched.step()
            state.restore()
            assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == 0.1 * 0.9 ** 2
    assert len(said[0]) == 1 and "'optimizer'" in said[0][0], said
    assert said[1] == [], said


def test_a_torch_sampler_or_loader_as_a_plain_value_is_one_line():
    """A torch ``DistributedSampler`` given to the state is a plain value, which ``sync()``
    broadcasts from rank 0: measured before this check, ``hpcasync.elastic.State(...,
    sampler=DistributedSampler(..., rank=r))`` on 4 ranks gave every rank rank 0's sampler (the
    same indices on all 4) at the first call of the elastic function, silently (the elastic
    sampler is tracked by its state dict, its rank kept: the tests of the elastic loops)."""
    import pytest
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from hpcasync.errors import ConfigError

    model, opt = _setup()
    with pytest.raises(ConfigError, match="'sampler' is a DistributedSampler"):
        hvd.elastic.TorchState(model, opt, sampler=DistributedSampler(range(8), 2, 1))
    with pytest.raises(ConfigError, match="'loader' is a DataLoader"):
        hvd.elastic.TorchState(model, opt, loader=DataLoader(range(8)))
    assert hvd.elastic.TorchState(model, opt, sampler=None, epoch=0).epoch == 0


def test_restore_brings_back_the_modules_modes_of_the_commit():
    """A death inside an evaluation (``model.eval()``, then a collective that fails) is redone
    from the commit, taken in training: ``restore()`` brings ``train()`` back (dropout on,
    BatchNorm updating its statistics), as it brings the parameters; Horovod's leaves the model
    in ``eval()`` for the redone training. A commit taken in ``eval()`` restores ``eval()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = hvd.elastic.TorchState(model, opt)
    _train_step(model, opt)
    state.commit()
    model.eval()                                    # the interrupted evaluation
    state.restore()
    assert all(m.training for m in model.modules())
    model[1].eval()
    state.commit()
    model.train()
    state.restore()
    assert [m.training for m in model.modules()] == [True, True, False, True]
