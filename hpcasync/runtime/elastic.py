"""One fault-tolerance core for a loop that survives dead ranks under ULFM: the user's own loop
(:mod:`hpcasync.elastic`) and Horovod scripts (:mod:`hpcasync.horovod.elastic`) both run on it.

It keeps in one place what torchft's ``Manager`` keeps in one place — the error latch, the
agreement, the shrink, the rebuild on the survivors — and Horovod's elastic ``State`` shape for
what is saved: ``commit()`` copies the state in memory, ``restore()`` brings the last commit
back, ``sync()`` makes every rank equal to rank 0, reset callbacks run on the new world.
A front end says what a "world" is with a :class:`Membership` (its communicators, how to rebuild
on the survivors, how to broadcast); :func:`elastic_run` is the retry loop::

    ft = FaultTolerance(membership)          # membership: the front door's or the facade's
    @elastic_run(ft)
    def train(state):
        ...                                  # collectives fail on every survivor after a death
    train(state)

Without ULFM nothing is caught: a death ends the job (fail-fast, one line). Design:
docs/design/elastic.md.
"""
from __future__ import annotations

import copy
import functools
import logging
import time
from typing import Any, Callable

import torch

from ..errors import TopologyError, proc_failure
from .recovery import agreed

log = logging.getLogger("hpcasync")

__all__ = ["FaultTolerance", "HostsUpdatedInterrupt", "Membership", "ObjectState", "State",
           "TorchState", "elastic_run", "revoke_all"]


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's: hosts were added or removed (never raised here: there is no host discovery)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


# -- what a front end provides ---------------------------------------------------------------------

