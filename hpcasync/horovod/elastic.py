"""``hvd.elastic``: Horovod's elastic training API, surviving dead ranks under Open MPI's ULFM.

A Horovod elastic script runs with its import line changed, started as
``mpirun --with-ft ulfm -n N python script.py``; when a rank dies the survivors go on with N - 1::

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([lambda: print("now", hvd.size(), "ranks")])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, steps):
                ...; optimizer.step()
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0

    train(state)

As Horovod: a collective that meets a dead peer fails (``HorovodInternalError`` or ULFM's MPI
error) on every survivor, which restores its last commit; then the facade is reset on the
survivors (``MPI_Comm_shrink``), the reset callbacks run, the state is broadcast from the new rank
0 and ``train`` is called again. Without ULFM a death ends the job (fail-fast). Design and
differences from Horovod: docs/design/horovod-elastic.md.
"""
from __future__ import annotations

import copy
import functools
import logging
import math
import random

import torch

from . import agree as _agree
from . import basics as _basics
from . import collectives as _coll
from . import state as _st
from .agree import HorovodInternalError
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)

log = logging.getLogger("hpcasync")

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's: hosts were added or removed (never raised here: there is no host discovery)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


# -- state objects ---------------------------------------------------------------------------------

class State:
    """What survives a reset: ``commit()`` saves it in memory, ``restore()`` brings the last
    commit back, ``sync()`` makes every rank equal to rank 0 (Horovod's ``State``)."""

    def __init__(self, bcast_object=None, get_rank=None):
        self._bcast_object = bcast_object or broadcast_object
        self._rank = get_rank or _basics.rank
        self._reset_callbacks: list = []

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called (no arguments) after each reset, on the new, smaller world."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (in memory, local: no communication), then :meth:`check_host_updates`."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """A no-op: hpcasync has no host discovery (ranks only leave, by dying), so no
        ``HostsUpdatedInterrupt`` is ever raised and no broadcast is needed."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Plain Python values given as keywords, kept as attributes (``state.epoch``)."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {k: getattr(self, k) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for k, v in self._saved_state.items():
            setattr(self, k, v)


class _Handler:
    """Save / restore / sync of one object of a :class:`TorchState` (by its type)."""

    def __init__(self, value):
        self.value = value
        self.save()

    def set_value(self, value) -> None:
        self.value = value
        self.save()


class _ModelHandler(_Handler):
    def save(self):
        self.saved = {k: v.detach().clone() for k, v in self.value.state_dict().items()}

    def restore(self):
        self.value.load_state_dict(self.saved)

    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _StateDictHandler(_Handler):
    """An object with ``state_dict``/``load_state_dict`` (a scheduler, an ElasticSampler): saved as
    a deep copy, synced as rank 0's state dict."""

    def save(self):
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self.saved)

    def sync(self):
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


class _OptimizerHandler(_StateDictHandler):
    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)


def _handler(value):
    for kind, cls in ((torch.nn.Module, _ModelHandler), (torch.optim.Optimizer, _OptimizerHandler),
                      (torch.optim.lr_scheduler.LRScheduler, _StateDictHandler),
                      (ElasticSampler, _StateDictHandler)):
        if isinstance(value, kind):
            return cls(value)
    return None


class TorchState(ObjectState):
    """Horovod's ``TorchState(model, optimizer, **kwargs)``: models, optimizers, LR schedulers
    and :class:`ElasticSampler` s (given under any keyword) are saved as state dicts and synced by
    broadcast from rank 0; the other keywords are plain values (:class:`ObjectState`)."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {k: h for k, h in ((k, _handler(v)) for k, v in kwargs.items()) if h}
        object.__setattr__(self, "_handlers", handlers)
        for k, h in handlers.items():
            object.__setattr__(self, k, h.value)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in handlers})

    def save(self) -> None:
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self) -> None:
        for h in self._handlers.values():
            h.sync()
        super().sync()

    def __setattr__(self, name, value):
        if name in self.__dict__.get("_handlers", {}):
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)


# -- the sampler -----------------------------------------------------------------------------------

class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ``ElasticSampler(dataset, shuffle=True, seed=0)``: shards the indices of the
    epoch not yet processed over the current ranks; ``record_batch(batch_idx, batch_size)`` after
    each batch, ``set_epoch(epoch)`` at the end of an epoch. After a reset (a :class:`TorchState`
    holding it re-reads ``size()``/``rank()``) it goes on with the rest of the epoch."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch, self.processed_num = 0, 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch, self.processed_num = state_dict["epoch"], state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        self.num_replicas, self.rank = _basics.size(), _basics.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        idx = self.remaining_indices[:]
        idx += idx[:self.total_size - len(idx)]          # pad to a multiple of the ranks
        return iter(idx[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


# -- run and reset ---------------------------------------------------------------------------------

def run(func):
    """Horovod's decorator: ``func(state, ...)`` is called after ``state.sync()``; when a rank
    dies (ULFM) every survivor restores the last commit, the facade is reset over the survivors,
    the reset callbacks run and ``func`` is called again. Without ULFM errors propagate (the job
    ends, fail-fast)."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        from ..runtime.ft import ulfm_enabled

        ulfm = ulfm_enabled()
        reset_required = False
        while True:
            if reset_required:
                reset()
                state.on_reset()
            ok, result = True, None
            try:
                state.sync()
                result = func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:           # (never raised here; Horovod's branch)
                ok = False
            except Exception as exc:                # noqa: BLE001 - sorted by is_failure
                if not (ulfm and is_failure(exc)):
                    raise
                revoke()                            # wake the survivors blocked elsewhere
                for opt in _optimizers():
                    opt._hvd_rebind()               # drop the requests on revoked comms
                log.info("hvd.elastic: a peer died (%s); restoring the last commit", exc)
                state.restore()
                ok = False
            if not ulfm or _all_done(ok):
                return result
            reset_required = True
    return wrapper


