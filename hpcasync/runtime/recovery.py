"""A synchronous runtime keeps training through a dead rank (ULFM), without a restart.

Synchronous replicas are bitwise identical, so a dead replica loses nothing but its share of the
step in flight. Under Open MPI's ULFM (``mpirun --with-ft ulfm``, :func:`~.ft.ulfm_enabled`) a
collective that involves a dead process raises ``MPI_ERR_PROC_FAILED`` on some ranks; the others
may already be one step further, or blocked in the next collective. :meth:`SyncRecovery.recover`,
called on every survivor from the ``except`` of its step:

1. **revoke** the world communicator (``MPI_Comm_revoke``: every rank still blocked on it, or
   entering a call on it, gets ``MPI_ERR_REVOKED`` and comes here too);
2. **shrink** it (``MPI_Comm_shrink``: an agreement on who is alive; the survivors keep their
   order, so the lowest surviving rank becomes rank 0);
3. **adopt the most advanced state**: the survivors allgather their positions ``(epoch, batches
   done)``; the most advanced one (lowest rank among equals) broadcasts its state — model,
   optimizer, position, epoch history — and every survivor loads it. A rank whose last collective
   succeeded holds a correct step (MPI: a call that returns success left correct results on that
   rank), so nothing computed is thrown away but the step nobody finished, which is redone;
4. **rebuild the topology** on the shrunk world (:meth:`hpcasync.topology.Topology.shrunk`: each
   survivor stays on its node with that node's other survivors; nodes may become uneven) and
   re-shard the rest of the epoch over the survivors (:class:`~hpcasync.data.sharding.EpochShards`);
5. hand the metrics stream over when its writer died (the new rank 0 appends to ``.partial``) and
   write a ``rank_failed`` record: who died (original world ranks), when, what the recovery cost.

A death during the recovery itself (in the broadcast after the shrink) is one more failure: the
steps repeat on the shrunk communicator. The loop of attempts is the fault-tolerance core's
(:func:`hpcasync.runtime.elastic.atomic_shrink`, which the elastic reset and the PS takeover run
too); this module gives it steps 2-4 and the bookkeeping of each shrink. Without ULFM nothing
here runs: the launcher ends the job and the checkpoint-and-resume path (``--checkpoint-dir``,
``--resume auto``) is the recovery.

Example (the shape of :mod:`hpcasync.ssgd.runtime`'s loop)::

    rec = SyncRecovery(ctx, enabled=ft.ulfm_enabled())
    while not done:
        try:
            step()
        except Exception as exc:
            if not rec.handles(exc):
                raise
            state = rec.recover(position=(epoch, i), state=lambda: snapshot(), load=restore)
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from .. import inject
from ..errors import ProcessFailedError, proc_failure  # noqa: F401 (re-exported)
from .elastic import agreed, atomic_shrink, is_process_failure  # noqa: F401 (agreed re-exported)
from .ft import _ranks_in

log = logging.getLogger("hpcasync")


class SyncRecovery:
    """Survive dead ranks in a synchronous runtime (see the module doc).

    Args:
        ctx: the run's :class:`~hpcasync.runtime.context.RunContext` (its ``topo`` is replaced
            after a recovery; ``metrics``, ``history`` and ``steps`` are kept consistent).
        enabled: ULFM is on (otherwise :meth:`handles` is always False and errors propagate).

    Attributes: ``failures`` (one dict per recovery, as in the ``rank_failed`` records),
    ``original`` (the original world rank of each rank of the current world), ``last_kept``
    and ``size_before`` (the survivors' ranks in, and the size of, the world before the last
    recovery), ``position`` (during a recovery: this rank's, the adopted one once loaded),
    ``min_ranks`` (fewer survivors end the run: :class:`~hpcasync.errors.ProcessFailedError`).
    """

    def __init__(self, ctx, *, enabled: bool):
        self.ctx, self.enabled = ctx, bool(enabled)
        self.last_kept: list[int] = []      # the survivors' ranks in the world before a recovery
        self.original = list(range(ctx.topo.size))
        self.failures: list[dict[str, Any]] = []
        self._pending_next_step: dict | None = None
        self._t0 = time.time()
        self.min_ranks = 1
        self.position: tuple = ()
        self.size_before = ctx.topo.size

    def handles(self, exc: BaseException) -> bool:
        """True when ``exc`` is a process failure this object recovers from: ULFM's error
        classes, or ``MPI_ERR_IN_STATUS`` (a test/wait over several requests, e.g. the pieces of
        a chunked nonblocking allreduce) or ``MPI_ERR_OTHER`` (Open MPI 5's barrier on a rank
        that enters it late, after a peer died and another revoked: "known error not in list")
        while the world knows of a dead process or one of our communicators is revoked."""
        if not self.enabled:
            return False
        topo = self.ctx.topo
        return is_process_failure(exc, topo.world, (topo.world, topo.local, topo.glob))

    def recover(self, *, position: tuple, state: Callable[[], Any],
                load: Callable[[Any], None], revoke=()) -> tuple:
        """Revoke, shrink, adopt the most advanced survivor's state, rebuild the topology, agree.

        ``position`` is this rank's progress (comparable tuples; larger = further); ``state()``
        returns what ``load(obj)`` restores (pickled and broadcast from the most advanced rank,
        with its epoch history: epoch ends it finished are taken into ``ctx.history`` and
        written to the metrics stream if its writer has not recorded them). ``load`` runs after
        ``ctx.topo`` is the survivors' topology and may be collective over it.
        ``revoke``: more communicators the runtime uses, or a function returning them (revoked
        first, so that a survivor blocked on one of them wakes up, and again when an attempt
        fails). Returns the adopted position. Collective over the survivors.

        Atomic (docs/design/recovery.md): each attempt ends in ``MPI_Comm_agree`` on whether
        every survivor completed it; a death inside an attempt (an MPI error, or the agreement
        reporting a failure) starts a new one on a fresh shrink, so every survivor returns from
        the same attempt with the same topology, position and state."""
        detected = time.time()
        t0 = time.perf_counter()
        topo = self.ctx.topo
        self.position = tuple(position)
        lost_all, track = [], {"index": list(range(topo.size)), "original": self.original}
        self.size_before = topo.size

        def on_shrink(world, new) -> None:      # who is left, in original and old numbering
            kept, original = _kept(world, new), track["original"]
            lost_all.extend(original[r] for r in range(world.Get_size()) if r not in kept)
            track["original"] = [original[r] for r in kept]
            track["index"] = [track["index"][r] for r in kept]
            if new.Get_size() < self.min_ranks:
                raise ProcessFailedError(
                    f"rank(s) {', '.join(map(str, sorted(lost_all)))} died; {new.Get_size()} "
                    f"left, fewer than the {self.min_ranks} this run needs", sorted(lost_all))

        def attempt(new) -> tuple:
            positions = new.allgather(self.position)
            src = max(range(len(positions)), key=lambda r: (positions[r], -r))
            blob, history = new.bcast((state(), self.ctx.history)
                                      if new.Get_rank() == src else None, root=src)
            inject.point("recovery")
            self.ctx.topo = topo.shrunk(new)
            load(blob)
            self.position = tuple(positions[src])      # this rank now holds that state
            self.ctx.history.extend(history[len(self.ctx.history):])   # ends it had done
            # testing hook: a failure after the attempt's last collective, on one rank only
            # (the others completed it: only the agreement sends them into another attempt)
            inject.point("recovered")
            return positions, src

        # (recover runs in an except: a failed attempt is an MPI failure itself, not its context)
        new, (positions, src), attempts = atomic_shrink(
            topo.world, attempt, on_shrink=on_shrink, failed=_mpi_failure,
            first_revoke=(*(revoke() if callable(revoke) else revoke), topo.world),
            # wake whoever waits on a failed attempt's communicators
            revoke=lambda new: (new, self.ctx.topo.local, self.ctx.topo.glob,
                                *(revoke() if callable(revoke) else ())),
            max_attempts=topo.size,     # (each attempt that fails needs one more death)
            exhausted=lambda n: ProcessFailedError(f"recovery did not complete in {n} attempts",
                                                   sorted(lost_all)))
        original, index = track["original"], track["index"]
        self.original, self.last_kept = original, index
        took = time.perf_counter() - t0
        record = {"dead_ranks": sorted(lost_all), "world_size": new.Get_size(),
                  "survivors": list(self.original), "detected_at_s": round(detected - self._t0, 4),
                  "detected_unix": round(detected, 4), "recovery_s": round(took, 4),
                  "position": list(positions[src]), "adopted_from": self.original[src],
                  "steps_behind": [_behind(p, positions[src]) for p in positions],
                  "attempts": attempts, "next_step_s": None}
        self.failures.append(record)
        self._pending_next_step = record
        self._hand_over_metrics()
        m = self.ctx.metrics
        for r in self.ctx.history:          # epoch ends the stream's writer had not recorded
            if r["epoch"] not in m.epochs:
                m.write("epoch", **r)
        m.write("rank_failed", **record)
        if self.ctx.topo.rank == 0:
            log.warning("rank(s) %s died; going on with %d ranks (recovered in %.3f s, from the "
                        "state of rank %d at %s)", ", ".join(map(str, sorted(lost_all))),
                        new.Get_size(), took, self.original[src], tuple(positions[src]))
        return positions[src]


    def step_completed(self) -> None:
        """Call after each completed step: the first one after a recovery is timed (the record's
        ``next_step_s``, from the detection to the end of that step)."""
        rec = self._pending_next_step
        if rec is not None:
            self._pending_next_step = None
            rec["next_step_s"] = round(time.time() - rec["detected_unix"], 4)

    def summary(self) -> dict[str, Any]:
        """For the run's summary: ``rank_failures`` (the records) and ``failed_ranks``."""
        return {"rank_failures": self.failures,
                "failed_ranks": sorted(r for f in self.failures for r in f["dead_ranks"]),
                "fault_tolerance": "ulfm" if self.enabled else "none"}

    def _hand_over_metrics(self) -> None:
        """The metrics stream and the INFO log live on rank 0; if the old rank 0 died, the new
        one appends to the stream (same file system, as the checkpoints' directory)."""
        m = self.ctx.metrics
        if self.ctx.topo.rank != 0 or m.enabled or not getattr(m, "requested", False):
            return
        m.reopen_append()
        from .logs import setup_logging

        setup_logging(self.original[0], report_rank=self.original[0])
        log.warning("rank %d takes over the metrics stream and the log (rank 0 died)",
                    self.original[0])


class EpochCursor:
    """Where a synchronous loop is — ``(epoch, batches done, started)`` — and which examples each
    rank trains on this epoch (:class:`~hpcasync.data.sharding.EpochShards` over the current
    world). A step advances ``done``, an epoch end ``epoch``; :meth:`adopt` moves to the position
    a recovery adopted and re-shards the rest of the epoch over the survivors.

    Example::

        cur = EpochCursor(ctx, epoch=start_epoch, done=start_batch, loss_sum=loss_carry)
        while not cur.finished:
            if cur.begin_epoch():
                ...                                    # per-epoch counters
            if cur.in_epoch:
                x, y = cur.batch(device)
                ...                                    # forward, backward, step
                cur.step_done(loss.item())
            else:
                ...                                    # evaluate (cur.train_loss(comm))
                cur.next_epoch()
    """

    def __init__(self, ctx, *, epoch: int = 1, done: int = 0, loss_sum: float = 0.0):
        self.ctx, self.epoch, self.done, self.started = ctx, epoch, done, 0
        self.loss_sum, self.loss_n = loss_sum, done
        self.plan = None

    @property
    def position(self) -> tuple:
        return (self.epoch, self.done, self.started)

    @property
    def finished(self) -> bool:
        return self.epoch > self.ctx.cfg.epochs

    def start(self, setup) -> None:
        """Run ``setup()`` (the start-up broadcast) once, at the first position; a death there
        is a failure like any other (``startup`` kill point)."""
        if not self.started:
            inject.point("startup")
            setup()
            self.started = 1

    def begin_epoch(self) -> bool:
        """Make this epoch's plan if there is none yet (over the current world); True if made."""
        if self.plan is not None:
            return False
        from ..data import EpochShards

        cfg = self.ctx.cfg
        self.plan = EpochShards(len(self.ctx.train), num_shards=self.ctx.topo.size,
                                seed=cfg.seed, epoch=self.epoch)
        self.ctx.progress.start(self.nbatches - self.done, f"epoch {self.epoch}/{cfg.epochs}")
        return True

    @property
    def nbatches(self) -> int:
        return self.plan.num_batches(self.ctx.cfg.batch_size)

    @property
    def in_epoch(self) -> bool:
        return self.done < self.nbatches

    def batch(self, device):
        """This rank's next batch ``(x, y)`` on ``device``."""
        b, data = self.ctx.cfg.batch_size, self.ctx.train
        idx = self.plan.shards[self.ctx.topo.rank][self.done * b:(self.done + 1) * b]
        return (data.images.index_select(0, idx).to(device, non_blocking=True),
                data.labels.index_select(0, idx).to(device, non_blocking=True))

    def backward(self, model, opt, delay, device):
        """This rank's next batch through ``model`` and backward, between ``opt.zero_grad()``
        and the heterogeneity delay (``delay``: a straggler sleeps after its compute, so the
        collective that follows waits for it); returns the loss. The caller steps."""
        model.train()
        x, y = self.batch(device)
        opt.zero_grad()
        delay.begin()
        loss = self.ctx.loss_fn(model(x), y)
        loss.backward()
        delay.end(opt.steps)
        return loss

    def step_done(self, loss: float) -> None:
        self.done += 1
        self.loss_sum += self.ctx.step_done(self.epoch, self.done, loss)
        self.loss_n += 1

    def train_loss(self, comm) -> float:
        """The mean over ranks of each rank's mean step loss this epoch."""
        from .context import mean_over

        return mean_over(comm, self.loss_sum / max(1, self.loss_n))

    def next_epoch(self) -> None:
        self.epoch, self.done, self.loss_sum, self.loss_n, self.plan = \
            self.epoch + 1, 0, 0.0, 0, None

    def adopt(self, adopted: tuple, *, keep: list[int] | None = None,
              size_before: int | None = None) -> None:
        """Go to the position a recovery adopted, the same plan on every survivor. An epoch no
        one has trained a batch of (batches done 0: e.g. survivors on both sides of an epoch
        end) starts afresh over the (new) world. The rest of a started epoch is re-sharded over
        the world; a rank that has no plan for it (it was behind, before that epoch's start)
        first makes the plan the others made, over the world of ``size_before`` ranks (the size
        before the recovery, :attr:`SyncRecovery.size_before`). ``keep`` (the survivors' ranks
        in the old world, :attr:`SyncRecovery.last_kept`): do not re-shard — each survivor
        finishes the epoch on its own shard, the dead ranks' rest is skipped (DASO, whose
        schedule needs the epoch's batch count fixed)."""
        self.started = 1
        epoch, done = adopted[0], adopted[1]
        if done == 0 or epoch != self.epoch or self.plan is None:
            self.plan, self.loss_sum, self.loss_n = None, 0.0, 0
            self.epoch, self.done = epoch, 0
            if done == 0:
                return                  # begin_epoch makes the plan over the new world
            from ..data import EpochShards

            self.plan = EpochShards(len(self.ctx.train), seed=self.ctx.cfg.seed, epoch=epoch,
                                    num_shards=size_before or self.ctx.topo.size)
        if keep is not None:
            self.plan.shards = [self.plan.shards[k] for k in keep]
            self.done = done
        else:
            self.plan = self.plan.reshard(done, self.ctx.topo.size, self.ctx.cfg.batch_size)
            self.done = 0


def _mpi_failure(exc: BaseException) -> bool:
    """``exc`` itself reports dead processes or a revoked communicator (ULFM's classes)."""
    from mpi4py import MPI

    codes = {getattr(MPI, n, None) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                             "ERR_REVOKED")} - {None}
    return isinstance(exc, ProcessFailedError) or (isinstance(exc, MPI.Exception)
                                                   and exc.Get_error_class() in codes)


def _kept(old, new) -> list[int]:
    """Ranks of ``old`` that are in ``new`` (the shrink keeps their order)."""
    return _ranks_in(new.Get_group(), old)


def _behind(p: tuple, q: tuple) -> int:
    """How many batches position ``p`` was behind ``q`` (0, 1, or -1 across an epoch end)."""
    if p[0] == q[0]:
        return int(q[1] - p[1])
    return -1