class Membership:
    """The world a front end runs on. Subclasses give:

    ``comm``            the communicator every survivor agrees and shrinks over;
    ``comms()``         every communicator a rank may be blocked on (revoked after a failure);
    ``after_failure()`` local: forget collectives in flight (their communicators are revoked);
    ``check_reset()``   refuse a reset this front end cannot do (one-line error);
    ``rebuild(new)``    collective over ``new``, the shrunk ``comm``: re-initialise topology and
                        optimizers on the survivors (``new`` stays valid: the reset agrees on it);
    ``done_with(new)``  after the reset was agreed on: free ``new`` if the rebuild copied it;
    ``rank()``/``size()``, ``bcast_object(obj)``, ``sync_model(m)``, ``sync_optimizer(o)``.
    """

    comm: Any = None

    def comms(self) -> list:
        return [self.comm]

    def after_failure(self) -> None:
        pass

    def check_reset(self) -> None:
        pass

    def rebuild(self, new) -> None:
        raise NotImplementedError

    def done_with(self, new) -> None:
        pass

    def rank(self) -> int:
        return self.comm.Get_rank()

    def size(self) -> int:
        return self.comm.Get_size()

    def bcast_object(self, obj):
        return self.comm.bcast(obj, root=0)

    def sync_model(self, model: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank, bitwise (in place: views stay views)."""
        state = self.bcast_object(model.state_dict() if self.rank() == 0 else None)
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(state[k])

    def sync_optimizer(self, opt) -> None:
        opt.load_state_dict(self.bcast_object(opt.state_dict() if self.rank() == 0 else None))


def revoke_all(comms) -> None:
    """Revoke ``comms`` and the duplicates hpcasync cached on them (local; a second revoke by
    another survivor is harmless): a survivor blocked in any of them gets ``MPI_ERR_REVOKED``."""
    from mpi4py import MPI

    from ..comm.cache import cached_comms

    seen = set()
    for c in comms:
        if not isinstance(c, MPI.Comm) or c == MPI.COMM_NULL:
            continue
        for d in (c, *cached_comms(c)):
            if id(d) in seen:
                continue
            seen.add(id(d))
            try:
                d.Revoke()
            except Exception:          # noqa: BLE001 - already revoked, or freed
                pass


# -- the fault-tolerance object ----------------------------------------------------------------------

class FaultTolerance:
    """Error latch, agreement, shrink and rebuild over a :class:`Membership` (torchft's
    ``Manager`` role; one per elastic state).

    Attributes: ``error`` (the latched process failure of the current attempt, None if none),
    ``resets`` (one record per reset: ``size_before``, ``size``, ``detected_unix``,
    ``reset_s``), ``ulfm`` (ULFM is on: otherwise nothing is caught)."""

    def __init__(self, membership: Membership, *, ulfm: bool | None = None):
        if ulfm is None:
            from .ft import ulfm_enabled

            ulfm = ulfm_enabled()
        self.membership, self.ulfm = membership, bool(ulfm)
        self.error: BaseException | None = None
        self.resets: list[dict] = []
        self._detected = None
        self._kill_point = _kill_points() if self.ulfm else (lambda phase: None)

    def is_failure(self, exc: BaseException) -> bool:
        """``exc`` reports a dead process or a revoked communicator (ULFM), directly or as a
        cause; or ``MPI_ERR_IN_STATUS``/``MPI_ERR_OTHER`` while a communicator of the world is
        revoked or knows of a dead process."""
        if proc_failure(exc):
            return True
        from mpi4py import MPI

        if isinstance(exc, MPI.Exception) and exc.Get_error_class() in (MPI.ERR_IN_STATUS,
                                                                        MPI.ERR_OTHER):
            from ..errors import dead_ranks

            comms = self.membership.comms()
            return any(_revoked(c) for c in comms) or bool(dead_ranks(self.membership.comm))
        return False

    def report_error(self, exc: BaseException) -> bool:
        """Latch ``exc`` if it is a process failure under ULFM (the first one is kept), revoke
        every communicator of the world so the other survivors fail too, drop the collectives in
        flight; True if latched (the caller rolls back), False (re-raise it) otherwise."""
        if not (self.ulfm and self.is_failure(exc)):
            return False
        if self.error is None:
            self.error, self._detected = exc, time.time()
        revoke_all(self.membership.comms())
        self.membership.after_failure()
        return True

    def all_done(self, ok: bool) -> bool:
        """``MPI_Comm_agree`` over the world: True on every survivor when each one completed
        (a rank that finished a collective others failed in learns of the failure here); a death
        during the agreement is a failure (False everywhere)."""
        try:
            return bool(self.membership.comm.Agree(int(ok)))
        except Exception as exc:       # noqa: BLE001
            if not proc_failure(exc):
                raise
            revoke_all(self.membership.comms())
            return False

    def reset(self) -> None:
        """Shrink the world over the survivors and rebuild the front end on them. Atomic: the
        rebuild ends in one ``MPI_Comm_agree``; if it failed anywhere (a death during the
        rebuild's collectives), every survivor shrinks again and rebuilds on the smaller world."""
        m = self.membership
        m.check_reset()
        t0, before = time.perf_counter(), m.comm.Get_size()
        comm, attempts = m.comm, 0
        while True:
            new = comm.Shrink()
            self._kill_point("reset")       # testing hook: a death inside the rebuild
            attempts, error = attempts + 1, None
            try:
                m.rebuild(new)
            except Exception as exc:       # noqa: BLE001 - an MPI error: agreed on below
                if not _mpi_error(exc):
                    raise
                error = exc
            if agreed(new, error is None):
                m.done_with(new)
                break
            if new.Get_size() == comm.Get_size() and attempts > 1:
                # nobody died since the last attempt: not a death; every survivor stops (a
                # rank whose own rebuild went through must not try again alone, forever)
                raise error or TopologyError("elastic reset: the rebuild failed on another "
                                             "survivor, and no rank died since the last attempt")
            revoke_all([new])
            comm = new
        self.resets.append({"size_before": before, "size": m.size(),
                            "detected_unix": self._detected, "attempts": attempts,
                            "reset_s": round(time.perf_counter() - t0, 4)})
        self.error = self._detected = None
        if m.rank() == 0:
            log.warning("elastic: a rank died; reset from %d to %d ranks", before, m.size())


def elastic_run(ft: FaultTolerance | Callable[[Any], FaultTolerance]):
    """The retry loop as a decorator: ``func(state, ...)`` is called after ``state.sync()``;
    when a rank dies (ULFM) every survivor restores the last commit, the world is shrunk and
    rebuilt (:meth:`FaultTolerance.reset`), the reset callbacks run and ``func`` is called again.
    ``ft``: the object, or a function of the state returning it."""

    def decorate(func):
        @functools.wraps(func)
        def wrapper(state, *args, **kwargs):
            tol = ft(state) if callable(ft) and not isinstance(ft, FaultTolerance) else ft
            reset_required = False
            while True:
                if reset_required:
                    tol.reset()
                    state.on_reset()
                ok, result = True, None
                try:
                    state.sync()
                    result = func(state, *args, **kwargs)
                except HostsUpdatedInterrupt:           # (never raised here; Horovod's branch)
                    ok = False
                except Exception as exc:                # noqa: BLE001 - sorted by report_error
                    if not tol.report_error(exc):
                        raise
                    log.info("elastic: a peer died (%s); restoring the last commit", exc)
                    state.restore()
                    ok = False
                if not tol.ulfm or tol.all_done(ok):
                    return result
                reset_required = True
        return wrapper
    return decorate


def _mpi_error(exc: BaseException) -> bool:
    """An MPI error (a rebuild's collective over a world with a dead member fails with the
    process-failure class, or with the class of what it creates: ``MPI_ERR_WIN``, ...)."""
    from mpi4py import MPI

    return proc_failure(exc) or isinstance(exc, MPI.Exception)


def defer_startup_failure(exc: BaseException, comms) -> bool:
    """Under ULFM, a process failure met by a collective before any elastic loop ran -- an
    optimizer's first broadcast, when a rank died while the ranks loaded their data: revoke
    ``comms`` and return True (the caller goes on; its replicas are not equal yet). The next
    collective on them then fails on every survivor: inside ``@hpcasync.elastic.run`` (its first
    ``state.sync()``), which resets over the survivors and syncs rank 0's state; anywhere else
    fail-fast ends the job with one line, as if it had been raised here. False (re-raise it):
    not a process failure, or no ULFM."""
    from .ft import ulfm_enabled

    if not (ulfm_enabled() and proc_failure(exc)):
        return False
    revoke_all(comms)
    log.info("a rank died before the training loop began (%s); the elastic loop resets first",
             exc)
    return True


def _kill_points():
    """``HPCASYNC_INJECT_KILL_AT``'s kill points for this process's ``MPI_COMM_WORLD`` rank."""
    from mpi4py import MPI

    from .ft import kill_points

    return kill_points(MPI.COMM_WORLD.Get_rank())


def _revoked(comm) -> bool:
    from mpi4py import MPI

    try:
        return isinstance(comm, MPI.Comm) and comm != MPI.COMM_NULL and comm.Is_revoked()
    except Exception:                  # noqa: BLE001 - freed
        return False


# -- state objects -------------------------------------------------------------------------------

class State:
    """What survives a reset: ``commit()`` saves it in memory, ``restore()`` brings the last
    commit back, ``sync()`` makes every rank equal to rank 0 (Horovod's ``State``).

    Args:
        bcast_object: broadcasts a picklable object from rank 0 (the front end's).
        get_rank: this rank in the current world."""

    def __init__(self, bcast_object=None, get_rank=None):
        self._bcast_object = bcast_object or self.default_bcast_object
        self._rank = get_rank or self.default_rank
        self._reset_callbacks: list = []

    def default_bcast_object(self, obj):
        """The front end's broadcast of a picklable object from rank 0."""
        raise NotImplementedError

    def default_rank(self) -> int:
        raise NotImplementedError

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
        """A no-op: there is no host discovery (ranks only leave, by dying), so no
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


class Handler:
    """Save / restore / sync of one object of a :class:`TorchState`; ``sync`` is given the
    front end's broadcast (``sync(value)``)."""

    def __init__(self, value, sync: Callable[[Any], None]):
        self.value, self._sync = value, sync
        self.save()

    def set_value(self, value) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        self._sync(self.value)


class ModelHandler(Handler):
    def save(self) -> None:
        self.saved = {k: v.detach().clone() for k, v in self.value.state_dict().items()}


class TorchState(ObjectState):
    """Models, optimizers and objects with ``state_dict``/``load_state_dict`` (schedulers,
    samplers) given under any keyword are saved as state dicts and synced from rank 0; the other
    keywords are plain values (:class:`ObjectState`). ``handler_for(value)`` (a subclass's)
    returns the :class:`Handler` of a value, or None for a plain value."""

    def __init__(self, **kwargs):
        handlers = {k: h for k, h in ((k, self.handler_for(v)) for k, v in kwargs.items()) if h}
        object.__setattr__(self, "_handlers", handlers)
        for k, h in handlers.items():
            object.__setattr__(self, k, h.value)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in handlers})

    def handler_for(self, value) -> Handler | None:
        raise NotImplementedError

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
