"""``hpcasync train --algorithm daso``: DASO (see :mod:`hpcasync.daso`) in the one synchronous loop.

:class:`Daso` is the family of :mod:`hpcasync.runtime.driver`'s loop: SSGD's with
:class:`hpcasync.daso.DASO` in place of the ``DistributedOptimizer``, plus
``opt.epoch_end(loss)`` once per epoch, whose record (phase, knobs
gs/ls/B, seconds waiting on global messages, bytes) goes into the epoch's metrics. At the end every
rank hashes its parameters and buffers; the summary records ``replicas_identical`` and the hash.

Checkpoints (``--checkpoint-dir``, ``--resume``) and preemption are handled at epoch ends only,
where every replica — parameters, buffers and optimizer state — is identical, so rank 0's state is
the job's; a preemption signal is acted upon at the next epoch end.

Heterogeneity (``--hetero``, ``--straggler``, ``--compute-time``, ``--push-delay``) works as in
SSGD (:class:`~hpcasync.hetero.StepDelay`): a slow rank sleeps after its forward/backward,
so the node-local average (and any blocking global one) waits for it.

``--backend horovod`` runs the node-local gradient averages through Horovod initialised on the
node-local communicator (``hvd.init(comm=topo.local)``); the global part is always our own MPI.

Example::

    mpiexec -n 4 hpcasync train --algorithm daso --ranks-per-node 2 --dataset fashion-mnist \\
        --model lenet --epochs 4 --daso-warmup-epochs 1 --daso-cooldown-epochs 1
"""
from __future__ import annotations

import logging

from .. import inject
from ..comm import DASO_CHUNK_ELEMS
from . import DasoSchedule, LinkDelay
from ..errors import CheckpointError, ConfigError
from ..hetero import check_options as check_hetero
from ..ssgd.horovod import check_backend
from ..checkpoint import PER_RANK, own_part
from ..runtime import driver, join
from ..runtime.context import WRITTEN_SIZE, RunContext, RunResult, max_over
from .options import add_arguments  # noqa: F401 (the runtime's options)
from .schedule import CYCLING

log = logging.getLogger("hpcasync")

# option (dest) -> DASO constructor argument, with the CLI defaults
OPTIONS = {
    "daso_warmup_epochs": ("warmup_epochs", 4),
    "daso_cooldown_epochs": ("cooldown_epochs", 4),
    "daso_global_skip": ("global_skip", 4),
    "daso_local_skip": ("local_skip", 1),
    "daso_batches_to_wait": ("batches_to_wait", 1),
    "daso_max_global_skips": ("max_global_skips", 8),
    "daso_plateau_patience": ("plateau_patience", 3),
    "daso_plateau_threshold": ("plateau_threshold", 0.05),
    "daso_cast": ("cast", "bf16"),
    "daso_chunk_elems": ("chunk_elems", DASO_CHUNK_ELEMS),
    "daso_link_delay_us_per_mb": ("link_delay_us_per_mb", 0.0),
}


def daso_kwargs(cfg) -> dict:
    """The DASO constructor arguments from ``cfg.options`` (defaults for missing options)."""
    return {arg: cfg.options.get(dest, default) for dest, (arg, default) in OPTIONS.items()}


def validate(cfg) -> None:
    """Pre-MPI checks: every knob through the same validation the classes use."""
    kw = daso_kwargs(cfg)
    check_hetero(cfg.options)
    DasoSchedule(total_epochs=cfg.epochs, num_groups=1,
                 **{k: kw[k] for k in ("warmup_epochs", "cooldown_epochs", "global_skip",
                                       "local_skip", "batches_to_wait", "max_global_skips",
                                       "plateau_patience", "plateau_threshold")})
    if kw["cast"] not in ("none", "bf16", "fp16"):
        raise ConfigError(f"--daso-cast must be none, bf16 or fp16, got {kw['cast']!r}")
    if not isinstance(kw["chunk_elems"], int) or kw["chunk_elems"] < 1:
        raise ConfigError(f"--daso-chunk-elems must be a positive integer, "
                          f"got {kw['chunk_elems']!r}")
    LinkDelay(kw["link_delay_us_per_mb"])
    check_backend(cfg.backend)
    join.validate(cfg)


