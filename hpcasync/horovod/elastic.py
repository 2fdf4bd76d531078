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
0 and ``train`` is called again. Without ULFM a death ends the job (fail-fast).

Growing back (horovodrun's ``--max-np``, here ``mpirun -x HPCASYNC_GROW_BACK=1`` with
``HPCASYNC_MAX_RANKS=N`` optional, default the starting size; or ``@hvd.elastic.run(grow_back=True,
max_ranks=N)``): after the shrink the survivors spawn replacements running the same command; a
replacement's ``hvd.init()`` merges with them and takes a dead rank's number, so ``hvd.size()`` is
back to N; then every rank — survivors and replacements — runs the reset callbacks once and the
state is broadcast from the lowest surviving rank (holding the most commits). Unlike Horovod, where a new worker starts in
``state.sync()`` without the callbacks, a replacement runs them too: it then makes the same calls
as the survivors in the same order (a callback may communicate). Between ``hvd.init()`` and
``train(state)`` a script builds its optimizer and state and makes no collective call of its own
(``hvd.broadcast_parameters`` there: the replacement would make it alone). Design and
differences from Horovod: docs/design/horovod-elastic.md. The retry loop, the error latch, the
agreement and the shrink are :mod:`hpcasync.runtime.elastic`'s, shared with the own-loop API
(:mod:`hpcasync.elastic`); this module says what the facade's world is (:class:`_Facade`).
"""
from __future__ import annotations

import functools
import logging
import math
import random

import torch

from ..runtime import elastic as _core
from ..runtime.elastic import HostsUpdatedInterrupt
from . import agree as _agree
from . import basics as _basics
from . import collectives as _coll
from . import state as _st
from .agree import HorovodInternalError  # noqa: F401 (what a facade collective raises)
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)

log = logging.getLogger("hpcasync")

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState",
           "is_joiner", "run"]

#: hpcasync's: this process is a replacement spawned by a grow-back
is_joiner = _core.is_joiner


# -- state objects: the core's, broadcasting with the facade's collectives -------------------------

class State(_core.State):
    """What survives a reset: ``commit()`` saves it in memory, ``restore()`` brings the last
    commit back, ``sync()`` makes every rank equal to rank 0 (Horovod's ``State``)."""

    def default_bcast_object(self, obj):
        return broadcast_object(obj, root_rank=_core.sync_root())

    def default_rank(self) -> int:
        return _basics.rank()

    def _size(self) -> int:
        return _basics.size()

    def _allgather(self, obj) -> list:
        return allgather_object(obj)


class ObjectState(_core.ObjectState, State):
    """Plain Python values given as keywords, kept as attributes (``state.epoch``)."""


def _sync_state_dict(value) -> None:
    value.load_state_dict(broadcast_object(value.state_dict(), root_rank=_core.sync_root()))


class TorchState(_core.TorchState, ObjectState):
    """Horovod's ``TorchState(model, optimizer, **kwargs)``: models, optimizers, LR schedulers
    and :class:`ElasticSampler` s (given under any keyword) are saved as state dicts and synced by
    broadcast from rank 0; the other keywords are plain values (:class:`ObjectState`)."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        super().__init__(model=model, optimizer=optimizer, **kwargs)

    def handler_for(self, value):
        if isinstance(value, torch.nn.Module):
            return _core.ModelHandler(value, lambda m: broadcast_parameters(
                m.state_dict(), root_rank=_core.sync_root()))
        if isinstance(value, torch.optim.Optimizer):
            return _core.Handler(value, lambda o: broadcast_optimizer_state(
                o, root_rank=_core.sync_root()))
        if isinstance(value, (torch.optim.lr_scheduler.LRScheduler, ElasticSampler)):
            return _core.Handler(value, _sync_state_dict)
        return None


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


# -- the facade's world, and run ------------------------------------------------------------------

class _Facade(_core.Membership):
    """The facade's world for the core (:class:`hpcasync.runtime.elastic.Membership`)."""

    @property
    def comm(self):
        return _st.current().comm

    def comms(self) -> list:
        return _comms()

    def after_failure(self) -> None:
        for opt in _optimizers():
            opt._hvd_rebind()               # drop the requests on revoked comms

    def check_reset(self) -> None:
        st = _st.current()
        if len(st.sets) > 1:
            raise NotImplementedError("hvd.elastic: a reset with process sets registered "
                                      "(Horovod drops them too; re-add them in a reset callback)")

    def rebuild(self, new) -> None:
        _rebuild(new)

    def done_with(self, new) -> None:
        new.Free()

    def regrow(self, grown) -> None:
        _regrow(grown)

    def rank(self) -> int:
        return _basics.rank()

    def size(self) -> int:
        return _basics.size()


def run(func=None, *, grow_back: bool | None = None, max_ranks: int | None = None):
    """Horovod's decorator: ``func(state, ...)`` is called after ``state.sync()``; when a rank
    dies (ULFM) every survivor restores the last commit, the facade is reset over the survivors,
    the reset callbacks run and ``func`` is called again. Without ULFM errors propagate (the job
    ends, fail-fast). The loop is :func:`hpcasync.runtime.elastic.elastic_run`.
    hpcasync's keywords ``grow_back``, ``max_ranks``: grow back after the shrink (module doc;
    default ``HPCASYNC_GROW_BACK``, ``HPCASYNC_MAX_RANKS``)."""
    if func is None:
        return functools.partial(run, grow_back=grow_back, max_ranks=max_ranks)

    def tolerance(state):
        _check_horovods(state)
        return _core.FaultTolerance(_Facade(), grow_back=grow_back, max_ranks=max_ranks)
    return _core.elastic_run(tolerance)(func)


def _check_horovods(state) -> None:
    """One line, before training, where a reset would not move an optimizer onto the survivors:
    ``hvd.elastic`` resets Horovod's SSGD (the facade's ``DistributedOptimizer``); another
    algorithm (``hvd.init(algorithm=...)``, ``DistributedOptimizer(algorithm=...)`` or
    ``compress=``: the toolkit's own optimizer) survives in ``hpcasync.elastic``."""
    from ..errors import ConfigError

    st = _st.current()
    ours = [o for o in (h.value for h in getattr(state, "_handlers", {}).values())
            if isinstance(o, torch.optim.Optimizer) and hasattr(o, "algorithm")
            and getattr(o, "_hvd_comm", None) is None]
    if st.algorithm not in (None, "ssgd") or ours:
        name = st.algorithm if st.algorithm not in (None, "ssgd") else ours[0].algorithm
        raise ConfigError(f"hvd.elastic resets Horovod's SSGD only; this job's optimizer is "
                          f"hpcasync's {name} (algorithm=... or compress=...): use "
                          "hpcasync.elastic.State and @hpcasync.elastic.run, which survive it")


def is_failure(exc: BaseException) -> bool:
    """``exc`` reports a dead process or a revoked communicator (ULFM), directly or as the cause
    of a ``HorovodInternalError``; or ``MPI_ERR_IN_STATUS`` while a facade communicator is
    revoked or knows of a dead process."""
    return _core.FaultTolerance(_Facade(), ulfm=True).is_failure(exc)


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
    _core.revoke_all(_comms())


def reset() -> None:
    """Shrink the facade's world over the survivors and initialise the facade on it (the old
    communicators are dropped without collectives: their groups hold dead ranks); the live
    DistributedOptimizers reduce over the new world from here on."""
    _core.FaultTolerance(_Facade(), ulfm=True).reset()


def _rebuild(new) -> None:
    from .. import api

    st = _st.current()
    _drop(st)
    # the old topology's exit barrier and communicators hold dead ranks: released locally
    api.release(st.roles, free_world=st.owns_world)
    _basics.init(comm=new)          # the facade runs on a duplicate: ``new`` is freed by
    st = _st.current()              # done_with() once the reset is agreed on
    for opt in _optimizers():
        opt._hvd_rebind(st.comm)


def _regrow(grown) -> None:
    """The survivors' facade over ``grown`` by the calls a replacement makes: its ``hvd.init()``
    (the first call's options, ``comm=grown``), then, per live DistributedOptimizer in the order
    they were built, its constructor's collectives (the descriptor agreement, the reducer's
    duplicate)."""
    from .. import api

    st = _st.current()
    _drop(st)
    api.release(st.roles, free_world=st.owns_world)          # local
    _basics.init(comm=grown, **_basics.INIT_OPTIONS)
    grown.Free()                    # the facade runs on a duplicate, as in a replacement
    st = _st.current()
    for opt in _optimizers():
        _agree.agree(st.comm, _init_desc(opt))
        opt._hvd_rebind(st.comm)


def _init_desc(opt):
    """The descriptor a DistributedOptimizer's constructor agrees on (``_hvd_setup``'s
    ``OPTIMIZER-INIT``: a replacement's constructor sends it; kept in step with it)."""
    params = opt._hvd_params
    return _agree.Desc("OPTIMIZER-INIT", "DistributedOptimizer", opt._hvd_desc.op,
                       [(str(p.dtype)[6:], tuple(p.shape),
                         opt._hvd_names.get(id(p), f"parameter {k}"))
                        for k, p in enumerate(params)],
                       None, (float(opt._hvd_predivide), float(opt.backward_passes_per_step)),
                       params[0].device.type if params else "cpu")


def _release_at_exit() -> None:
    """In a process of a grown job, at exit: free the facade's communicators (they span the
    replacements' job) before ``MPI_Finalize``; local, no collective."""
    st = _st.STATE
    if st is None:
        return
    from .. import api

    comms = [getattr(o._hvd_reducer, "comm", None) for o in _optimizers()
             if o._hvd_flat is not None]
    comms += [_agree._W.comm, st.local, st.cross, st.comm]
    _drop(st)
    for c in comms:
        if c is not None:
            api._free(c)
    api.release(st.roles, free_world=st.owns_world)


_core._RELEASE.insert(0, _release_at_exit)      # before the front door's (its topology)


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
