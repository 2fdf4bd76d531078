"""``hpcasync train --algorithm daso``: the DASO loop (see :mod:`hpcasync.daso`).

The loop is SSGD's (:mod:`.sync`) with :class:`hpcasync.daso.DASO` in place of the
``DistributedOptimizer``, plus ``opt.epoch_end(loss)`` once per epoch, whose record (phase, knobs
gs/ls/B, seconds waiting on global messages, bytes) goes into the epoch's metrics. At the end every
rank hashes its parameters and buffers; the summary records ``replicas_identical`` and the hash.

Checkpoints (``--checkpoint-dir``, ``--resume``) and preemption are handled at epoch ends only,
where every replica — parameters, buffers and optimizer state — is identical, so rank 0's state is
the job's; a preemption signal is acted upon at the next epoch end.

Heterogeneity (``--hetero``, ``--straggler``, ``--compute-time``, ``--push-delay``) works as in
SSGD (:class:`~hpcasync.ssgd.runtime.StepDelay`): a slow rank sleeps after its forward/backward,
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
from ..comm import DASO_CHUNK_ELEMS, FlatModel
from . import DASO, DasoSchedule, LinkDelay
from ..errors import ConfigError
from ..hetero import check_options as check_hetero
from ..ssgd.horovod import check_backend
from ..runtime import join
from ..runtime.context import RunContext, RunResult, max_over
from ..runtime.ft import ulfm_enabled
from ..runtime.recovery import EpochCursor, SyncRecovery
from .optimizer import optimizer_state_tensors
from .options import add_arguments  # noqa: F401 (the runtime's options)
from .schedule import CYCLING
from ..hetero import StepDelay

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


def run(ctx: RunContext) -> RunResult:
    cfg, topo = ctx.cfg, ctx.topo
    model = ctx.make_model()
    flat = FlatModel(model)
    nbatches = len(ctx.train) // topo.size // cfg.batch_size
    if nbatches < 1:
        raise ConfigError(f"DASO: {len(ctx.train)} training images over {topo.size} ranks give "
                          f"no batch of {cfg.batch_size}; lower --batch-size")
    optimizer = ctx.optimizer_for(model)
    opt = DASO(optimizer, flat, topo, total_epochs=cfg.epochs, batches_per_epoch=nbatches,
               local_backend="horovod" if cfg.backend == "horovod" else "mpi", **daso_kwargs(cfg))
    delay = StepDelay.from_config(cfg, rank=topo.rank, size=topo.size, device=topo.device)
    if ctx.is_root and delay.active:
        log.info("daso: heterogeneity: %s", delay.model.describe())
    start_epoch = 1
    # a dead rank (ULFM): the survivors stay on their nodes (a node that lost a rank goes on
    # smaller: uneven nodes), adopt the most advanced position; in a blocking epoch they adopt
    # its replica, in a cycling one they average theirs
    rec = SyncRecovery(ctx, enabled=cfg.backend != "horovod" and ulfm_enabled())
    # --grow-back: replacements take the dead ranks' places (and so their nodes: the topology is
    # rebuilt with --ranks-per-node); only those places, since the epoch's plan fixes each
    # rank's shard and the batch count the schedule runs on (runtime.join)
    growth = join.Growth(ctx, rec, refill_only=True)
    # a replacement: the live state from a survivor, after DASO's constructor (its global
    # groups, a collective, match the survivors' set_topology in the grow's adopt)
    joined = join.receive(ctx) if join.joined() else None
    state = ctx.resume_state() if joined is None else None
    if state is not None:
        model.load_state_dict(state["model"])        # copies into the FlatModel views
        opt.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
        rec.failures = list(state.get("rank_failures", []))

    def snapshot(next_epoch: int) -> dict:
        """The whole job at an epoch end (replicas, optimizer state included, are identical)."""
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": next_epoch,
                "rank_failures": rec.failures}

    def schedule_state() -> dict:
        sch = opt.schedule
        return {"epoch": sch.epoch, "batch": sch.batch, "knobs": list(sch.knobs),
                "plateau": dict(sch.plateau.state_dict())}

    # the schedule as it was before DASO.epoch_end of epoch undo["epoch"]: a death after that
    # call but before the cursor's next_epoch leaves this rank's position at (epoch, all
    # batches done) with the schedule already one epoch on; the epoch end is then redone
    # (by every survivor), so the state sent for that position is the schedule before it
    undo: dict = {}
    rows: dict[int, list] = {}       # the summary's daso_schedule, by epoch (a redo replaces)
    counters: dict[int, dict] = {}   # this rank's per-epoch totals, by epoch (likewise)

    def adopted_state() -> dict:
        epoch = rec.position[0]
        ahead = opt.schedule.epoch > epoch and undo.get("epoch") == epoch
        return {"model": model.state_dict(), "optimizer": opt.optimizer.state_dict(),
                "steps": opt.steps, "done": rec.position[1], "nbatches": opt.batches_per_epoch,
                "schedule": undo["state"] if ahead else schedule_state(),
                "rows": {e: r for e, r in rows.items() if e < epoch or not ahead}}

    def load_adopted(blob: dict) -> None:
        sch, src = opt.schedule, blob["schedule"]
        rows.clear()
        rows.update(blob["rows"])
        # the batches done (the schedule counts one more when the death hit inside a step)
        sch.epoch, sch.batch = src["epoch"], blob["done"]
        sch.knobs = type(sch.knobs)(*src["knobs"])
        sch.plateau.load_state_dict(src["plateau"])
        if sch.batch:                    # (a rank behind the epoch's start has no count yet)
            opt.batches_per_epoch = blob["nbatches"]
        sch.nbatches = opt.batches_per_epoch if sch.batch else None
        opt.steps = blob["steps"]
        cycling = sch.phase == CYCLING
        if not cycling:                  # replicas are identical in a blocking epoch: exact
            model.load_state_dict(blob["model"])
            opt.optimizer.load_state_dict(blob["optimizer"])
        opt.set_topology(ctx.topo, average=cycling)

    def live_state() -> dict:
        """What a joiner gets (after the recovery: no global message in flight, every replica
        the same — adopted in a blocking epoch, averaged in a cycling one)."""
        sch = opt.schedule
        return {"model": model.state_dict(), "optimizer": opt.optimizer.state_dict(),
                "steps": opt.steps, "batches_per_epoch": opt.batches_per_epoch,
                "lost_before": opt._lost_before,
                "schedule": {"epoch": sch.epoch, "batch": sch.batch, "nbatches": sch.nbatches,
                             "knobs": list(sch.knobs), "plateau": dict(sch.plateau.state_dict())},
                "rows": dict(rows), "counters": dict(counters), "undo": dict(undo)}

    def load_live(blob: dict) -> None:
        model.load_state_dict(blob["model"])         # (into the FlatModel views)
        opt.optimizer.load_state_dict(blob["optimizer"])
        opt.steps, opt.batches_per_epoch = blob["steps"], blob["batches_per_epoch"]
        opt._lost_before = blob["lost_before"]       # receives of sends dropped in the recovery
        sch, src = opt.schedule, blob["schedule"]
        sch.epoch, sch.batch, sch.nbatches = src["epoch"], src["batch"], src["nbatches"]
        sch.knobs = type(sch.knobs)(*src["knobs"])
        sch.plateau.load_state_dict(src["plateau"])
        rows.update(blob["rows"])
        counters.update(blob["counters"])           # (the sender's per-rank totals)
        undo.update(blob["undo"])

    def digest() -> tuple:
        """What every rank holds alike after a join (replicas, optimizer state, schedule)."""
        sch = opt.schedule
        return (tuple(cur.position),
                (opt.steps, opt.batches_per_epoch, opt._lost_before, len(opt.inflight), sch.epoch,
                 sch.batch, sch.nbatches, tuple(sch.knobs), repr(sch.plateau.state_dict())),
                join.tensors_digest([*model.state_dict().values(),
                                     *optimizer_state_tensors(opt.optimizer)]))

    device = topo.device
    cur = EpochCursor(ctx, epoch=start_epoch)
    summary = redo = None
    if joined is not None:
        load_live(joined["state"])
        join.take_live_state(joined, ctx, cur, growth, check=digest)
        redo = cur.epoch if cur.plan is not None and not cur.in_epoch else None
    slept = delay.slept                  # (set at each epoch's start; a joiner enters mid-epoch)
    while summary is None:
        topo = ctx.topo
        try:
            cur.start(lambda: opt.broadcast_parameters(root=0))
            if cur.finished:
                inject.point("final")
                summary = _final(opt, topo, cfg, rows, counters, delay)
                continue
            if cur.begin_epoch():
                opt.batches_per_epoch = cur.nbatches     # (the survivors' after a death)
                slept = delay.slept
                if rec.enabled:
                    # the epoch's first collective on the world: a rank that completed the last
                    # epoch end's last collective from messages already there while the others
                    # failed it must find the world revoked here; in the epoch's first step it
                    # would wait on a node-level duplicate, which Open MPI 5.0 does not wake on
                    # a revoke (docs/design/recovery.md, "the rank-0-late hang")
                    topo.world.Barrier()
            epoch = cur.epoch
            if cur.in_epoch:
                loss = cur.backward(model, opt, delay, device)   # (a straggler sleeps in it)
                opt.step()
                cur.step_done(loss.item())
                rec.step_completed()
                continue
            undo.update(epoch=epoch, state=schedule_state())
            record = opt.epoch_end(cur.loss_sum / max(1, cur.loss_n))
            wait_max = max_over(topo.world, record["daso_global_wait_s"])
            record["daso_global_wait_max_s"] = round(wait_max, 4)
            record["sleep_time_max_s"] = round(max_over(topo.world, delay.slept - slept), 4)
            counters[epoch] = {key: record[key] for key in TOTALS}
            rows[epoch] = [epoch, record["daso_phase"], record["daso_global_skip"],
                           record["daso_local_skip"], record["daso_batches_to_wait"]]
            if topo.rank == 0:
                log.info("DASO epoch %d: %s (gs %d, ls %d, B %d), waited %.3f s on global "
                         "messages", epoch, record["daso_phase"], record["daso_global_skip"],
                         record["daso_local_skip"], record["daso_batches_to_wait"],
                         record["daso_global_wait_s"])
            ctx.epoch_end(epoch, model, world_size=topo.size, **record)
            # the step passed is rounded down to a multiple of check_every, so that the
            # preemption agreement (made only on such steps) takes place at every epoch end
            step = opt.steps - opt.steps % max(1, ctx.check_every)
            ctx.consistent_point(topo.world, lambda: snapshot(epoch + 1), epoch=epoch,
                                 step=step, force=True, writer=topo.rank == 0
                                 and not (redo == epoch and _saved(ctx, epoch, step)))
            inject.point("epoch_done")
            cur.next_epoch()
        except Exception as exc:        # noqa: BLE001 - only a dead rank is handled here
            if not rec.handles(exc):
                raise
            def revoke():               # (the attempt's own, after a failed attempt)
                return tuple(c for c in (ctx.topo.local, ctx.topo.glob,
                                         *opt.comm.group_comms()) if c is not None)
            adopted = rec.recover(position=cur.position, state=adopted_state, load=load_adopted,
                                  revoke=revoke)

            def adopt(same: bool) -> None:
                # each survivor finishes the epoch on its own shard; a grow fills the dead
                # ranks' places (same), whose joiners take their shards
                cur.adopt(adopted, keep=list(range(ctx.topo.size)) if same else rec.last_kept,
                          size_before=rec.size_before)
                if opt.topo is not ctx.topo:      # grown: DASO's groups over the new world
                    opt.set_topology(ctx.topo, average=False)
            growth.grow(adopted, adopt=adopt, check=digest,
                        payload=lambda: join.live_state(ctx, cur, growth, live_state()))
            # an epoch end adopted before its end (all batches done) is redone: its checkpoint
            # is written then unless its writer had written it before the death (once)
            redo = cur.epoch if cur.plan is not None and not cur.in_epoch else None
    return RunResult(model=model, summary={**summary, **rec.summary(), **growth.summary()})


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