class Daso(driver.Family):
    """DASO in the driver's loop. After a death the survivors stay on their nodes (a node that
    lost a rank goes on smaller: uneven nodes) and adopt the furthest position; in a blocking
    epoch they adopt its replica, in a cycling one they average theirs. ``--grow-back``:
    replacements take the dead ranks' places (and so their nodes) and only those: the epoch's
    plan fixes each rank's shard and the batch count the schedule runs on. A checkpoint of
    another world size resumes from an epoch's end only (the next epoch is planned over this
    run's ranks); one inside an epoch is a one-line error."""

    refill_only = True

    @property
    def recover(self) -> bool:
        """The Horovod backend (node-local averages) has no ULFM recovery."""
        return self.cfg.backend != "horovod"

    def keywords(self) -> tuple:
        cfg, topo, ctx = self.cfg, self.ctx.topo, self.ctx
        nbatches = driver.batches_per_rank(ctx)
        return ctx.optimizer_for(self.model), dict(
            topo=topo, epochs=cfg.epochs, steps_per_epoch=nbatches,
            local_backend="horovod" if cfg.backend == "horovod" else "mpi", **daso_kwargs(cfg))

    def __init__(self, ctx):
        super().__init__(ctx)
        if ctx.is_root and self.delay.active:
            log.info("daso: heterogeneity: %s", self.delay.model.describe())
        # the schedule as it was before DASO.epoch_end of epoch undo["epoch"]: a death after that
        # call but before the cursor's next_epoch leaves this rank's position at (epoch, all
        # batches done) with the schedule already one epoch on; the epoch end is then redone
        # (by every survivor), so the state sent for that position is the schedule before it
        self.undo: dict = {}
        self.rows: dict[int, list] = {}      # the summary's daso_schedule, by epoch (a redo
        self.counters: dict[int, dict] = {}  # replaces); this rank's per-epoch totals, likewise
        self.redo, self.slept = None, self.delay.slept
        self.own = None                      # this rank's part of a checkpoint resumed from

    def state(self) -> dict:
        opt, (epoch, done) = self.opt, self.world.position[:2]
        ahead = opt.schedule.epoch > epoch and self.undo.get("epoch") == epoch
        return {"model": self.model.state_dict(), "optimizer": opt.optimizer.state_dict(),
                "steps": opt.steps, "done": done, "nbatches": opt.batches_per_epoch,
                "schedule": self.undo["state"] if ahead else opt.schedule.state_dict(),
                "rows": {e: r for e, r in self.rows.items() if e < epoch or not ahead}}

    def load(self, blob: dict) -> None:
        opt = self.opt
        self.rows.clear()
        self.rows.update(blob["rows"])
        # the batches done (the schedule counts one more when the death hit inside a step)
        if blob["done"]:                 # (a rank behind the epoch's start has no count yet)
            opt.batches_per_epoch = blob["nbatches"]
        opt.schedule.load_state_dict({**blob["schedule"], "batch": blob["done"],
                                      "nbatches": opt.batches_per_epoch})
        opt.steps = blob["steps"]
        cycling = opt.schedule.phase == CYCLING
        if not cycling:                  # replicas are identical in a blocking epoch: exact
            self.model.load_state_dict(blob["model"])
            opt.optimizer.load_state_dict(blob["optimizer"])
        opt.set_topology(self.ctx.topo, average=cycling)

    def live(self) -> dict:
        """What a replacement gets (after the reset: no global message in flight, every replica
        the same: adopted in a blocking epoch, averaged in a cycling one): the model and
        ``DASO.state_dict`` (schedule, steps, the receives the reset dropped), the epoch's batch
        count and the summary's rows."""
        return {**super().live(), "batches_per_epoch": self.opt.batches_per_epoch,
                "rows": dict(self.rows), "counters": dict(self.counters), "undo": dict(self.undo)}

    def load_live(self, blob: dict) -> None:
        super().load_live(blob)              # (the model into the FlatModel views)
        self.opt.batches_per_epoch = blob["batches_per_epoch"]
        self.rows.update(blob["rows"])
        self.counters.update(blob["counters"])           # (the sender's per-rank totals)
        self.undo.update(blob["undo"])

    def digest(self) -> tuple:
        """The default's, with the epoch's batch count."""
        *head, state = super().digest()
        return (*head, self.opt.batches_per_epoch, state)

    def comms(self) -> tuple:
        return tuple(self.opt.comm.group_comms())

    def resume(self, state: dict) -> tuple:
        topo, was = self.ctx.topo, state.get(WRITTEN_SIZE, self.ctx.topo.size)
        if was != topo.size and state.get("batch", 0):
            raise CheckpointError(
                f"DASO checkpoint written by {was} ranks inside epoch {state['epoch']} (batch "
                f"{state['batch']}): its schedule counts that epoch's batches over {was} ranks; "
                f"resume it on {was} ranks, or on {topo.size} from a checkpoint at an epoch's end")
        self.model.load_state_dict(state["model"])        # copies into the FlatModel views
        self.opt.load_state_dict(state["optimizer"])
        # a --checkpoint-every one: each rank's own replica
        self.own = own_part(state.get(PER_RANK), topo.rank, topo.size, "daso")
        return state["epoch"], state.get("batch", 0), state.get("loss_sum", 0.0)

    def start(self) -> None:
        """Rank 0's parameters on every rank, then (resumed inside an epoch) this rank's own
        replica and DASO state (its schedule, its sends in flight as received sums)."""
        super().start()
        if self.own is not None:
            self.model.load_state_dict(self.own["model"])
            self.opt.load_state_dict(self.own["optimizer"])
            self.own = None

    def after_step(self) -> None:
        """``--checkpoint-every``: a checkpoint inside the epoch, with every rank's replica and
        DASO state (a cycling epoch's nodes differ; each send in flight is completed and kept:
        ``DASO.state_dict``), which a resume loads on each rank. Preemption is agreed at epoch
        ends only (a cycling epoch exchanges nothing globally between its sends)."""
        ctx, cur, opt = self.ctx, self.cur, self.opt
        if not ctx.checkpoint_every:
            return
        own: dict = {}          # taken once per checkpoint: every rank's part, rank 0's the state's

        def mine() -> dict:
            own.update(model=self.model.state_dict(), optimizer=opt.state_dict())
            return dict(own)
        ctx.consistent_point(
            ctx.topo.world, lambda: {
                **own, "epoch": cur.epoch, "batch": cur.done, "loss_sum": cur.loss_sum,
                "rank_failures": self.ft.failures},
            epoch=cur.epoch, step=opt.steps, writer=ctx.topo.rank == 0, agree=False,
            local_state=mine)

    def adopt(self, same: bool) -> None:
        # each survivor finishes the epoch on its own shard; a grow fills the dead ranks'
        # places (same), whose replacements take their shards
        self.cur.adopt(self.world.position, size_before=self.ft.size_before,
                       keep=list(range(self.ctx.topo.size)) if same else self.ft.last_kept)
        if self.opt.topo is not self.ctx.topo:      # grown: DASO's groups over the new world
            self.opt.set_topology(self.ctx.topo, average=False)

    def entered(self) -> None:
        # an epoch end adopted before its end (all batches done) is redone: its checkpoint is
        # written then unless its writer had written it before the death (once)
        cur = self.cur
        self.redo = cur.epoch if cur.plan is not None and not cur.in_epoch else None

    settled = entered

    def begin_epoch(self) -> None:
        self.opt.batches_per_epoch = self.cur.nbatches     # (the survivors' after a death)
        self.slept = self.delay.slept
        if self.ft.ulfm:
            # the epoch's first collective on the world: a rank that completed the last epoch
            # end's last collective from messages already there while the others failed it must
            # find the world revoked here; in the epoch's first step it would wait on a
            # node-level duplicate, which Open MPI 5.0 does not wake on a revoke
            # (docs/design/recovery.md, "the rank-0-late hang")
            self.ctx.topo.world.Barrier()

    def epoch_end(self) -> None:
        ctx, opt, cur = self.ctx, self.opt, self.cur
        topo, epoch = ctx.topo, cur.epoch
        self.undo.update(epoch=epoch, state=self.opt.schedule.state_dict())
        record = opt.epoch_end(cur.loss_sum / max(1, cur.loss_n))
        record["daso_global_wait_max_s"] = round(max_over(topo.world,
                                                          record["daso_global_wait_s"]), 4)
        record["sleep_time_max_s"] = round(max_over(topo.world, self.delay.slept - self.slept), 4)
        self.counters[epoch] = {key: record[key] for key in TOTALS}
        self.rows[epoch] = [epoch, record["daso_phase"], record["daso_global_skip"],
                            record["daso_local_skip"], record["daso_batches_to_wait"]]
        if topo.rank == 0:
            log.info("DASO epoch %d: %s (gs %d, ls %d, B %d), waited %.3f s on global messages",
                     epoch, record["daso_phase"], record["daso_global_skip"],
                     record["daso_local_skip"], record["daso_batches_to_wait"],
                     record["daso_global_wait_s"])
        ctx.epoch_end(epoch, self.model, world_size=topo.size, **record)
        step = opt.steps            # (agree=True: the preemption agreement at every epoch end)
        ctx.consistent_point(topo.world, lambda: {
            "model": self.model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch + 1,
            "rank_failures": self.ft.failures}, epoch=epoch, step=step, force=True, agree=True,
            writer=topo.rank == 0 and not (self.redo == epoch and _saved(ctx, epoch, step)))
        inject.point("epoch_done")

    def final(self) -> dict:
        return _final(self.opt, self.ctx.topo, self.cfg, self.rows, self.counters, self.delay)


