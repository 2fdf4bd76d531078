"""OD-SGD runtime: one synchronous global round in flight while every worker computes ahead
(Xu et al., "OD-SGD: One-step Delay Stochastic Gradient Descent for Distributed Training",
arXiv 2005.06728). LocalOpt and the global step are in :mod:`hpcasync.odsgd.steps`, one round as
pure functions (shared with the simulator) in :mod:`.core`; the MPI pipeline in :mod:`.pipeline`;
the CLI's part is here: the options, and :class:`OdSgd`, the family in the one synchronous loop
(:mod:`hpcasync.runtime.driver`).

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

from ..checkpoint import own_part
from ..errors import ConfigError
from ..runtime import driver, join
from ..runtime.context import RunContext, RunResult
from .checkpoint import consistent_point, global_state, load_state
from .core import GlobalState, ODSGDHyper, WorkerState, global_update, local_update, simulate_round
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


class OdSgd(driver.Family):
    """OD-SGD in the driver's loop: the global state (W, its momentum, identical on every rank)
    is the job's; each rank's local weights and mean square are its own (a reset gives every
    survivor W as its local weights; a checkpoint keeps every rank's)."""

    def keywords(self) -> tuple:
        cfg, topo = self.cfg, self.ctx.topo
        self.hp = hyper_from_config(cfg)
        return None, dict(comm=topo.world, progress=cfg.options.get("odsgd_progress", "thread"),
                          epochs=cfg.epochs,
                          steps_per_epoch=driver.batches_per_rank(self.ctx),
                          **dataclasses.asdict(self.hp))

    def build(self):
        opt = super().build()
        self.worker = opt.worker
        return opt

    def __init__(self, ctx):
        super().__init__(ctx)
        hp = self.hp
        if ctx.is_root:
            log.info("odsgd: local %s (lr %g, delta %s), %d warm-up steps, progress %s, %s",
                     hp.local_opt, hp.lr_local, hp.delta, hp.warmup_iters, self.worker.progress,
                     self.delay.model.describe())

    def state(self) -> dict:
        """The global model (identical on every rank) for the survivors after a death."""
        w = self.worker
        return {"global": global_state(w), "buffers": w.flat.buffers.detach().cpu()}

    def load(self, blob: dict) -> None:
        w = self.worker
        load_state(w, blob["global"], {"local": blob["global"]["W"], "ms": w.ws.ms,
                                       "buffers": blob["buffers"]})

    def digest(self) -> tuple:
        """What every rank holds alike after a join (the mean square differs per rank)."""
        w = self.worker
        g = w.glob
        return (tuple(self.cur.position), (w.steps, w.rounds),
                join.digest([g.W, g.W_prev, g.buf, w.flat.params, w.flat.buffers]))

    def position(self) -> tuple:
        return (*self.cur.position, self.worker.rounds)

    def comms(self) -> tuple:
        return (self.worker.round_comm,)

    def resume(self, state: dict) -> tuple:
        return state["epoch"], state["batch"], state["loss_sum"]   # (loaded by start)

    def start(self) -> None:
        self.worker.broadcast_parameters(root=0)
        state = self.resumed
        if state is not None:                # (after the broadcast, which sets W from params)
            topo = self.ctx.topo
            own = own_part(state["locals"], topo.rank, topo.size, "odsgd")
            load_state(self.worker, state["global"], own if own is not None else
                       state["locals"][0])      # (another world size: rank 0's, said once)

    def adopt(self, same: bool) -> None:
        # (a grow: the Dup of set_comm matches the one in a replacement's ODSGD constructor)
        super().adopt(same)
        self.opt.set_comm(self.ctx.topo.world)

    def entered(self) -> None:
        # (a replacement enters mid-epoch: its own counters from here, the epoch's steps)
        self._count_from(self.worker.steps - self.cur.done)

    def begin_epoch(self) -> None:
        self._count_from(self.worker.steps)

    def _count_from(self, steps: int) -> None:
        """This epoch's counters: times, steps before it, sleep and compute seconds."""
        self.before, self.steps_before = StepTimes(**vars(self.worker.times)), steps
        self.slept, self.compute = self.delay.slept, 0.0

    def step(self) -> float:
        self.model.train()
        t0 = time.perf_counter()
        x, y = self.cur.batch(self.device)
        self.opt.zero_grad()
        self.delay.begin()
        loss = self.ctx.loss_fn(self.model(x), y)
        loss.backward()
        value = loss.item()
        self.compute += time.perf_counter() - t0
        self.delay.end(self.worker.steps)    # a straggler sleeps here; the round waits for it
        self.opt.step()
        return value

    def after_step(self) -> None:
        cur = self.cur
        consistent_point(self.ctx, self.worker, epoch=cur.epoch, batch=cur.done,
                         loss_sum=cur.loss_sum)

    def epoch_end(self) -> None:
        ctx, w, cur, hp = self.ctx, self.worker, self.cur, self.hp
        world, epoch = ctx.topo.world, cur.epoch
        w.synchronize()
        w.average_buffers()
        times = _epoch_times(world, w.times, self.before, self.compute,
                             max(1, w.steps - self.steps_before))
        times["warmup_steps"] = (min(w.steps, hp.warmup_iters)
                                 - min(self.steps_before, hp.warmup_iters))
        train_loss = cur.train_loss(world)
        times["sleep_time_max_s"] = round(max(world.allgather(self.delay.slept - self.slept)), 4)
        with w.global_weights():
            ctx.epoch_end(epoch, self.model, train_loss=train_loss, rounds=w.rounds,
                          bytes_communicated=world.allreduce(w.bytes_sent),
                          world_size=ctx.topo.size, **times)
        consistent_point(ctx, w, epoch=epoch + 1, batch=0, loss_sum=0.0, force=True,
                         label=epoch)

    def final(self) -> dict:
        world, w = self.ctx.topo.world, self.worker
        summary = {"bytes_communicated": world.allreduce(w.bytes_sent),
                   "sleep_time_s": world.allgather(round(self.delay.slept, 4))}
        if self.ft.failures:         # the global model, bitwise on every survivor
            summary["replica_sha256"] = world.allgather(
                hashlib.sha256(w.glob.W.numpy().tobytes()).hexdigest())
        self.opt.finish(average_buffers=False)      # buffers were averaged at the last epoch end
        return summary

    def summary(self) -> dict:
        w, hp, history = self.worker, self.hp, self.ctx.history
        return {"steps": w.steps, "rounds": w.rounds,
                "warmup_steps": min(w.steps, hp.warmup_iters),
                "local_opt": hp.local_opt, "delta": hp.delta, "progress": w.progress,
                "compute_time_s": round(sum(r["compute_time_s"] for r in history), 4),
                "wait_time_s": round(sum(r["wait_time_s"] for r in history), 4),
                **self.delay.record()}


def run(ctx: RunContext) -> RunResult:
    return driver.run(ctx, OdSgd)


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
