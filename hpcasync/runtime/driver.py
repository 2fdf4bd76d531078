"""``hpcasync train`` for the synchronous families: one loop.

``ssgd`` (with ``localsgd``, ``slowmo``, ``diloco`` and PowerSGD), ``odsgd`` and ``daso`` run
:func:`run`; what is an algorithm's own is a :class:`Family` in its runtime module (how its
optimizer is built, what the job's state is, what a step, an epoch end and the summary record).
The loop is a user's loop over the same pieces: a data cursor (:class:`~.recovery.EpochCursor`),
the optimizer, and the one fault-tolerance object (:class:`~.elastic.FaultTolerance` over a
:class:`~.recovery.SyncWorld`), which after a death (ULFM) shrinks the world, gives every
survivor the state of the one furthest on, and grows back (``--grow-back``)::

    while not finished:
        try:
            start once (the first broadcast), then per batch: step, checkpoint;
            per epoch: the family's epoch end (evaluate, record, checkpoint)
        except process failure:
            ft.reset(position)            # then the family moves onto the new world

A replacement (``--grow-back``) builds the same family, receives the live state from a survivor
and enters the loop where the survivors are. Design: docs/design/recovery.md.
"""
from __future__ import annotations

import logging
from typing import Any

from .. import inject
from ..hetero import StepDelay
from . import join
from .context import RunContext, RunResult
from .recovery import EpochCursor, SyncWorld, fault_tolerance

log = logging.getLogger("hpcasync")


class Family:
    """One synchronous algorithm in :func:`run`'s loop (a subclass per family).

    Built by the driver with the run's context: ``model`` (made identically on every rank),
    ``opt`` (:meth:`build`), ``delay`` (the heterogeneity model: a straggler sleeps after its
    backward); the driver sets ``cur``, ``ft`` and ``world`` before the loop.

    A subclass gives :meth:`keywords` (its optimizer is built by the front door,
    ``hpcasync.optimizer``, as in a user's loop), :meth:`epoch_end` and :meth:`final`; the
    rest has defaults a family overrides where it differs. What a reset broadcasts from the
    survivor furthest on (:meth:`state`/:meth:`load`) and what a replacement gets
    (:meth:`live`/:meth:`load_live`) default to the model's and the optimizer's
    ``state_dict()``.
    """

    #: the reset can run (False: e.g. the Horovod backend, which has no ULFM recovery)
    recover = True
    #: grow back only into the dead ranks' places (DASO: the epoch's plan fixes the shards)
    refill_only = False

    def __init__(self, ctx: RunContext):
        self.ctx, self.cfg = ctx, ctx.cfg
        topo = ctx.topo
        self.model = ctx.make_model()
        self.opt = self.build()
        self.delay = StepDelay.from_config(self.cfg, rank=topo.rank, size=topo.size,
                                           device=topo.device)
        self.device = topo.device
        self.cur: EpochCursor | None = None
        self.ft = self.world = None
        self.resumed: dict | None = None

    # -- what each family gives --------------------------------------------------------------
    def keywords(self) -> tuple:
        """``(torch optimizer or None, keywords)`` of ``hpcasync.optimizer`` for this run's
        options and topology."""
        raise NotImplementedError

    def build(self):
        """The optimizer: ``hpcasync.optimizer(algorithm, model, ...)`` with :meth:`keywords`
        (its first broadcast is the loop's :meth:`start`, where a death is survived)."""
        from .. import api

        inner, keywords = self.keywords()
        return api.optimizer(self.cfg.algorithm, self.model, inner, broadcast=False, **keywords)

    def state(self) -> dict:
        """The job's state on the sync root during a reset (default: :meth:`live`'s; every rank
        loads it with :meth:`load`)."""
        return self.live()

    def load(self, blob: dict) -> None:
        self.load_live(blob)

    def epoch_end(self) -> None:
        """Evaluate, record and checkpoint the epoch ``self.cur.epoch`` (its batches done)."""
        raise NotImplementedError

    def final(self) -> dict:
        """The summary's collective part, at the end of the last epoch."""
        raise NotImplementedError

    # -- defaults ------------------------------------------------------------------------------
    def resume(self, state: dict) -> tuple:
        """Load a checkpoint's state; returns where the loop goes on ``(epoch, batch, loss)``."""
        self.load(state)
        return state["epoch"], state.get("batch", 0), state.get("loss_sum", 0.0)

    def start(self) -> None:
        """The run's first collective: every rank from rank 0's parameters."""
        self.opt.broadcast_parameters(root=0)

    def live(self) -> dict:
        """What a replacement gets besides the cursor and the records (:func:`join.live_state`):
        the model's and the optimizer's ``state_dict()`` (complete for the algorithm: DASO's
        schedule, OD-SGD's global and local weights, a rank's own part under ``LOCAL_KEY``)."""
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def load_live(self, blob: dict) -> None:
        self.model.load_state_dict(blob["model"])
        self.opt.load_state_dict(blob["optimizer"])

    def digest(self) -> tuple:
        """What every rank holds alike once a replacement is in: the position, the step count
        and :func:`join.digest` of the model's and the optimizer's state dicts (a rank's own
        part, under ``LOCAL_KEY``, left out)."""
        return (tuple(self.cur.position), int(getattr(self.opt, "steps", 0)),
                join.digest([self.model.state_dict(), self.opt.state_dict()]))

    def position(self) -> tuple:
        """How far this rank got (the reset's key)."""
        return self.cur.position

    def comms(self) -> tuple:
        """Communicators of the optimizer's own that a rank may be blocked on after a death."""
        return ()

    def adopt(self, same: bool) -> None:
        """The cursor onto the world the reset ends on: the rest of the epoch re-sharded, or
        (``same``: every rank in its place of the world before the death) the plan kept."""
        self.cur.adopt(self.world.position, size_before=self.ft.size_before,
                       keep=list(range(self.ctx.topo.size)) if same else None)

    def entered(self) -> None:
        """Once, before the loop: the start, a checkpoint, or (a replacement) the survivors'
        live state is loaded and the cursor is where the loop goes on."""

    def settled(self) -> None:
        """After a reset, on the world it ended on."""

    def begin_epoch(self) -> None:
        """An epoch's plan was just made (this epoch's counters)."""

    def step(self) -> float:
        """One batch: forward, backward (a straggler sleeps after it), the optimizer's step;
        returns the loss."""
        loss = self.cur.backward(self.model, self.opt, self.delay, self.device)
        self.opt.step()
        return loss.item()

    def after_step(self) -> None:
        """After a step inside the epoch (a checkpoint or preemption point)."""

    def summary(self) -> dict:
        return {}


