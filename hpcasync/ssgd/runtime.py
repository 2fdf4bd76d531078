"""SSGD: synchronous data-parallel SGD (the Horovod-style baseline).

Every step, every rank averages its gradient with all the others' (one allreduce over the flat
gradient buffer) and applies the same local optimizer step, so replicas stay bitwise identical
(invariant 3). The gradient's path: ``loss.backward()`` writes into views of ``FlatModel.grads`` ->
``DistributedOptimizer.synchronize()`` allreduce-averages that one buffer in place ->
the user's ``optimizer.step()`` reads the averaged ``p.grad`` views. The buffer is averaged in
buckets started during backward (``--ssgd-overlap``, default on a GPU; ``--no-ssgd-overlap``, the CPU default, reduces the same
buckets after it, bitwise the same result; ``--ssgd-bucket-mb``): :mod:`hpcasync.ssgd.buckets`.

Example (a user's own loop)::

    flat = FlatModel(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), flat, MPI.COMM_WORLD)
    opt.broadcast_parameters(root=0)
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

This module is the CLI's part (``hpcasync train --algorithm ssgd|localsgd|slowmo|diloco``): the
options' checks and keywords, and :class:`SSGD`, the family in the one synchronous loop
(:mod:`hpcasync.runtime.driver`). Design: docs/design/ssgd.md#runtime (heterogeneity, the Horovod
backend).
"""
from __future__ import annotations

import contextlib
import logging

from .. import registry
from ..checkpoint import PER_RANK, own_part
from ..daso.comm import LinkDelay
from ..errors import ConfigError
from ..hetero import check_options as check_hetero
from . import optimizer_class
from .horovod import check_backend
from ..runtime.context import RunContext, RunResult, max_over
from ..runtime import driver, join
from ..train import params_digest
from .options import DEFAULT_PROGRESS, PROGRESS, add_arguments  # noqa: F401 (the runtime's options)

log = logging.getLogger("hpcasync")


def validate(cfg) -> None:
    check_hetero(cfg.options)
    d = cfg.options.get("link_delay_us_per_mb", 0.0)
    if not isinstance(d, (int, float)) or not 0 <= d < float("inf"):
        raise ConfigError(f"--link-delay-us-per-mb must be a finite number >= 0, got {d!r}")
    mb = cfg.options.get("ssgd_bucket_mb")
    if mb is not None and (not isinstance(mb, (int, float)) or isinstance(mb, bool)
                           or not 4 / 2**20 <= mb < 2**20):
        raise ConfigError(f"--ssgd-bucket-mb must be a number of MiB >= 4 bytes, got {mb!r}")
    progress = cfg.options.get("ssgd_progress", DEFAULT_PROGRESS)
    if progress not in PROGRESS:
        raise ConfigError(f"--ssgd-progress must be one of {', '.join(PROGRESS)}, got {progress!r}")
    check_backend(cfg.backend)
    if cfg.algorithm != "ssgd":             # a method of the family: its options, its checks
        for name, default in (("ssgd_overlap", None), ("ssgd_bucket_mb", None),
                              ("ssgd_progress", DEFAULT_PROGRESS)):
            if cfg.options.get(name, default) != default:
                raise ConfigError(f"--{name.replace('_', '-')} applies to ssgd, not "
                                  f"{cfg.algorithm} (its gradients stay local)")
        optimizer_class(cfg.algorithm).cli_keywords(registry.given(cfg.algorithm, cfg.options))
    if cfg.options.get("compress") == "powersgd":
        if cfg.backend == "horovod":
            raise ConfigError("--compress powersgd needs --backend mpi (Horovod has no PowerSGD)")
        if cfg.options.get("ssgd_overlap"):
            raise ConfigError("--compress powersgd compresses the whole gradient after backward: "
                              "drop --ssgd-overlap")
        powersgd(cfg)                           # its own checks, as one line
    join.validate(cfg)


def powersgd(cfg):
    """The :class:`~hpcasync.ssgd.powersgd.PowerSGD` of the ``--powersgd-*`` options (Q's first
    draw seeded by ``--seed``)."""
    from .powersgd import PowerSGD

    o = cfg.options
    return PowerSGD(rank=o.get("powersgd_rank", 1), start_iter=o.get("powersgd_start_iter", 1000),
                    min_compression_rate=o.get("powersgd_min_compression_rate", 2.0),
                    error_feedback=o.get("powersgd_error_feedback", True),
                    warm_start=o.get("powersgd_warm_start", True), seed=cfg.seed)


def _across(opt) -> int:
    """Bytes ``opt`` has sent between nodes (hierarchical DiLoCo: the outer syncs' only)."""
    return getattr(opt, "bytes_across", getattr(opt, "bytes_sent", 0))


