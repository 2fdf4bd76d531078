"""OD-SGD runtime: one synchronous global round in flight while every worker computes ahead
(Xu et al., "OD-SGD: One-step Delay Stochastic Gradient Descent for Distributed Training",
arXiv 2005.06728). LocalOpt and the global step are in :mod:`hpcasync.odsgd.steps`, one round as
pure functions (shared with the simulator) in :mod:`.core`; the MPI pipeline in :mod:`.pipeline`;
the CLI loop is here.

Every rank is a worker. Round t is an allreduce-average of the N gradients g_t^k followed by the same
momentum-SGD step on every rank, so the global model stays bitwise identical everywhere::

    ḡ_t = (1/N) Σ_k g_t^k ;   v ← γ·v + ḡ_t + wd·W_t ;   W_{t+1} = W_t − η·v

Example (a user's own loop; :class:`~hpcasync.odsgd.ODSGD`, also ``hpcasync.optimizer("odsgd", ...)``)::

    opt = ODSGD(model, lr=0.05, momentum=0.9)
    for x, y in loader:
        opt.zero_grad(); F.cross_entropy(model(x), y).backward()
        opt.step()                        # params now hold W^l_{t+1}
    opt.finish()                          # params hold the global model W

Design: docs/design/odsgd.md#runtime (the pipeline, staleness, why an allreduce, progress modes
measured, metrics, defaults measured, checkpoints). Differences from the paper: :class:`ODSGD`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import time

import torch

from .. import inject
from ..errors import ConfigError
from ..hetero import StepDelay
from ..runtime import join
from ..runtime.context import RunContext, RunResult
from ..runtime.ft import ulfm_enabled
from ..runtime.recovery import EpochCursor, SyncRecovery
from .checkpoint import consistent_point, global_state, load_state, local_state
from .core import GlobalState, ODSGDHyper, WorkerState, global_update, local_update, simulate_round
from .optimizer import ODSGD
from .options import add_arguments  # noqa: F401 (the runtime's options)
from .pipeline import PROGRESS_MODES, ODSGDWorker, StepTimes

__all__ = ["ODSGDWorker", "StepTimes", "ODSGDHyper", "GlobalState", "WorkerState", "local_update",
           "global_update", "simulate_round", "add_arguments", "validate", "run"]

log = logging.getLogger("hpcasync")

# -- CLI ------------------------------------------------------------------------------------------

_FLAGS = {"local_opt": "--odsgd-local-opt", "lr_local": "--odsgd-local-lr", "delta": "--odsgd-delta",
          "warmup_iters": "--odsgd-warmup-iters", "lam": "--odsgd-lambda",
          "ms_momentum": "--odsgd-ms-momentum"}


def hyper_from_config(cfg) -> ODSGDHyper:
    """The :class:`ODSGDHyper` of a TrainConfig; errors name the command-line flag."""
    o = cfg.options
    kw = dict(local_opt=o.get("odsgd_local_opt", "dc-adaptive"),
              lr_local=o.get("odsgd_local_lr", 0.5), delta=o.get("odsgd_delta", "last-step"),
              warmup_iters=o.get("odsgd_warmup_iters", 200), lam=o.get("odsgd_lambda"),
              ms_momentum=o.get("odsgd_ms_momentum", 0.0))
    for key, value in kw.items():       # validate one at a time so the message names the flag
        try:
            ODSGDHyper(lr=1.0, **{key: value})
        except ConfigError as exc:
            raise ConfigError(f"{_FLAGS[key]}: {exc}") from None
    return ODSGDHyper(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **kw)


def validate(cfg) -> None:
    from ..hetero import check_options

    check_options(cfg.options)
    hyper_from_config(cfg)
    progress = cfg.options.get("odsgd_progress", "thread")
    if progress not in PROGRESS_MODES:
        raise ConfigError(f"--odsgd-progress {progress!r} is not one of: "
                          f"{', '.join(PROGRESS_MODES)}")
    join.validate(cfg)


def run(ctx: RunContext) -> RunResult:
    cfg, topo = ctx.cfg, ctx.topo
    hp = hyper_from_config(cfg)
    model = ctx.make_model()
    opt = ODSGD(model, comm=topo.world, progress=cfg.options.get("odsgd_progress", "thread"),
                broadcast=False, epochs=cfg.epochs,        # the front door's object
                steps_per_epoch=len(ctx.train) // topo.size // cfg.batch_size,
                **dataclasses.asdict(hp))
    worker = opt.worker
    delay = StepDelay.from_config(cfg, rank=topo.rank, size=topo.size, device=topo.device)
    if ctx.is_root:
        log.info("odsgd: local %s (lr %g, delta %s), %d warm-up steps, progress %s, %s",
                 hp.local_opt, hp.lr_local, hp.delta, hp.warmup_iters, worker.progress,
                 delay.model.describe())
    start_epoch, start_batch, loss_carry = 1, 0, 0.0
    rec = SyncRecovery(ctx, enabled=ulfm_enabled())
    growth = join.Growth(ctx, rec)           # --grow-back: replacements join after a death
    # a replacement (runtime.join): the live state from a survivor, after ODSGD's constructor
    # (its communicator Dup matches the survivors' set_comm in the grow's adopt)
    joined = join.receive(ctx) if join.joined() else None
    state = ctx.resume_state() if joined is None else None
    if state is not None:
        start_epoch, start_batch, loss_carry = state["epoch"], state["batch"], state["loss_sum"]
        rec.failures = list(state.get("rank_failures", []))
    device = topo.device

    def adopted_state() -> dict:
        """The global model (identical on every rank) for survivors to adopt after a death."""
        return {"global": global_state(worker), "buffers": worker.flat.buffers.detach().cpu()}

    def load_adopted(blob: dict) -> None:
        load_state(worker, blob["global"], {"local": blob["global"]["W"], "ms": worker.ws.ms,
                                            "buffers": blob["buffers"]})

    def live_state() -> dict:
        """What a joiner needs of the worker (no round in flight after a recovery): the global
        state and the sender's own part — its local weights (W on every survivor after the
        recovery), BatchNorm buffers and dc-adaptive mean square (the dead rank's is lost;
        the sender's is the nearest estimate of the same gradients' statistics)."""
        return {"global": global_state(worker), "local": local_state(worker)}

    def digest() -> tuple:
        """What every rank holds alike after a join (the mean square differs per rank)."""
        g = worker.glob
        return (tuple(cur.position), (worker.steps, worker.rounds),
                join.tensors_digest([g.W, g.W_prev, g.buf, worker.flat.params,
                                     worker.flat.buffers]))

    def setup(rank: int) -> None:
        worker.broadcast_parameters(root=0)
        if state is not None:                # (after the broadcast, which sets W from params)
            load_state(worker, state["global"], state["locals"][rank])

    # positions (epoch, batches done, started), recovery and re-sharding as in hpcasync.ssgd
    cur = EpochCursor(ctx, epoch=start_epoch, done=start_batch, loss_sum=loss_carry)
    if joined is not None:
        load_state(worker, joined["state"]["global"], joined["state"]["local"])
        join.take_live_state(joined, ctx, cur, growth, check=digest)
    # this epoch's counters (a joiner enters mid-epoch: its own from here, the epoch's steps)
    before, steps_before, slept, compute = (StepTimes(**vars(worker.times)),
                                            worker.steps - cur.done, delay.slept, 0.0)
    summary = None
    while summary is None:
        topo = ctx.topo
        try:
            cur.start(lambda: setup(topo.rank))
            if cur.finished:                               # the final gathers
                inject.point("final")
                summary = {"bytes_communicated": topo.world.allreduce(worker.bytes_sent),
                           "sleep_time_s": topo.world.allgather(round(delay.slept, 4))}
                if rec.failures:         # the global model, bitwise on every survivor
                    summary["replica_sha256"] = topo.world.allgather(
                        hashlib.sha256(worker.glob.W.numpy().tobytes()).hexdigest())
                continue
            if cur.begin_epoch():
                before, steps_before, slept = (StepTimes(**vars(worker.times)), worker.steps,
                                               delay.slept)
                compute = 0.0
            epoch = cur.epoch
            if cur.in_epoch:
                model.train()
                t0 = time.perf_counter()
                x, y = cur.batch(device)
                opt.zero_grad()
                delay.begin()
                loss = ctx.loss_fn(model(x), y)
                loss.backward()
                loss_value = loss.item()
                compute += time.perf_counter() - t0
                delay.end(worker.steps)          # a straggler sleeps here; the round waits for it
                opt.step()
                cur.step_done(loss_value)
                rec.step_completed()
                if cur.in_epoch:
                    consistent_point(ctx, worker, epoch=epoch, batch=cur.done,
                                     loss_sum=cur.loss_sum)
                continue
            worker.synchronize()
            worker.average_buffers()
            times = _epoch_times(topo.world, worker.times, before, compute,
                                 max(1, worker.steps - steps_before))
            times["warmup_steps"] = (min(worker.steps, hp.warmup_iters)
                                     - min(steps_before, hp.warmup_iters))
            train_loss = cur.train_loss(topo.world)
            times["sleep_time_max_s"] = round(max(topo.world.allgather(delay.slept - slept)), 4)
            with worker.global_weights():
                ctx.epoch_end(epoch, model, train_loss=train_loss, rounds=worker.rounds,
                              bytes_communicated=topo.world.allreduce(worker.bytes_sent),
                              world_size=topo.size, **times)
            consistent_point(ctx, worker, epoch=epoch + 1, batch=0, loss_sum=0.0, force=True,
                             label=epoch)
            cur.next_epoch()
        except Exception as exc:        # noqa: BLE001 - only a dead rank is handled here
            if not rec.handles(exc):
                raise
            adopted = rec.recover(position=(*cur.position, worker.rounds), state=adopted_state,
                                  load=load_adopted, revoke=(worker.round_comm,))

            def adopt(same: bool) -> None:
                # (a grow: each joiner in a dead rank's place keeps the epoch's plan; the Dup of
                # set_comm matches the one in a joiner's ODSGD constructor)
                cur.adopt(adopted, size_before=rec.size_before,
                          keep=list(range(ctx.topo.size)) if same else None)
                opt.set_comm(ctx.topo.world)
            growth.grow(adopted, adopt=adopt, check=digest,
                        payload=lambda: join.live_state(ctx, cur, growth, live_state()))
    opt.finish(average_buffers=False)        # buffers were averaged at the last epoch end
    return RunResult(model=model, summary={
        "steps": worker.steps, "rounds": worker.rounds,
        "warmup_steps": min(worker.steps, hp.warmup_iters),
        "local_opt": hp.local_opt, "delta": hp.delta, "progress": worker.progress,
        "compute_time_s": round(sum(r["compute_time_s"] for r in ctx.history), 4),
        "wait_time_s": round(sum(r["wait_time_s"] for r in ctx.history), 4),
        **summary, **delay.record(), **rec.summary(), **growth.summary()})


def _epoch_times(comm, now: StepTimes, before: StepTimes, compute: float, nbatches: int) -> dict:
    """This epoch's timing breakdown, mean over ranks (plus the slowest rank's wait)."""
    mine = torch.tensor([compute, now.wait - before.wait, now.update - before.update,
                         now.in_flight - before.in_flight], dtype=torch.float64)
    every = torch.stack(comm.allgather(mine))
    mean = every.mean(0).tolist()
    waits = every[:, 1].tolist()
    inner = StepTimes(wait=mean[1], in_flight=mean[3])
    return {"compute_time_s": round(mean[0], 4), "wait_time_s": round(mean[1], 4),
            "update_time_s": round(mean[2], 4), "round_time_s": round(mean[3], 4),
            "wait_time_max_s": round(max(waits), 4), "overlap_fraction": round(inner.overlap(), 4),
            "compute_ms_per_step": round(1e3 * mean[0] / max(1, nbatches), 3),
            "wait_ms_per_step": round(1e3 * mean[1] / max(1, nbatches), 3)}