def run(ctx: RunContext, family: type[Family]) -> RunResult:
    """Train ``family`` on ``ctx`` (module doc); returns the model and the summary."""
    nbatches = batches_per_rank(ctx)
    fam = family(ctx)
    check = getattr(fam.opt, "check_run_length", None)     # the run's steps per rank: a
    if check is not None and not join.joined():             # schedule it never completes
        check(ctx.cfg.epochs * nbatches)
    cur = fam.cur = EpochCursor(ctx)
    world = fam.world = SyncWorld(
        ctx, state=fam.state, load=fam.load, adopt=fam.adopt, check=fam.digest,
        payload=lambda: join.live_state(ctx, cur, ft, fam.live()), comms=fam.comms,
        refill_only=fam.refill_only)
    ft = fam.ft = fault_tolerance(ctx, world, enabled=fam.recover)
    ctx.epoch_plan = cur.plan_state
    if join.joined():           # a replacement: the live state from a survivor
        joined = join.receive(ctx)
        fam.load_live(joined["state"])
        join.take_live_state(joined, ctx, cur, ft, check=fam.digest)
    else:
        # a checkpoint of another number of ranks resumes: every rank from rank 0's state, the
        # rest of an epoch re-sharded (EpochCursor.resume_plan; the state holds the writer's
        # size under context.WRITTEN_SIZE; DASO's resume refuses one written inside an epoch)
        ctx.any_world_size = True
        state = fam.resumed = ctx.resume_state()
        if state is not None:
            fresh = _hyper(fam.opt)
            cur.epoch, cur.done, cur.loss_sum = fam.resume(state)
            _keep_command_line(ctx, fam.opt, fresh)
            cur.loss_n = cur.done
            cur.resume_plan(state)
            ft.failures = list(state.get("rank_failures", []))
    fam.entered()
    summary: Any = None
    while summary is None:
        try:
            cur.start(fam.start)
            if cur.finished:
                inject.point("final")
                summary = fam.final()
                continue
            if cur.begin_epoch():
                fam.begin_epoch()
            if cur.in_epoch:
                loss = fam.step()
                cur.step_done(loss)
                ft.step_completed()
                if cur.in_epoch:
                    fam.after_step()
                continue
            fam.epoch_end()
            cur.next_epoch()
        except Exception as exc:        # noqa: BLE001 - only a dead rank is handled here
            if not ft.report_error(exc):
                raise
            ft.reset(fam.position())
            fam.settled()
    return RunResult(model=fam.model, summary={**summary, **fam.summary(), **ft.summary()})


def batches_per_rank(ctx: RunContext) -> int:
    """Batches per rank and epoch over the run's world; fewer than one is a one-line error
    (every rank raises it): a run of no step would end with exit 0 on the initial model."""
    from ..errors import ConfigError

    cfg, size = ctx.cfg, ctx.topo.size
    if len(ctx.train) // size < cfg.batch_size:
        raise ConfigError(f"each of the {size} ranks gets {len(ctx.train) // size} training "
                          f"examples, fewer than one batch of {cfg.batch_size}: no step would be "
                          "trained; lower --batch-size or raise --train-limit")
    return len(ctx.train) // size // cfg.batch_size


#: the optimizer's hyperparameters the command line sets (``--lr``, ``--momentum``,
#: ``--weight-decay``)
HYPER = ("lr", "momentum", "weight_decay")


def _hyper(opt) -> list:
    return [{k: g[k] for k in HYPER if k in g} for g in getattr(opt, "param_groups", ())]


def _keep_command_line(ctx: RunContext, opt, fresh: list) -> None:
    """After a resume, each param group's ``--lr``/``--momentum``/``--weight-decay`` as this run's
    command line made them (``fresh``, read before the load): a torch optimizer's
    ``load_state_dict`` brings back the checkpoint's, which would silently override a changed
    option (the parameter server and OD-SGD take the command line's too). Said once where a
    value changes."""
    changed: dict[str, set] = {}
    for group, want in zip(getattr(opt, "param_groups", ()), fresh):
        for key, value in want.items():
            if group.get(key, value) != value:
                changed.setdefault(key, set()).add(group[key])
                group[key] = value
    if changed and ctx.is_root:
        log.warning("resumed with this run's %s (the checkpoint's optimizer had %s)",
                    ", ".join(f"--{k.replace('_', '-')} {fresh[0].get(k)}" for k in changed),
                    ", ".join(f"{k} {', '.join(map(str, sorted(v)))}" for k, v in changed.items()))
