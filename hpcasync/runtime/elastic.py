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

Without ULFM nothing is caught: a death ends the job (fail-fast, one line).

**One reset for every synchronous road**: :meth:`FaultTolerance.reset` is the one shrink →
sync → grow path of your own loop, ``hvd.elastic`` and the CLI's synchronous families (their
world: :class:`hpcasync.runtime.recovery.SyncWorld`, which adopts the live state of the survivor
furthest on instead of a commit; and the CLI's parameter server, whose world,
:class:`hpcasync.ps.takeover.PSWorld`, rebuilds by electing a new server).
:func:`atomic_shrink` is hpcasync's only "shrink, attempt, ``MPI_Comm_agree``, retry on a fresh
shrink" loop, run by the reset; :func:`is_process_failure` is the one test of "this exception is
a process failure".

**Growing back** (opt-in: ``HPCASYNC_GROW_BACK=1``, or ``run(grow_back=True)`` of a front end):
after the shrink the survivors spawn replacements running the user's own command
(:func:`hpcasync.runtime.join.spawn`, the CLI's grow-back's too), merge with them, and each
replacement takes a dead rank's number (:func:`hpcasync.runtime.join._order`). The front end is
rebuilt on the grown world (``Membership.regrow``) by the same calls a replacement makes in its
``hpcasync.init`` / ``hvd.init`` (:func:`hpcasync.runtime.join.join_world`, the one entry of a
replacement) and its optimizers' constructors; then
every rank runs the reset callbacks and syncs from the root (:func:`sync_root`: the lowest
survivor holding the most commits),
and one allgather of a digest of the state checks that the replacements hold the survivors'
(:func:`check_synced`). Design: docs/design/elastic.md.
"""
from __future__ import annotations

import copy
import functools
import logging
import os
import time
from typing import Any, Callable

import torch

from .. import environ, inject
from . import join
from ..errors import ConfigError, ProcessFailedError, TopologyError, proc_failure
from ..errors import ranks_in as _ranks_in

log = logging.getLogger("hpcasync")

__all__ = ["FaultTolerance", "GrowInterrupt", "HostsUpdatedInterrupt", "Membership",
           "ObjectState", "State", "TorchState", "agreed", "atomic_shrink", "elastic_run",
           "is_joiner", "is_process_failure", "revoke_all", "sync_root"]

#: grow back after a death (``1``/``true``/``on``); ``HPCASYNC_MAX_RANKS`` the size to grow to
GROW_ENV, MAX_ENV = "HPCASYNC_GROW_BACK", "HPCASYNC_MAX_RANKS"

#: ``root``: the rank ``sync()`` broadcasts from after a reset (the lowest survivor holding the
#: most commits; after a grow its place in the grown world); unset on a replacement until its
#: first reset (then ``join.joined()``'s)
_GROWN: dict[str, Any] = {}
#: front ends' functions freeing their communicators at exit in a process of a grown job
_RELEASE = join.AT_EXIT
LOCAL_KEY = join.LOCAL_KEY     # a state_dict's part that is this rank's own (join.digest)
is_joiner = join.is_joiner


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's: hosts were added or removed (never raised here: there is no host discovery)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class GrowInterrupt(HostsUpdatedInterrupt):
    """The world grows back without a rollback: raised on every survivor once a parameter
    server has stopped its workers so that a replacement takes a dead worker's place
    (``ParameterServer``'s grow-back in your own loop), after its ``close`` absorbed the death.
    ``spawner``: the server's rank among the survivors, who spawned the replacements;
    ``groups``: its spawned groups (:meth:`~hpcasync.runtime.join.Spawned.take`; None
    elsewhere). :func:`elastic_run` grows (:meth:`FaultTolerance.grow`), runs the reset
    callbacks and calls the function again, nothing restored."""

    def __init__(self, spawner: int, groups: list | None = None):
        super().__init__(skip_sync=False)
        self.spawner, self.groups = spawner, groups


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
    ``absorb(new)``     collective over ``new``, the survivors: move onto them with nothing to
                        roll back or sync (:meth:`FaultTolerance.absorb`; ``new`` is the front
                        end's from then on);
    ``shrunk(record)``  after the shrink (the ``rank_failed`` record): say it;
    ``settle(grew)``    last, on every rank of the world the reset ends on (``grew``: the
                        ``rank_joined`` record, None if the world did not grow);
    ``rank()``/``size()``, ``bcast_object(obj)``, ``sync_model(m)``, ``sync_optimizer(o)``.
    """

    comm: Any = None
    #: during a reset: every survivor's key (its count of commits, its position), by rank of the
    #: shrunk world
    commits: list | None = None
    #: grow back only into the places a death emptied (never past the size before it)
    refill_only = False
    #: a reset grows back (with grow-back on); False: it never does (a parameter server in your
    #: own loop grows back from its server's spawn only, after a worker's death)
    grows_at_reset = True
    #: a parameter server's world: the serving rank (a replacement learns its grown place)
    ps_rank: int | None = None
    #: set by a ``rebuild`` that loaded the root's state: the key this rank holds from then on
    #: (it reports that one if the attempt fails and another begins)
    adopted: Any = None

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

    def absorb(self, new) -> None:
        raise NotImplementedError

    def regrow(self, grown) -> None:
        """Collective over ``grown`` (the survivors and their replacements, each replacement in a
        dead rank's place): rebuild the front end on it with exactly the collectives a
        replacement's ``init`` and optimizer constructors make; ``grown`` is the front end's."""
        raise NotImplementedError

    def shrunk(self, record: dict) -> None:
        if record.get("absorbed"):
            if self.rank() == 0:
                log.warning("rank(s) %s died and were retired; the others trained on, and end "
                            "with %d ranks", ", ".join(map(str, record["dead_ranks"])),
                            record["world_size"])
        elif self.rank() == sync_root():
            log.warning("rank(s) %s died; going on with %d ranks (recovered in %.3f s, from the "
                        "state of rank %d at %s)", ", ".join(map(str, record["dead_ranks"])),
                        record["world_size"], record["recovery_s"], record["adopted_from"],
                        record["position"])

    def settle(self, grew: dict | None) -> None:
        if grew and self.rank() == sync_root():
            log.warning("grow-back: %d rank(s) joined as rank(s) %s; %d ranks again (%.3f s)",
                        len(grew["joined"]), ", ".join(map(str, grew["ranks"])),
                        grew["world_size"], grew["join_s"])

    def rank(self) -> int:
        return self.comm.Get_rank()

    def size(self) -> int:
        return self.comm.Get_size()

    def bcast_object(self, obj):
        """``obj`` of :func:`sync_root` (a copy there too), any size (its tensors as buffers)."""
        from ..comm.objects import bcast_object

        return bcast_object(self.comm, obj, sync_root(), copy=True)

    def is_root(self) -> bool:
        return self.rank() == sync_root()

    def sync_model(self, model: torch.nn.Module) -> None:
        """The root's parameters and buffers on every rank, bitwise (in place: views stay views)."""
        state = self.bcast_object(model.state_dict() if self.is_root() else None)
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(state[k])

    def sync_optimizer(self, opt) -> None:
        opt.load_state_dict(self.bcast_object(opt.state_dict() if self.is_root() else None))


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


def is_process_failure(exc: BaseException, world, comms=()) -> bool:
    """``exc`` reports a dead process or a revoked communicator (ULFM's classes), directly or as
    a cause; or ``MPI_ERR_IN_STATUS`` (a test/wait over several requests, e.g. the pieces of a
    chunked nonblocking allreduce) or ``MPI_ERR_OTHER`` (Open MPI 5's barrier on a rank that
    enters it late, after a peer died and another revoked: "known error not in list") while one
    of ``comms`` or a duplicate hpcasync cached on it is revoked (a peer revoked it before this
    rank learnt of the death), or ``world`` knows of a dead process. The one test of
    :meth:`FaultTolerance.is_failure`."""
    if proc_failure(exc):
        return True
    from mpi4py import MPI

    if isinstance(exc, MPI.Exception) and exc.Get_error_class() in (MPI.ERR_IN_STATUS,
                                                                    MPI.ERR_OTHER):
        from ..comm.cache import cached_comms
        from ..errors import dead_ranks

        every = [d for c in comms if isinstance(c, MPI.Comm) and c != MPI.COMM_NULL
                 for d in (c, *cached_comms(c))]
        return any(_revoked(c) for c in every) or bool(dead_ranks(world))
    return False


def agreed(comm, done) -> bool:
    """True on every survivor when each one completed its attempt (``MPI_Comm_agree`` of
    ``done``: a bitwise AND); a death during the agreement, which it reports on every survivor
    alike, is False. Ends every attempt of :func:`atomic_shrink`."""
    try:
        return bool(comm.Agree(int(done)))
    except Exception as exc:        # noqa: BLE001 - a death during the agreement
        if not proc_failure(exc):
            raise
        return False


def atomic_shrink(world, attempt: Callable[[Any], Any], *,
                  on_shrink: Callable[[Any, Any], None], revoke: Callable[[Any], Any],
                  no_death: str, max_attempts: int,
                  exhausted: Callable[[int], BaseException]) -> tuple:
    """The one atomic "shrink, rebuild, agree, retry on a fresh shrink" loop of hpcasync's fault
    tolerance (docs/design/elastic.md, "One loop"), run by :meth:`FaultTolerance.reset` (your
    own loop, ``hvd.elastic``, the CLI's synchronous families and its parameter server's
    takeover). Collective over the survivors of ``world`` (revoked by the caller).

    Each attempt: ``new = world.Shrink()``, ``on_shrink(world, new)`` (per-shrink bookkeeping,
    outside the attempt: what it raises ends the loop on every survivor alike), then
    ``attempt(new)``: what one attempt does on the shrunk communicator. An MPI error
    (:func:`_mpi_error`) is a failed attempt here: the communicators ``revoke(new)`` returns are
    revoked at once (so nobody stays blocked in one of them); any other exception propagates.
    The attempt ends in ``MPI_Comm_agree`` (:func:`agreed`) on whether it completed on every
    survivor; if not, every survivor revokes ``new`` and starts another on a fresh shrink of it.
    When an attempt after the first failed and its shrink lost no rank, every survivor stops (a
    rank whose attempt went through must not retry alone, forever) with the attempt's error,
    else ``TopologyError(no_death)``. After ``max_attempts`` failed attempts:
    ``exhausted(max_attempts)``.

    Returns ``(new, attempt's result, number of attempts)``: the same ``new`` on every survivor.
    """
    attempts = 0
    while True:
        if attempts >= max_attempts:
            raise exhausted(attempts)
        new = world.Shrink()
        attempts += 1
        on_shrink(world, new)
        error, result = None, None
        try:
            result = attempt(new)
        except Exception as exc:       # noqa: BLE001 - a failed attempt: agreed on below
            if not _mpi_error(exc):
                raise
            error = exc
            revoke_all(revoke(new))
        if agreed(new, error is None):
            return new, result, attempts
        if attempts > 1 and new.Get_size() == world.Get_size():
            raise error or TopologyError(no_death)
        world = new
        revoke_all((new,))


# -- the fault-tolerance object ----------------------------------------------------------------------

class FaultTolerance:
    """Error latch, agreement, shrink, rebuild and grow-back over a :class:`Membership`
    (torchft's ``Manager`` role): one per elastic state, one per CLI run of a synchronous family.

    Attributes: ``error`` (the latched process failure of the current attempt, None if none),
    ``failures`` (one record per reset: the ``rank_failed`` metrics record), ``joins`` (one per
    grow: the ``rank_joined`` record), ``original`` (each rank's number in the first launch; a
    replacement gets a new one), ``last_kept`` (the survivors' ranks in the world before the last
    reset), ``ulfm`` (ULFM is on: otherwise nothing is caught)."""

    def __init__(self, membership: Membership, *, ulfm: bool | None = None,
                 grow_back: bool | None = None, max_ranks: int | None = None,
                 min_ranks: int | None = None):
        if ulfm is None:
            from .ft import ulfm_enabled

            ulfm = ulfm_enabled()
        self.membership, self.ulfm = membership, bool(ulfm)
        self.error: BaseException | None = None
        self.failures: list[dict] = []
        self.joins: list[dict] = []
        self._detected, self._t0, self._pending_next_step = None, time.time(), None
        self.grow_back, self.max_ranks, self.min_ranks = False, None, min_ranks or 1
        self.set_growth(grow_back, max_ranks)
        joined = join.joined() or {}
        self.original = list(joined.get("original", range(membership.size())))
        self.next_id = joined.get("next_id", membership.size())  # the next replacement's number
        self.last_kept: list[int] = []
        self.size_before = membership.size()
        #: after a grow (or on a replacement): the first sync is checked (:func:`check_synced`)
        self.check_pending = False

    def set_growth(self, grow_back: bool | None = None, max_ranks: int | None = None) -> None:
        """Grow back after a death (None: ``HPCASYNC_GROW_BACK``), to ``max_ranks`` ranks (None:
        ``HPCASYNC_MAX_RANKS``, else the size of the world now, the starting size). On a
        replacement both are the survivors' (sent with its place)."""
        joined = join.joined()
        if joined is not None:                   # a replacement: what the survivors grow with
            self.grow_back, self.max_ranks = True, joined.get("max_ranks")
            return
        if grow_back is None:
            grow_back = environ.switch(GROW_ENV, False)
        if max_ranks is None:
            raw = os.environ.get(MAX_ENV, "")
            if raw and not raw.isdigit():
                raise ConfigError(f"{MAX_ENV}={raw!r} is not a positive integer")
            max_ranks = int(raw) if raw else None
        if max_ranks is not None and (isinstance(max_ranks, bool) or not isinstance(max_ranks, int)
                                      or max_ranks < 1):
            raise ConfigError(f"max_ranks must be an integer >= 1, got {max_ranks!r}")
        self.grow_back = bool(grow_back)
        self.max_ranks = max_ranks or (self.max_ranks or self.membership.size())
        if self.grow_back and not self.ulfm:
            from .ft import say_without_ulfm

            say_without_ulfm("grow-back", self.membership.rank())

    def is_failure(self, exc: BaseException) -> bool:
        """``exc`` is a process failure of this world (:func:`is_process_failure` over the
        membership's communicators)."""
        return is_process_failure(exc, self.membership.comm, self.membership.comms())

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

    def reset(self, key=0) -> None:
        """Shrink the world over the survivors, rebuild the front end on them, grow back if asked.
        Atomic: the rebuild ends in one ``MPI_Comm_agree``; if it failed anywhere (a death during
        the rebuild's collectives), every survivor shrinks again and rebuilds on the smaller
        world.

        ``key``: how far this rank got (comparable: a count of commits, a CLI loop's position
        ``(epoch, batches done, started)``). The sync root is the lowest survivor holding the
        largest (:func:`sync_root`); ``membership.commits`` holds every survivor's key during the
        rebuild (DASO asks it whether all hold the same commit). Collective over the survivors."""
        m = self.membership
        m.check_reset()
        t0, before = time.perf_counter(), m.size()
        detected = self._detected or time.time()
        lost, track = [], {"index": list(range(before)), "original": self.original}
        m.adopted = None

        def on_shrink(world, new) -> None:      # who is left, in original and old numbering
            inject.point("reset")
            kept, original = _ranks_in(new.Get_group(), world), track["original"]
            lost.extend(original[r] for r in range(world.Get_size()) if r not in kept)
            track["original"] = [original[r] for r in kept]
            track["index"] = [track["index"][r] for r in kept]
            if not self.grow_back:
                self._check_min(new.Get_size(), sorted(lost))

        def attempt(new) -> int:
            m.commits = new.allgather(key if m.adopted is None else m.adopted)
            root = furthest(m.commits)
            _GROWN["root"] = root
            m.rebuild(new)
            return root

        # (report_error revoked the world: each failed attempt revokes what it may block on)
        new, root, attempts = atomic_shrink(
            m.comm, attempt, on_shrink=on_shrink, revoke=lambda new: (new, *m.comms()),
            no_death="reset: the rebuild failed on another survivor, and no rank died since the "
                     "last attempt",
            max_attempts=before,        # (each attempt that fails needs one more death)
            exhausted=lambda n: ProcessFailedError(f"the reset did not complete in {n} attempts",
                                                   sorted(lost)))
        self.original, self.last_kept, self.size_before = (track["original"], track["index"],
                                                           before)
        m.done_with(new)
        keys = m.commits
        record = self._failure(
            sorted(lost), detected, t0, before, attempts=attempts,
            position=list(keys[root]) if isinstance(keys[root], tuple) else keys[root],
            adopted_from=self.original[root],
            steps_behind=[_behind(k, keys[root]) for k in keys])
        self._pending_next_step = record
        m.shrunk(record)
        want = self._want(before) if self.grow_back and m.grows_at_reset else 0
        grew = self._grow(want, record) if want > 0 else None
        if self.grow_back:
            self._check_min(m.size(), record["dead_ranks"], "" if grew or want <= 0 else
                            f" and spawning {want} replacement(s) failed")
        self.error = self._detected = None
        m.settle(grew)
        log.info("reset from %d to %d ranks in %.3f s", before, m.size(),
                 time.perf_counter() - t0)

    def absorb(self, new) -> None:
        """A death the algorithm went on through, with nothing to roll back: a parameter server
        retired the dead worker and served the others to their end, and its ``close`` shrank its
        communicator to ``new`` (the survivors of this world, in its order). The front end moves
        onto ``new`` (``membership.absorb``) and the death is recorded as a reset's is
        (``failures``; ``absorbed``, no sync root). Collective over ``new``."""
        m = self.membership
        t0, before = time.perf_counter(), m.size()
        detected = self._detected or time.time()
        kept = _ranks_in(new.Get_group(), m.comm)
        if len(kept) == before:         # (a second optimizer's close: absorbed already)
            new.Free()
            return
        lost = [self.original[r] for r in range(before) if r not in kept]
        self._check_min(new.Get_size(), lost)
        m.absorb(new)
        self.original, self.last_kept, self.size_before = ([self.original[r] for r in kept],
                                                           kept, before)
        record = self._failure(lost, detected, t0, before, attempts=1, position=None,
                               adopted_from=None, steps_behind=[0] * m.size(), absorbed=True)
        m.shrunk(record)
        self.error = self._detected = None

    def _failure(self, lost: list, detected: float, t0: float, before: int, **fields) -> dict:
        """The ``failures`` record of a death (the CLI's ``rank_failed``), appended: the dead
        and the survivors in first-launch numbers, when it was detected, the seconds since
        ``t0``, the world's size before and after, and a reset's or an absorption's ``fields``."""
        record = {"dead_ranks": lost, "world_size": self.membership.size(),
                  "survivors": list(self.original),
                  "detected_at_s": round(detected - self._t0, 4),
                  "detected_unix": round(detected, 4),
                  "recovery_s": round(time.perf_counter() - t0, 4), **fields,
                  "next_step_s": None, "size_before": before}
        self.failures.append(record)
        return record

    def _want(self, before: int) -> int:
        """Replacements to spawn: up to ``max_ranks`` (``membership.refill_only``: no more than
        the places the last reset emptied)."""
        target = min(self.max_ranks, before) if self.membership.refill_only else self.max_ranks
        return target - self.membership.size()

    def _check_min(self, size: int, lost: list, why: str = "") -> None:
        if size < self.min_ranks:
            raise ProcessFailedError(f"rank(s) {', '.join(map(str, lost))} died; {size} left"
                                     f"{why}: fewer than --min-ranks {self.min_ranks}", lost)

    def step_completed(self) -> None:
        """After each completed step: the first one after a reset is timed (the record's
        ``next_step_s``, from the detection to the end of that step)."""
        rec, self._pending_next_step = self._pending_next_step, None
        if rec is not None:
            rec["next_step_s"] = round(time.time() - rec["detected_unix"], 4)

    def summary(self) -> dict[str, Any]:
        """For a run's summary: ``rank_failures``, ``failed_ranks``, ``fault_tolerance``,
        ``rank_joins`` (after a grow)."""
        out = {"rank_failures": self.failures,
               "failed_ranks": sorted(r for f in self.failures for r in f["dead_ranks"]),
               "fault_tolerance": "ulfm" if self.ulfm else "none"}
        return {**out, "rank_joins": self.joins} if self.joins else out

    def grow(self, failure: dict, *, spawner: int | None = None, groups: list | None = None,
             position=None) -> dict | None:
        """Grow back into the places the last reset or :meth:`absorb` emptied (``failure``, its
        record), where the front end grows on its own schedule: the parameter server's, whose
        server (rank ``spawner``) spawned the replacements alone while its workers trained
        (``groups``, :meth:`hpcasync.runtime.join.Spawned.take`, significant on the spawner).
        ``position``: the ``rank_joined`` record's (default the failure's). Collective over the
        survivors; returns the record, None if nobody joined (the spawner spawned nothing)."""
        want = self._want(self.size_before)
        return (self._grow(want, failure, spawner=spawner, groups=groups, position=position)
                if want > 0 else None)

    def _grow(self, want: int, failure: dict, *, spawner: int | None = None,
              groups: list | None = None, position=None) -> dict | None:
        """The survivors' side of a grow (module doc), right after the shrink and rebuild (or an
        absorption): ``want`` replacements (:meth:`_want`) spawned by every survivor at once, or
        by ``spawner`` alone (:meth:`grow`: its ``groups`` must refill every place, else
        :class:`~hpcasync.runtime.join.JoinError`), merged in; each takes a dead rank's place
        when the world returns to its size before the death (else the replacements come last);
        then the front end is rebuilt on the grown world (``membership.regrow``), the sync root
        (the spawner) at its place there. A collective spawn that fails on any survivor: the run
        goes on shrunk, with one warning line. A death or a replacement that never starts while
        growing ends the job with one line (not survived; ``HPCASYNC_JOIN_TIMEOUT``'s watchdog
        for a replacement that never merges). Returns the ``rank_joined`` record, None if not
        grown."""
        from mpi4py import MPI

        m = self.membership
        world, t0, before = m.comm, time.perf_counter(), self.size_before
        try:
            if spawner is None:
                with join._Watchdog(f"grow-back (spawning {want} replacement(s))",
                                    connect=False):
                    inter, error = join.spawn(world, want)
                if not world.allreduce(inter is not None, op=MPI.LAND):
                    if inter is not None:
                        inter.Free()
                    if m.rank() == 0:
                        log.warning("grow-back: spawning %d replacement(s) failed (%s); going on "
                                    "with %d ranks (Open MPI's launcher exits with status 213 at "
                                    "the end for the failed spawn)", want,
                                    error or "on another rank", m.size())
                    return None
                early = 0.0
            else:       # (the spawner warned already of a spawn that failed)
                n, early = world.bcast((sum(g[1] for g in groups), sum(g[2] for g in groups))
                                       if m.rank() == spawner else None, root=spawner)
                if n == 0:
                    return None
                if n != want:   # a worker's place fixes its shard and position: refill each one
                    raise join.JoinError(f"grow-back: {n} replacement(s) started for {want} "
                                         f"dead rank(s) (a spawn failed after another had "
                                         f"worked); resume from the last checkpoint")
            spawned = time.perf_counter()
            inject.point("grow")
            keys, joiner_keys, same = join._order(before, self.last_kept, m.size(), want)
            root = keys[_GROWN["root"] if spawner is None else spawner]   # its grown place
            original = [0] * (m.size() + want)
            ids = list(range(self.next_id, self.next_id + want))
            for k, r in [*zip(keys, self.original), *zip(joiner_keys, ids)]:
                original[k] = r
            msg = {"keys": joiner_keys, "survivor_keys": keys, "src": root,
                   "max_ranks": self.max_ranks, "original": original,
                   "next_id": self.next_id + want}
            if m.ps_rank is not None:       # a parameter server's world: where it serves
                msg["ps_rank"] = keys[m.ps_rank]
            if spawner is None:
                with join._Watchdog(f"grow-back (waiting for {want} replacement(s) to start)"):
                    merged = inter.Merge(high=False)
                    merged_at = time.perf_counter()
                    merged.bcast(msg, root=0)
                    grown = merged.Split(0, key=keys[m.rank()])
                merged.Free()
                inter.Free()
            else:           # the spawner's groups, each through a port of its own
                grown = join.connect(world, spawner, groups, {**msg, "ps_rank": root})
                merged_at = time.perf_counter()
            _GROWN["root"] = root
            self.original, self.next_id = original, self.next_id + want
            join.register_release()
            record = {"joined": ids, "ranks": joiner_keys, "world_size": grown.Get_size(),
                      "position": failure["position"] if position is None else position,
                      "same_places": same,
                      "spawn_s": round(early if spawner is not None else spawned - t0, 4),
                      "merge_s": round(merged_at - spawned, 4)}
            m.regrow(grown)
        except Exception as exc:       # noqa: BLE001 - a death while growing: not survived
            if not _mpi_error(exc):
                raise
            raise ProcessFailedError(f"grow-back: a rank died while growing from {m.size()} to "
                                     f"{self.max_ranks} ranks ({exc}); ending the job") from exc
        record["join_s"] = round(time.perf_counter() - t0 + early, 4)
        self.joins.append(record)
        self.check_pending = True
        return record


def furthest(keys: list) -> int:
    """The rank holding the largest key, the lowest among equals: a reset's sync root."""
    return max(range(len(keys)), key=lambda r: (keys[r], -r))


def _behind(p, q) -> int:
    """How far key ``p`` was behind ``q``: commits, or batches of one epoch (-1 across an epoch
    end)."""
    if not isinstance(p, tuple):
        return int(q - p)
    return int(q[1] - p[1]) if p[0] == q[0] else -1


#: a reset that found no rank dead since the last one: what failed was a communicator the reset
#: could not move (a user's own, or one made before the reset), and it would fail again each time
STALE_WORLD = ("a collective failed after a reset although no rank has died since: this job still "
               "uses a communicator of the world before the reset (MPI.COMM_WORLD, hpcasync.init's "
               "ctx, an hpcasync.optimizer not given to the State, or one made from them), which "
               "holds the dead rank: use the current world's (hpcasync.elastic: state.roles, e.g. "
               "hpcasync.average_metric(x, state.roles), and every optimizer in the State; "
               "hvd.elastic: hvd.allreduce)")


def elastic_run(ft: FaultTolerance | Callable[[Any], FaultTolerance]):
    """The retry loop as a decorator: ``func(state, ...)`` is called after ``state.sync()``;
    when a rank dies (ULFM) every survivor restores the last commit, the world is shrunk and
    rebuilt (:meth:`FaultTolerance.reset`), the reset callbacks run and ``func`` is called again.
    ``ft``: the object, or a function of the state returning it."""

    def decorate(func):
        @functools.wraps(func)
        def wrapper(state, *args, **kwargs):
            tol = ft(state) if callable(ft) and not isinstance(ft, FaultTolerance) else ft
            reset_required, grow = False, None
            joined = join.joined()
            if joined is not None and joined.pop("pending", False):
                # a replacement's first attempt: the survivors are in their reset, which runs
                # the reset callbacks and then syncs: the same calls, in the same order, here
                tol.check_pending = True
                state.on_reset()
            while True:
                if grow is not None:        # every survivor stopped for a grow-back
                    tol.membership.settle(tol.grow(tol.failures[-1], spawner=grow.spawner,
                                                   groups=grow.groups))
                    state.on_reset()
                elif reset_required:
                    tol.reset(getattr(state, "_commit_count", 0))
                    if not tol.failures[-1]["dead_ranks"]:    # (alike on every survivor)
                        raise ConfigError(STALE_WORLD)
                    state.on_reset()
                ok, result, grow = True, None, None
                try:
                    state.sync()
                    state._commit_count = tol.membership.bcast_object(
                        getattr(state, "_commit_count", 0))         # the root's, with its state
                    if tol.check_pending:
                        tol.check_pending = False
                        check_synced(tol.membership, state)
                    result = func(state, *args, **kwargs)
                except GrowInterrupt as stop:
                    ok, grow = False, stop
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


def sync_root() -> int:
    """The rank ``State.sync()`` broadcasts from: 0 before any reset; after one the lowest
    survivor holding the most commits (:meth:`FaultTolerance.reset`), after a grow that
    survivor's place (a replacement may hold a dead rank 0's)."""
    if "root" in _GROWN:
        return _GROWN["root"]
    joined = join.joined()
    return joined.get("src", 0) if joined is not None else 0


def check_synced(membership: Membership, state: "State") -> None:
    """After the first sync on a grown world: every rank's :func:`state_digest` against the
    root's (:func:`join.agree`: one line on every rank where a replacement holds other state)."""
    join.agree(membership.comm, state_digest(state), sync_root())


def rank_own_state(value) -> tuple[bool, Any]:
    """Whether ``value`` (a :class:`TorchState`'s object) holds, on this rank, state that is not
    the other ranks', and its ``local_state_dict()`` (None if it has none): replicas that differ
    now (``replicas_equal`` False: DASO inside a cycling epoch, local SGD between averages) or a
    part of its own (OD-SGD's local weights, the inner optimizer's state of local SGD, SlowMo
    and DiLoCo, PowerSGD's error memory)."""
    local = getattr(value, "local_state_dict", None)
    local = local() if callable(local) else None
    return local is not None or not getattr(value, "replicas_equal", True), local


def state_digest(state: "State") -> str:
    """:func:`join.digest` of what ``state`` holds: its handlers' state dicts (a rank's own part,
    under :data:`LOCAL_KEY`, left out) and its plain values."""
    return join.digest([{name: h.value.state_dict()
                         for name, h in getattr(state, "_handlers", {}).items()},
                        getattr(state, "_saved_state", {})])


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
    log.info("a rank died before the training loop began (%s): an elastic loop resets over "
             "the survivors, any other loop ends at its next collective", exc)
    return True


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
        self._commit_count = 0          # commits of this state (the sync root's after a sync)

    def default_bcast_object(self, obj):
        """The front end's broadcast of a picklable object from rank 0."""
        raise NotImplementedError

    def default_rank(self) -> int:
        raise NotImplementedError

    def _size(self) -> int:
        """The number of ranks now (the front end's)."""
        raise NotImplementedError

    def _allgather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (the front end's collective)."""
        raise NotImplementedError

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called (no arguments) after each reset, on the new world (smaller, or grown
        back: then on the replacements too, before their first sync)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (in memory, local: no communication), then :meth:`check_host_updates`."""
        self.save()
        self._commit_count += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """A no-op: there is no host discovery (ranks leave by dying and come back only by a
        grow-back inside the reset), so no ``HostsUpdatedInterrupt`` is ever raised and no
        broadcast is needed."""

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

    def snapshot(self):
        """A copy of the value's state now."""
        return copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self.saved = self.snapshot()

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        self._sync(self.value)


class ModelHandler(Handler):
    """A model: its parameters and buffers. ``restore`` also drops every parameter's gradient
    (``p.grad = None``): the step a death interrupted is redone from the commit, and what its
    backward had left (a loop that zeroes after ``step()``, a partial accumulation, a gradient
    half-reduced on the old world) must not add to the redone backward's. A process started
    afresh (a replacement, a restart from the commit on disk) holds no gradient either. It also
    brings back each module's mode (``train()``/``eval()``) of the commit: a death inside an
    evaluation would otherwise leave the model in ``eval()`` for the redone training (dropout
    off, BatchNorm on its running statistics), silently."""

    _taken: list | None = None

    def snapshot(self):
        self._taken = [m.training for m in self.value.modules()]
        return {k: v.detach().clone() for k, v in self.value.state_dict().items()}

    @property
    def saved(self):
        return self._saved

    @saved.setter
    def saved(self, snap) -> None:         # (the modes of the snapshot the commit keeps)
        self._saved, self._modes = snap, self._taken

    def restore(self) -> None:
        super().restore()
        for p in self.value.parameters():
            p.grad = None
        if self._modes is not None:
            for m, mode in zip(self.value.modules(), self._modes):
                m.training = mode


def _check_parameters_held(handlers: dict) -> None:
    """A one-line error where an optimizer of the state holds parameters that no model of the
    state holds: the commit keeps an optimizer's state, not the tensors it steps, so a death or
    a restart would roll its momentum back and leave those parameters where they were (a
    replacement's at its own initial values: the replicas apart), silently."""
    held = {id(t) for h in handlers.values() if isinstance(h.value, torch.nn.Module)
            for t in (*h.value.parameters(), *h.value.buffers())}
    for k, h in handlers.items():
        if isinstance(h.value, torch.optim.Optimizer):
            out = sum(id(p) not in held for g in h.value.param_groups for p in g["params"])
            if out:
                raise ConfigError(
                    f"elastic state: the optimizer {k!r} steps {out} tensor(s) that no model of "
                    "the state holds; a commit keeps the optimizer's state, not those tensors "
                    "(after a death they would not be rolled back or sent to a replacement): "
                    "pass the model too (State(model=model, optimizer=opt, ...); a module "
                    "under any keyword is tracked)")


def _check_plain(values: dict) -> None:
    """A one-line error for a torch sampler or data loader among the plain values: a plain value
    is broadcast from rank 0 by ``sync()`` (every rank would deal rank 0's shard, from the first
    call on) and is not dealt again over the survivors of a death."""
    for k, v in values.items():
        if isinstance(v, (torch.utils.data.Sampler, torch.utils.data.DataLoader)):
            raise ConfigError(
                f"elastic state: {k!r} is a {type(v).__name__}, which the state keeps as a plain "
                "value: sync() gives every rank rank 0's (rank 0's shard on every rank) and a "
                "death does not deal the epoch again over the survivors; use the elastic "
                "ElasticSampler and build the DataLoader inside the elastic function")


class TorchState(ObjectState):
    """The values a subclass's ``handler_for(value)`` gives a :class:`Handler` (models,
    optimizers, LR schedulers, elastic samplers), under any keyword, are saved as state dicts and
    synced from rank 0; the other keywords are plain values (:class:`ObjectState`: kept by
    reference, broadcast by ``sync()``; ``hvd.elastic``'s keeps a ``GradScaler`` so, as Horovod's). Checked when
    built: every optimizer's tensors are a model's of the state, and no torch sampler or data
    loader is a plain value."""

    def __init__(self, **kwargs):
        handlers = {k: h for k, h in ((k, self.handler_for(v)) for k, v in kwargs.items()) if h}
        _check_parameters_held(handlers)
        _check_plain({k: v for k, v in kwargs.items() if k not in handlers})
        object.__setattr__(self, "_handlers", handlers)
        for k, h in handlers.items():
            object.__setattr__(self, k, h.value)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in handlers})

    def handler_for(self, value) -> Handler | None:
        raise NotImplementedError

    def save(self) -> None:
        """All or nothing: every value's copy is taken before any is kept (an optimizer whose
        ``state_dict`` communicates may fail after the model's copy was taken)."""
        snapshots = [(h, h.snapshot()) for h in self._handlers.values()]
        for h, snap in snapshots:
            h.saved = snap
        super().save()

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self) -> None:
        if self._own_loaded:        # every rank loaded its own commit (persist): nothing to send
            self._own_loaded = False
            return
        for h in self._handlers.values():
            h.sync()
        super().sync()

    # -- restarts without ULFM: the commits on disk ------------------------------------------------
    _disk: tuple | None = None          # persist()'s (CheckpointManager, every)
    _own_loaded = False                 # persist() gave every rank its own commit

    def persist(self, directory, *, every: int = 1, keep: int = 3) -> bool:
        """Restarts without ULFM: write every ``every``-th commit to ``directory`` and load the
        newest one written there now, so that a job started again after a death (``hpcasync
        launch --max-restarts K -- loop.py``, a requeue, or by hand) goes on from it.

        Rank 0 writes its committed state (atomic and checksummed, the newest ``keep`` kept).
        Where a rank's state is its own (:func:`rank_own_state`: OD-SGD's local weights, local
        SGD's replicas between averages, PowerSGD's error memory, DASO inside a cycling epoch),
        every rank also writes its own commit, under ``DIR/rank-R``: a restart on as many ranks
        then gives each rank its own of the newest commit every rank wrote, and goes on as if
        nothing had died. On another number of ranks, or with no such commit, every rank goes on
        from rank 0's (said in one line), as a reset would. Rank 0 alone reads the newest commit
        and broadcasts it (one read of the file, not one a rank). Call it on every rank after
        the state is built and before ``train(state)`` (collective); a replacement spawned by a
        grow-back loads nothing (it gets the survivors' state at its first sync). Returns True
        when a commit was loaded::

            state = hpcasync.elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0)
            state.persist("ckpt", every=10)     # after a restart: the last commit written
        """
        from ..checkpoint import CheckpointManager

        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f"State.persist: every must be a whole number of commits >= 1, got "
                              f"{every!r}")
        disk = CheckpointManager(directory, keep=keep)
        self._disk = (disk, every)
        if join.is_joiner():
            return False
        found = self._newest_commit(disk)
        return found is not None and self._load_commit(*self._own_commit(*found))

    def _newest_commit(self, disk):
        """``disk.load_latest`` read by the broadcast's root alone and broadcast (collective);
        an error there is raised on every rank, in the same line."""
        from ..checkpoint import read_once

        return read_once(lambda: disk.load_latest(expect=self._disk_header()),
                         root=self._rank() == sync_root(), bcast=self._bcast_object,
                         what=f"State.persist: reading {disk.directory}")

    def _own_commit(self, path, header: dict, blob) -> tuple:
        """The commit this rank loads, given rank 0's newest (``path``): where commits have own
        files and were written by as many ranks, the newest commit of which every rank holds its
        own file (``header["own"]`` True; the files of later commits are removed: the run goes
        on from this one), else rank 0's newest on every rank. Collective in the first case."""
        from ..checkpoint import CheckpointError, CheckpointManager, read_checkpoint

        me, main = self._rank(), CheckpointManager(path.parent)
        if not header.get("own_files") or header.get("world_size") != self._size():
            if header.get("own_files") and me == 0:
                log.warning("elastic: %s was written by %s ranks, this job has %d: every rank "
                            "goes on from rank 0's state (not a replay of an undisturbed run)",
                            path, header.get("world_size"), self._size())
            return path, header, blob
        mine = main if me == 0 else CheckpointManager(self._own_dir(path.parent))
        held = self._allgather([p.name for p in mine.checkpoints()])
        pick = next((p.name for p in main.checkpoints() if all(p.name in h for h in held)), None)
        got = (header, blob) if me == 0 and pick == path.name else None    # (read already)
        if pick is not None and got is None:
            try:
                got = read_checkpoint(mine.directory / pick, expect=self._disk_header())
            except CheckpointError as exc:
                log.warning("elastic: rank %d: %s", me, exc)
            if got is not None and (got[0].get("world_size"), got[0].get("own_files")) != (
                    self._size(), True):        # (written before a reset shrank the world)
                got = None
        if not all(self._allgather(got is not None)):
            if me == 0:
                log.warning("elastic: no commit in %s of which every rank holds its own intact "
                            "file: every rank goes on from rank 0's newest, %s", path.parent,
                            path.name)
            return path, header, blob
        for p in mine.checkpoints():        # later commits (newest first): not every rank's
            if p.name == pick:
                break
            p.unlink(missing_ok=True)
        if me == 0 and pick != path.name:
            log.warning("elastic: %s is the newest commit every rank wrote its own file of",
                        pick)
        return main.directory / pick, {**got[0], "own": True}, got[1]

    def _check_mid_step(self) -> None:
        """One warning line (rank 0, once) for a commit between the backward passes of one
        step (an optimizer's ``passes_pending()``): a commit holds no gradient, so after a
        death the step is redone from it without the passes before it (a smaller gradient,
        silently)."""
        if TorchState._said_mid_step:
            return
        for h in self._handlers.values():
            pending = getattr(h.value, "passes_pending", None)
            n = pending() if callable(pending) else 0
            if n:
                TorchState._said_mid_step = True
                if self._rank() == 0:
                    log.warning("elastic: commit() after %d of the %d backward passes of a "
                                "step (backward_passes_per_step): a commit holds no gradient, "
                                "so after a death that step is redone without them; commit "
                                "after optimizer.step()", n, h.value.backward_passes_per_step)
                return

    def _check_schedulers(self) -> None:
        """One warning line (rank 0, once) where an LR scheduler drives an optimizer of the
        state (torch marks the optimizer's ``step`` when a scheduler is built on it) and no LR
        scheduler of that optimizer is in the state: a death rolls the optimizer's lr back to
        the commit, not the scheduler's count, so the lr goes on from a later point of its
        schedule (silently). Not seen: ``ReduceLROnPlateau`` (torch does not mark the step)."""
        if TorchState._said_scheduler:
            return
        TorchState._said_scheduler = True
        values = [h.value for h in self._handlers.values()]
        driven = {id(getattr(s, "optimizer", None)) for s in values
                  if isinstance(s, torch.optim.lr_scheduler.LRScheduler)}
        for k, h in self._handlers.items():
            if not isinstance(h.value, torch.optim.Optimizer):
                continue
            inner = getattr(h.value, "optimizer", None)     # an algorithm's wrapped optimizer
            marked = [o for o in (h.value, inner) if isinstance(o, torch.optim.Optimizer)
                      and hasattr(o.step, "_wrapped_by_lr_sched")]
            if marked and not any(id(o) in driven for o in (h.value, inner)):
                if self._rank() == 0:
                    log.warning("elastic: an LR scheduler was built on the optimizer %r and no "
                                "LR scheduler of it is in the state: after a death the lr goes "
                                "back to the commit's, the scheduler's count does not; pass it "
                                "too (State(..., scheduler=sched))", k)
                return

    def _own_dir(self, directory):
        return directory / f"rank-{self._rank()}"

    _said_mid_step = False
    _said_scheduler = False

    def commit(self) -> None:
        self._check_mid_step()
        self._check_schedulers()
        super().commit()
        if self._disk is not None and self._commit_count % self._disk[1] == 0:
            self._write_commit(self._disk[0])

    def _write_commit(self, disk, **header) -> None:
        """The commit just taken to ``disk``, named by the plain ``epoch`` value (if any) and the
        commit count (``header``: more header fields): rank 0's, and every other rank's own
        under ``rank-R`` where a rank's state is its own (:func:`rank_own_state`; its
        ``local_state_dict()`` is in the file too, loaded with ``load_local_state_dict``: a
        part a new process's ``load_state_dict`` leaves out, such as PowerSGD's error memory)."""
        from ..checkpoint import CheckpointManager

        parts = {k: rank_own_state(h.value) for k, h in self._handlers.items()}
        own = any(mine for mine, _ in parts.values())
        if self._rank() != 0:
            if not own:
                return
            disk = CheckpointManager(self._own_dir(disk.directory), keep=disk.keep)
        values, epoch = self._saved_state, self._saved_state.get("epoch")
        disk.save({"values": dict(values), "commits": self._commit_count,
                   "handlers": {k: h.saved for k, h in self._handlers.items()},
                   "local": {k: local for k, (_, local) in parts.items() if local is not None}},
                  epoch=epoch if isinstance(epoch, int) and epoch >= 0 else 0,
                  step=self._commit_count, world_size=self._size(), own_files=own,
                  **self._disk_header(), **header)

    def _load_commit(self, path, header: dict, blob) -> bool:
        theirs = sorted(blob.get("handlers", ())) if isinstance(blob, dict) else None
        if theirs != sorted(self._handlers):
            raise ConfigError(f"State.persist: {path} is not a commit of this state (its objects "
                              f"{theirs}, this state's {sorted(self._handlers)})")
        for k, h in self._handlers.items():
            h.saved = blob["handlers"][k]
            h.restore()
            if header.get("own") and k in blob.get("local", {}):
                h.value.load_local_state_dict(blob["local"][k])
        self._saved_state = {**self._saved_state, **blob["values"]}
        self._set_attrs()
        self.save()
        self._commit_count = blob["commits"]
        self._own_loaded = bool(header.get("own"))
        if self._rank() == 0:
            log.info("elastic: resuming from %s (commit %d, written by %s ranks%s)", path,
                     blob["commits"], header.get("world_size") or "?",
                     "; each rank its own" if header.get("own") else "")
        return True

    def _disk_header(self) -> dict:
        """What a commit on disk must match to be loaded (one-line error otherwise)."""
        model = self._handlers.get("model")
        return {"algorithm": "state",
                "model": type(model.value).__name__ if model is not None else "State"}

    def __setattr__(self, name, value):
        if name in self.__dict__.get("_handlers", {}):
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)