class SSGD(driver.Family):
    """SSGD and its kin (PowerSGD, localsgd, slowmo, diloco) in the driver's loop: the state is
    taken at any step, the root's with each rank's own part (local SGD's replica and optimizer
    state between two averages, PowerSGD's error memory: ``local_state``)."""

    @property
    def recover(self) -> bool:
        """The Horovod backend has no ULFM recovery."""
        return self.cfg.backend != "horovod"

    def build(self):
        if self.recover:
            return super().build()
        from .horovod import HorovodOptimizer

        return HorovodOptimizer(self.ctx.optimizer_for(self.model), self.model,
                                self.ctx.topo.world)

    def keywords(self) -> tuple:
        cfg, topo, o = self.cfg, self.ctx.topo, self.cfg.options
        kw: dict = {"comm": topo.world,
                    **optimizer_class(cfg.algorithm).cli_keywords(
                        registry.given(cfg.algorithm, o), topo)}
        if cfg.algorithm == "ssgd":
            mb, compress = o.get("ssgd_bucket_mb"), o.get("compress", "none")
            kw.update(overlap=o.get("ssgd_overlap"),
                      compress=(powersgd(cfg) if compress == "powersgd"
                                else None if compress == "none" else compress),
                      bucket_bytes=None if mb is None else max(4, int(mb * 2**20)),
                      progress=o.get("ssgd_progress", DEFAULT_PROGRESS))
        return self.ctx.optimizer_for(self.model), kw

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg, topo = self.cfg, ctx.topo
        if ctx.is_root and self.delay.active:
            log.info("ssgd: heterogeneity: %s", self.delay.model.describe())
        # emulated slow inter-node link (as DASO's, hpcasync.daso.comm): each step's gradient
        # message crosses it once per node, at its wire size; only a job of more than one node pays
        self.link = LinkDelay(cfg.options.get("link_delay_us_per_mb", 0.0)
                              if topo.num_nodes > 1 else 0.0)
        numel = sum(p.numel() for p in self.model.parameters())
        compressed = cfg.options.get("compress", "none") != "none" and cfg.backend != "horovod"
        self.wire_bytes = numel * (2 if compressed else 4)
        self.fixed_wire = cfg.algorithm == "ssgd" and getattr(self.opt, "powersgd", None) is None
        # each rank's own state in the checkpoints (local SGD's optimizer state, PowerSGD's error
        # memory): a resume loads its own and replays the uninterrupted run
        self.local = getattr(self.opt, "local_state_dict", None)
        self.own, self.slept = None, self.delay.slept

    def state(self, at: tuple | None = None) -> dict:
        """Everything a resumed run needs to continue bitwise from ``at`` (epoch, batch, loss
        sum; default: here, the loss not carried): replicas are identical, so the root's (rank
        0's in a checkpoint)."""
        epoch, batch, loss_sum = at or (self.cur.epoch, self.cur.done, 0.0)
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "epoch": epoch, "batch": batch, "loss_sum": loss_sum,
                "rank_failures": self.ft.failures}

    def resume(self, state: dict) -> tuple:
        self.load(state)
        # this rank's own part (loaded after the start's broadcast, which would overwrite it)
        topo = self.ctx.topo
        self.own = own_part(state.get(PER_RANK), topo.rank, topo.size, self.cfg.algorithm)
        return state["epoch"], state["batch"], state["loss_sum"]

    def start(self) -> None:
        """Rank 0's parameters on every rank (resumed: the same anyway), then this rank's own
        part of the checkpoint resumed from (local SGD's replica between two averages)."""
        self.opt.broadcast_parameters(root=0)
        if self.own is not None:
            self.opt.load_local_state_dict(self.own)

    def settled(self) -> None:
        self.opt.set_comm(self.ctx.topo.world)

    def begin_epoch(self) -> None:
        self.slept = self.delay.slept

    def step(self) -> float:
        loss = self.cur.backward(self.model, self.opt, self.delay, self.device)
        sent = _across(self.opt)
        self.opt.step()
        self.link.block(self.wire_bytes if self.fixed_wire else _across(self.opt) - sent)
        return loss.item()

    def after_step(self) -> None:
        # checkpoints at any step (between two averages of local SGD, SlowMo or DiLoCo each
        # rank's replica and optimizer state are in it: local_state_dict); the preemption
        # agreement only where the replicas are equal (a local step communicates nothing)
        cur = self.cur
        self._checkpoint(cur.epoch, (cur.epoch, cur.done, cur.loss_sum),
                         agree=None if getattr(self.opt, "replicas_equal", True) else False)

    def _checkpoint(self, epoch: int, at: tuple, *, force: bool = False,
                    agree: bool | None = None) -> None:
        ctx = self.ctx
        ctx.consistent_point(ctx.topo.world, lambda: self.state(at), epoch=epoch,
                             step=self.opt.steps, writer=ctx.topo.rank == 0, force=force,
                             local_state=self.local, agree=agree)

    def epoch_end(self) -> None:
        ctx, opt, cur = self.ctx, self.opt, self.cur
        topo, epoch = ctx.topo, cur.epoch
        evaluated = contextlib.nullcontext()
        if hasattr(opt, "global_weights"):                # diloco: evaluate the global θ
            evaluated = opt.global_weights()
        elif not getattr(opt, "replicas_equal", True):    # localsgd: one model to evaluate
            opt.average_parameters()
        elif not getattr(opt, "sync_buffers", False):    # (averaged with every step otherwise)
            opt.average_buffers()
        with evaluated:
            ctx.epoch_end(epoch, self.model, train_loss=cur.train_loss(topo.world),
                          bytes_communicated=topo.world.allreduce(opt.bytes_sent),
                          comm_time_s=round(opt.comm_time, 4),
                          sleep_time_max_s=round(max_over(topo.world,
                                                          self.delay.slept - self.slept), 4),
                          world_size=topo.size)
        self._checkpoint(epoch, (epoch + 1, 0, 0.0), force=True)

    def final(self) -> dict:
        topo, opt = self.ctx.topo, self.opt
        if hasattr(opt, "finish"):         # localsgd, diloco: one model on every rank
            opt.finish()
        summary = {"backend": self.cfg.backend, "steps": opt.steps,
                   "bytes_communicated": topo.world.allreduce(opt.bytes_sent),
                   **self.delay.record(),
                   "sleep_time_s": topo.world.allgather(round(self.delay.slept, 4))}
        if self.ft.failures:         # the survivors' replicas, bitwise (a test asserts it)
            summary["replica_sha256"] = topo.world.allgather(params_digest(self.model))
        return summary


def run(ctx: RunContext) -> RunResult:
    return driver.run(ctx, SSGD)