def is_failure(exc: BaseException) -> bool:
    """``exc`` reports a dead process or a revoked communicator (ULFM), directly or as the cause
    of a ``HorovodInternalError``; or ``MPI_ERR_IN_STATUS`` while a facade communicator is
    revoked or knows of a dead process."""
    from mpi4py import MPI

    from ..errors import dead_ranks, proc_failure

    if proc_failure(exc):
        return True
    if isinstance(exc, MPI.Exception) and exc.Get_error_class() == MPI.ERR_IN_STATUS:
        comms = _comms()
        return any(c.Is_revoked() for c in comms) or bool(dead_ranks(_st.current().comm))
    return False


def _comms() -> list:
    """Every communicator the facade may be blocked on: its world, local, cross, the agreement's
    duplicate, the process sets', each DistributedOptimizer's (and those cached on them)."""
    from mpi4py import MPI

    from ..comm.cache import cached_comms

    st = _st.current()
    base = [st.comm, st.local, st.cross, _agree._W.comm,
            *(ps._comm for ps in st.sets.values())]
    for opt in _optimizers():
        base += [opt._hvd_comm, getattr(opt._hvd_reducer, "comm", None)]
    out, seen = [], set()
    for c in base:
        if isinstance(c, MPI.Comm) and c != MPI.COMM_NULL:
            for d in (c, *cached_comms(c)):
                if id(d) not in seen:
                    seen.add(id(d))
                    out.append(d)
    return out


def _optimizers() -> list:
    """The live DistributedOptimizers on the flat (SSGD) path of the global set."""
    from .optimizer import _LIVE

    opts = [ref() for ref in list(_LIVE.values())]
    return [o for o in opts if o is not None and getattr(o, "_hvd_comm", None) is not None]


def revoke() -> None:
    """Revoke every facade communicator (local; a second revoke by another survivor is
    harmless): a survivor blocked in any facade collective gets ``MPI_ERR_REVOKED``."""
    for c in _comms():
        try:
            c.Revoke()
        except Exception:          # noqa: BLE001 - already revoked
            pass


def _all_done(ok: bool) -> bool:
    """``MPI_Comm_agree`` over the facade's world: True on every survivor when each one
    returned from ``func`` (a death during the agreement is a failure: False everywhere)."""
    from ..errors import proc_failure

    try:
        return bool(_st.current().comm.Agree(int(ok)))
    except Exception as exc:       # noqa: BLE001
        if not proc_failure(exc):
            raise
        revoke()
        return False


def reset() -> None:
    """Shrink the facade's world over the survivors and initialise the facade on it (the old
    communicators are dropped without collectives: their groups hold dead ranks); the live
    DistributedOptimizers reduce over the new world from here on."""
    from .. import api

    st = _st.current()
    if st.algorithm not in (None, "ssgd"):
        raise NotImplementedError(f"hvd.elastic: a reset with algorithm={st.algorithm!r} "
                                  "(elastic training runs SSGD only)")
    if len(st.sets) > 1:
        raise NotImplementedError("hvd.elastic: a reset with process sets registered (Horovod "
                                  "drops them too; re-add them in a reset callback)")
    old_size = st.comm.Get_size()
    new = st.comm.Shrink()
    _drop(st)
    # the old topology's exit barrier and communicators hold dead ranks: released locally
    api.release(st.roles, free_world=st.owns_world)
    _basics.init(comm=new)
    new.Free()
    st = _st.current()
    for opt in _optimizers():
        opt._hvd_rebind(st.comm)
    if st.comm.Get_rank() == 0:
        log.warning("hvd.elastic: a rank died; reset from %d to %d ranks", old_size,
                    st.comm.Get_size())


def _drop(st) -> None:
    """Forget the facade's state without a collective (``hvd.shutdown`` would run some on the
    old world)."""
    from . import timeline

    for sid, ps in st.sets.items():
        ps._invalidate()
    _basics.global_process_set.process_set_id = 0
    _agree._W.__init__()
    _coll._works.clear()
    _coll._names.clear()
    timeline.stop()
    _st.STATE = None
