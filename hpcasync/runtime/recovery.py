"""A synchronous CLI run keeps training through a dead rank (ULFM), without a restart.

Synchronous replicas are bitwise identical, so a dead replica loses nothing but its share of the
step in flight. The run's world is a :class:`SyncWorld`, a :class:`~.elastic.Membership` of the
one fault-tolerance core (:class:`~.elastic.FaultTolerance`, which your own loop and
``hvd.elastic`` run on too). On a process failure (``MPI_ERR_PROC_FAILED``, or a revoked
communicator) every survivor, from the ``except`` of its step::

    if not ft.report_error(exc):    # revoke every communicator: the others fail too
        raise
    ft.reset(cur.position)          # shrink, adopt the furthest survivor's state, grow back

The reset shrinks the world (the survivors keep their order), and in its atomic attempt the
survivor furthest on (the largest position ``(epoch, batches done, started)``, the lowest rank
among equals: the sync root) broadcasts its live state, which every survivor loads; the topology
is rebuilt on the survivors (:meth:`hpcasync.topology.Topology.shrunk`: each keeps its node, nodes
may become uneven). No commit is copied: a rank whose last collective succeeded holds a correct
step (an optimizer undoes what a failed step began), so nothing is lost but the step nobody
finished, which is redone. Then the ``rank_failed`` record, the metrics stream handed over if its
writer died, a grow-back (``--grow-back``: replacements in the dead ranks' places, the live state
sent to them and checked, :mod:`hpcasync.runtime.join`), and the data cursor moved
(:meth:`EpochCursor.adopt`: the rest of the epoch re-sharded over the world). Without ULFM nothing
here runs: the launcher ends the job and the checkpoint-and-resume path is the recovery.
Design: docs/design/recovery.md.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from .. import inject
from ..comm.objects import bcast_object
from . import join
from .elastic import FaultTolerance, Membership, sync_root
from .logs import setup_logging

log = logging.getLogger("hpcasync")


class SyncWorld(Membership):
    """The world of a CLI run of a synchronous family (module doc): ``ctx.topo``.

    Args:
        ctx: the run's :class:`~hpcasync.runtime.context.RunContext` (its ``topo`` is replaced
            by a reset; ``metrics`` and ``history`` are kept consistent).
        state: ``state()`` returns what ``load(obj)`` restores (the sync root's is broadcast,
            with the epoch history; ``position`` is the root's while it runs). ``load`` runs
            after ``ctx.topo`` is the survivors' and may be collective over it.
        adopt: ``adopt(same)`` moves the data cursor onto the world the reset ends on (``same``:
            a grow gave every rank its place of the world before the death).
        payload, check: what a replacement gets (:func:`~.join.live_state`) and what every rank
            then holds alike (:func:`~.join.agree`).
        comms: more communicators the run may be blocked on (revoked after a failure).
        refill_only: grow back only into the places a death emptied (DASO: the epoch's plan
            fixes each rank's shard and the batch count).
    """

    def __init__(self, ctx, *, state: Callable[[], Any], load: Callable[[Any], None],
                 adopt: Callable[[bool], None], payload: Callable[[], dict],
                 check: Callable[[], Any], comms: Callable[[], tuple] = tuple,
                 refill_only: bool = False):
        self.ctx, self.state, self.load, self.adopt = ctx, state, load, adopt
        self.payload, self.check, self.extra = payload, check, comms
        self.refill_only = refill_only
        self.position: tuple = ()
        self._before = ctx.topo

    @property
    def comm(self):
        return self.ctx.topo.world

    def comms(self) -> list:
        t = self.ctx.topo
        return [c for c in (t.world, t.local, t.glob, *self.extra()) if c is not None]

    def check_reset(self) -> None:
        self._before = self.ctx.topo

    def rebuild(self, new) -> None:
        """The root's state and epoch history on every survivor, the topology over them."""
        ctx, src = self.ctx, sync_root()
        self.position = tuple(self.commits[src])
        blob, history = bcast_object(new, (self.state(), ctx.history) if new.Get_rank() == src
                                     else None, src, copy=True)
        inject.point("recovery")
        ctx.topo = self._before.shrunk(new)
        self.load(blob)
        self.adopted = self.position        # (reported by this rank if another attempt begins)
        ctx.history.extend(history[len(ctx.history):])    # epoch ends the root had done
        # testing hook: a failure after the attempt's last collective, on one rank only (the
        # others completed it: only the agreement sends them into another attempt)
        inject.point("recovered")

    def shrunk(self, record: dict) -> None:
        """The metrics stream handed over if its writer died (the new rank 0 appends to the
        ``.partial`` file), epoch ends it had not recorded, the ``rank_failed`` record."""
        ctx, m = self.ctx, self.ctx.metrics
        if ctx.topo.rank == 0 and not m.enabled and getattr(m, "requested", False):
            m.reopen_append()
            first = record["survivors"][0]
            setup_logging(first, report_rank=first)
            log.warning("rank %d takes over the metrics stream and the log (rank 0 died)", first)
        for r in ctx.history:
            if r["epoch"] not in m.epochs:
                m.write("epoch", **r)
        m.write("rank_failed", **record)
        super().shrunk(record)

    def regrow(self, grown) -> None:
        self.ctx.topo = join._topology(grown, self.ctx.cfg, self._before.ps_rank)
        join._joined.setdefault("grew", True)       # (freed before MPI_Finalize: join.release)

    def settle(self, grew: dict | None) -> None:
        """The cursor onto the world; after a grow, the ``rank_joined`` record, the stream to a
        replacement in rank 0's place, the live state to the replacements, checked."""
        ctx = self.ctx
        self.adopt(bool(grew and grew["same_places"]))
        if grew:
            m, world, src = ctx.metrics, ctx.topo.world, sync_root()
            m.write("rank_joined", **grew)
            if m.enabled and ctx.topo.rank != 0:    # a replacement is rank 0: it takes the
                m.close(complete=False)             # stream and the log over
                m.enabled = False
                setup_logging(ctx.topo.rank, report_rank=0)
            bcast_object(world, {**self.payload(), "record": grew} if world.Get_rank() == src
                         else None, src)
            join.agree(world, self.check(), src)
        super().settle(grew)


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
        self.moved = False          # the plan is a recovery's (re-sharded or kept), not a start's
        self.resumed_shards = None  # a checkpoint's moved plan, taken by the next begin_epoch

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
        if self.resumed_shards is not None:     # resumed inside an epoch a recovery moved
            self.plan = EpochShards.__new__(EpochShards)
            self.plan.shards, self.resumed_shards, self.moved = self.resumed_shards, None, True
        else:
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
        self.moved = False

    def plan_state(self) -> dict:
        """For a checkpoint inside the epoch (every rank): this rank's loss sum and the count of
        the epoch's losses (more than the plan's batches done after a recovery), and the plan
        when a recovery moved it (``shards``), so that a resume trains the rest of this plan,
        not a fresh one's (:meth:`resume_plan`)."""
        moved = {"shards": self.plan.shards} if self.moved and self.plan is not None else {}
        return {"loss_sum": self.loss_sum, "loss_n": self.loss_n, **moved,
                "batch_size": self.ctx.cfg.batch_size, "train_size": len(self.ctx.train),
                "data_seed": self.ctx.cfg.seed}

    def resume_plan(self, state: dict) -> None:
        """Where a checkpoint inside an epoch left this rank (:meth:`plan_state`): its own loss
        sum, the loss count and the moved plan, which the next :meth:`begin_epoch` takes. A
        checkpoint of another world size (``WRITTEN_SIZE``) inside an epoch: the rest of that
        epoch's plan re-sharded over this run's ranks (as after a death), each rank's loss sum
        the mean of the writers'."""
        from ..errors import CheckpointError
        from .context import WRITTEN_SIZE

        shards, sums, size = state.get("shards"), state.get("loss_sums"), self.ctx.topo.size
        was = state.get(WRITTEN_SIZE, size)
        if was != size:
            self._resume_resized(state, was)
            return
        if shards is not None and len(shards) != size:
            raise CheckpointError(f"checkpoint's epoch plan has {len(shards)} shards, this run "
                                  f"has {size} ranks")
        self._check_same_data(state)
        self.resumed_shards = shards
        self.loss_n = state.get("loss_n", self.loss_n)
        if sums is not None and len(sums) == size:
            self.loss_sum = sums[self.ctx.topo.rank]

    def _check_same_data(self, state: dict) -> None:
        """A checkpoint inside an epoch goes on with the rest of that epoch's batches: the same
        batch size, training set and seed, else one line."""
        from ..errors import CheckpointError

        was = (state.get("batch_size"), state.get("train_size"), state.get("data_seed"))
        now = (self.ctx.cfg.batch_size, len(self.ctx.train), self.ctx.cfg.seed)
        if was[0] is not None and was != now:     # the rest of the epoch: other batches
            raise CheckpointError(
                f"checkpoint was written inside epoch {state.get('epoch')} (batch "
                f"{state.get('batch')}) with --batch-size {was[0]} over {was[1]} training "
                f"examples, --seed {was[2]}; this run has --batch-size {now[0]} over {now[1]}, "
                f"--seed {now[2]}: the rest of that epoch would be other batches; resume with "
                "the same --batch-size, --train-limit and --seed, or from a checkpoint at an "
                "epoch's end")

    def _resume_resized(self, state: dict, was: int) -> None:
        from ..data import EpochShards

        self._check_same_data(state)
        size, done = self.ctx.topo.size, self.done
        if self.ctx.topo.rank == 0:
            log.warning("resumed on %d ranks from a checkpoint written by %d%s", size, was,
                        f": the rest of epoch {self.epoch} ({done} of its batches done) re-sharded "
                        f"over {size}" if done else "")
        if not done:                    # an epoch's end: the next plan is this world's
            return
        cfg, shards = self.ctx.cfg, state.get("shards")
        if shards is not None:          # a plan a recovery had moved
            plan = EpochShards.__new__(EpochShards)
            plan.shards = shards
        else:
            plan = EpochShards(len(self.ctx.train), num_shards=was, seed=cfg.seed, epoch=self.epoch)
        self.resumed_shards = plan.reshard(done, size, cfg.batch_size).shards
        self.done = 0
        sums = state.get("loss_sums")
        self.loss_n = state.get("loss_n", self.loss_n)
        if sums:
            self.loss_sum = sum(sums) / len(sums)

    def adopt(self, adopted: tuple, *, keep: list[int] | None = None,
              size_before: int | None = None) -> None:
        """Go to the position a recovery adopted, the same plan on every survivor. An epoch no
        one has trained a batch of (batches done 0: e.g. survivors on both sides of an epoch
        end) starts afresh over the (new) world. The rest of a started epoch is re-sharded over
        the world; a rank that has no plan for it (it was behind, before that epoch's start)
        first makes the plan the others made, over the world of ``size_before`` ranks (the size
        before the reset, :attr:`~.elastic.FaultTolerance.size_before`). ``keep`` (the
        survivors' ranks in the old world, :attr:`~.elastic.FaultTolerance.last_kept`): do
        not re-shard — each survivor
        finishes the epoch on its own shard, the dead ranks' rest is skipped (DASO, whose
        schedule needs the epoch's batch count fixed)."""
        self.started, self.resumed_shards = 1, None
        epoch, done = adopted[0], adopted[1]
        if done == 0 or epoch != self.epoch or self.plan is None:
            self.plan, self.loss_sum, self.loss_n = None, 0.0, 0
            self.epoch, self.done, self.moved = epoch, 0, False
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
        self.moved = True


def fault_tolerance(ctx, world: SyncWorld, *, enabled: bool = True) -> FaultTolerance:
    """The core over ``world`` with the run's ``--grow-back``, ``--max-ranks`` and
    ``--min-ranks`` (``enabled``: the runtime can recover at all, e.g. not with Horovod)."""
    from .ft import ulfm_enabled

    o = ctx.cfg.options
    return FaultTolerance(world, ulfm=enabled and ulfm_enabled(),
                          grow_back=bool(o.get("grow_back")),
                          max_ranks=o.get("max_ranks") or ctx.topo.size,
                          min_ranks=o.get("min_ranks"))