def run(ctx: RunContext) -> RunResult:
    return driver.run(ctx, Daso)


TOTALS = ("daso_global_wait_s", "daso_blocking_global_s", "daso_global_bytes",
          "daso_local_bytes")


def _saved(ctx, epoch: int, step: int) -> bool:
    """The epoch-end checkpoint (epoch, step) is in the checkpoint directory (complete: a
    checkpoint is renamed into place once written)."""
    from ..checkpoint import checkpoint_name

    return ctx.checkpoints is not None and \
        (ctx.checkpoints.directory / checkpoint_name(epoch, step)).is_file()


def _final(opt, topo, cfg, rows, counters, delay) -> dict:
    """The summary's collective part (checksums: replicas must be bitwise identical)."""
    schedule = [rows[e] for e in sorted(rows)]
    totals = {key: sum(c.get(key, 0) for c in counters.values()) for key in TOTALS}
    checksum = opt.checksum()
    checksums = topo.world.allgather(checksum)
    identical = len(set(checksums)) == 1
    if not identical:
        log.error("DASO: replicas differ at the end: %d distinct checksums", len(set(checksums)))
    return {"backend": cfg.backend, "steps": opt.steps, "replicas_identical": identical,
            "replica_checksum": checksum[:16], "replica_sha256": checksums,
            "daso_schedule": schedule,
            "daso_node_sizes": list(topo.node_sizes),
            "daso_global_wait_s": round(totals["daso_global_wait_s"], 4),
            "daso_blocking_global_s": round(totals["daso_blocking_global_s"], 4),
            "bytes_communicated_global": topo.world.allreduce(totals["daso_global_bytes"]),
            # what every rank handed to MPI, node-local included (as SSGD's bytes_communicated)
            "bytes_communicated": topo.world.allreduce(totals["daso_global_bytes"]
                                                       + totals["daso_local_bytes"]),
            **delay.record(), "sleep_time_s": topo.world.allgather(round(delay.slept, 4))}
