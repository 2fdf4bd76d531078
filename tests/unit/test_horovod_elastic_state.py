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
