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

Design: docs/design/ssgd.md#runtime (heterogeneity, the Horovod backend).
"""
from __future__ import annotations

import contextlib
import logging

from .. import inject
from ..checkpoint import PER_RANK, own_part
from ..comm import FlatModel
from ..daso.comm import LinkDelay
from ..errors import ConfigError
from ..hetero import StepDelay
from ..hetero import check_options as check_hetero
from .horovod import check_backend
from ..runtime.context import RunContext, RunResult, max_over
from ..runtime import join
from ..runtime.ft import ulfm_enabled
from ..runtime.recovery import EpochCursor, SyncRecovery
from ..train import params_digest
from .options import DEFAULT_PROGRESS, PROGRESS, add_arguments  # noqa: F401 (the runtime's options)
from .optimizer import DistributedOptimizer

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
    if cfg.algorithm in ("localsgd", "diloco", "slowmo"):
        from .localsgd import LocalSGD

        if cfg.backend == "horovod":
            raise ConfigError(f"{cfg.algorithm} needs --backend mpi")
        for name in ("ssgd_overlap", "ssgd_bucket_mb"):
            if cfg.options.get(name) is not None:
                raise ConfigError(f"--{name.replace('_', '-')} applies to ssgd, not "
                                  f"{cfg.algorithm} (its gradients stay local)")
        o = cfg.options
        LocalSGD.check(o.get("localsgd_period"), o.get("localsgd_warmup_steps"))
    if cfg.algorithm == "diloco":
        diloco(cfg, None, None, None, check_only=True)
    if cfg.algorithm == "slowmo":
        slowmo(cfg, None, None, None, check_only=True)
    if cfg.options.get("compress") == "powersgd":
        if cfg.backend == "horovod":
            raise ConfigError("--compress powersgd needs --backend mpi (Horovod has no PowerSGD)")
        if cfg.options.get("ssgd_overlap"):
            raise ConfigError("--compress powersgd compresses the whole gradient after backward: "
                              "drop --ssgd-overlap")
        powersgd(cfg)                           # its own checks, as one line
    join.validate(cfg)


def _given(options: dict, name: str, default):
    """The option's value, or ``default`` when it was not given (a given 0 stays 0, for the
    checks to refuse it)."""
    value = options.get(name)
    return default if value is None else value


def slowmo(cfg, inner, model, comm, *, check_only: bool = False):
    """The :class:`~hpcasync.ssgd.slowmo.SlowMo` of the ``--slowmo-*`` options."""
    from .localsgd import LocalSGD
    from .slowmo import DEFAULT_MOMENTUM, DEFAULT_PERIOD, DEFAULT_SLOW_LR, SlowMo, check

    o = cfg.options
    period = _given(o, "slowmo_period", DEFAULT_PERIOD)
    beta = DEFAULT_MOMENTUM if o.get("slowmo_momentum") is None else o["slowmo_momentum"]
    alpha = DEFAULT_SLOW_LR if o.get("slowmo_lr") is None else o["slowmo_lr"]
    if check_only:
        LocalSGD.check(period, 0, algorithm="slowmo")
        check(beta, alpha)
        return None
    return SlowMo(inner, model, comm, period=period, slow_momentum=beta, slow_lr=alpha)


def diloco(cfg, inner, model, comm, *, check_only: bool = False, topo=None):
    """The :class:`~hpcasync.ssgd.diloco.DiLoCo` of the ``--diloco-*`` options (its checks
    alone with ``check_only``: the options' one-line errors before the run)."""
    from .diloco import DEFAULT_SYNC_EVERY, OUTER_LR, OUTER_MOMENTUM, DiLoCo, check

    o = cfg.options
    lr = o.get("diloco_outer_lr")
    momentum = o.get("diloco_outer_momentum")
    kw = dict(sync_every=_given(o, "diloco_sync_every", DEFAULT_SYNC_EVERY),
              fragments=_given(o, "diloco_fragments", 1),
              fragment_sync_delay=o.get("diloco_sync_delay") or 0,
              fragment_update_alpha=o.get("diloco_alpha") or 0.0)
    outer = (OUTER_LR if lr is None else lr, OUTER_MOMENTUM if momentum is None else momentum)
    if check_only:
        check(kw["sync_every"], kw["fragments"], kw["fragment_sync_delay"],
              kw["fragment_update_alpha"], outer)
        if o.get("diloco_quantize") and o.get("diloco_hierarchical"):
            raise ConfigError("--diloco-quantize and --diloco-hierarchical do not go together: "
                              "the node mean is exact")
        return None
    node = topo.local if o.get("diloco_hierarchical") else None
    return DiLoCo(inner, model, comm, **kw, outer_optimizer=lambda ps: torch_sgd(ps, *outer),
                  node_comm=node, quantize=bool(o.get("diloco_quantize")))


def torch_sgd(params, lr: float, momentum: float):
    """The outer optimizer of the CLI's DiLoCo: SGD with Nesterov momentum (plain SGD at 0)."""
    import torch

    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)


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


def run(ctx: RunContext) -> RunResult:
    cfg, topo = ctx.cfg, ctx.topo
    model = ctx.make_model()
    if cfg.backend == "horovod":
        from .horovod import HorovodOptimizer

        opt = HorovodOptimizer(ctx.optimizer_for(model), model, topo.world)
        flat = None
    else:
        flat = FlatModel(model)
        compress = {"none": None, "powersgd": None}.get(cfg.options.get("compress", "none"),
                                                          cfg.options.get("compress"))
        if cfg.options.get("compress") == "powersgd":
            compress = powersgd(cfg)
        mb = cfg.options.get("ssgd_bucket_mb")
        bucket = None if mb is None else max(4, int(mb * 2**20))
        if cfg.algorithm == "diloco":
            opt = diloco(cfg, ctx.optimizer_for(model), flat, topo.world, topo=topo)
        elif cfg.algorithm == "slowmo":
            opt = slowmo(cfg, ctx.optimizer_for(model), flat, topo.world)
        elif cfg.algorithm == "localsgd":
            from .localsgd import DEFAULT_PERIOD, DEFAULT_WARMUP_STEPS, LocalSGD

            o = cfg.options
            opt = LocalSGD(ctx.optimizer_for(model), flat, topo.world,
                           period=_given(o, "localsgd_period", DEFAULT_PERIOD),
                           warmup_steps=(DEFAULT_WARMUP_STEPS if o.get("localsgd_warmup_steps")
                                         is None else o["localsgd_warmup_steps"]))
        else:
            opt = DistributedOptimizer(ctx.optimizer_for(model), flat, topo.world,
                                       compress=compress, overlap=cfg.options.get("ssgd_overlap"),
                                       bucket_bytes=bucket,
                                       progress=cfg.options.get("ssgd_progress",
                                                                DEFAULT_PROGRESS))
    rec = SyncRecovery(ctx, enabled=flat is not None and ulfm_enabled())
    growth = join.Growth(ctx, rec)           # --grow-back: replacements join after a death
    delay = StepDelay.from_config(cfg, rank=topo.rank, size=topo.size, device=topo.device)
    if ctx.is_root and delay.active:
        log.info("ssgd: heterogeneity: %s", delay.model.describe())
    # emulated slow inter-node link (as DASO's, hpcasync.daso.comm): each step's gradient message
    # crosses it once per node, at its wire size; only a job of more than one node pays
    link = LinkDelay(cfg.options.get("link_delay_us_per_mb", 0.0) if topo.num_nodes > 1 else 0.0)
    numel = sum(p.numel() for p in model.parameters())
    wire_bytes = numel * (2 if cfg.options.get("compress", "none") != "none" and flat else 4)
    start_epoch, start_batch, loss_carry, own = 1, 0, 0.0, None
    joined = join.receive(ctx) if join.joined() else None   # a replacement: the live state
    state = ctx.resume_state() if joined is None else joined["state"]
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_epoch, start_batch, loss_carry = state["epoch"], state["batch"], state["loss_sum"]
        rec.failures = list(state.get("rank_failures", []))
        # this rank's own part (loaded after the start's broadcast, which would overwrite it)
        own = own_part(state.get(PER_RANK), topo.rank, topo.size, cfg.algorithm)

    def snapshot(epoch: int, batch: int, loss_sum: float) -> dict:
        """Everything a resumed run needs to continue bitwise: replicas are identical, so rank 0's."""
        return {"model": model.state_dict(), "optimizer": opt.state_dict(),
                "epoch": epoch, "batch": batch, "loss_sum": loss_sum,
                "rank_failures": rec.failures}

    # each rank's own state in the checkpoints (local SGD's optimizer state, PowerSGD's error
    # memory): a resume loads its own and replays the uninterrupted run
    local = getattr(opt, "local_state_dict", None)

    def start(own: dict | None) -> None:
        """Rank 0's parameters on every rank (resumed: the same anyway), then this rank's own
        part of the checkpoint resumed from (local SGD's replica between two averages)."""
        opt.broadcast_parameters(root=0)
        if own is not None:
            opt.load_local_state_dict(own)

    def load_adopted(blob: dict) -> None:
        """After a death: take the most advanced survivor's state (see SyncRecovery.recover)."""
        model.load_state_dict(blob["model"])
        opt.load_state_dict(blob["optimizer"])

    # the loop walks positions (epoch, batches done, started): after a death (ULFM) the survivors
    # adopt the most advanced position and state, and re-shard the rest of the epoch over
    # themselves (hpcasync.runtime.recovery)
    cur = EpochCursor(ctx, epoch=start_epoch, done=start_batch, loss_sum=loss_carry)
    if joined is not None:
        join.take_live_state(joined, ctx, cur, growth,
                             check=lambda: join.state_digest(model, opt, cur))
    slept, summary, device = delay.slept, None, topo.device
    while summary is None:
        topo = ctx.topo
        try:
            cur.start(lambda: start(own))
            if cur.finished:                         # the final gathers
                inject.point("final")
                if hasattr(opt, "finish"):         # localsgd, diloco: one model on every rank
                    opt.finish()
                summary = {"backend": cfg.backend, "steps": opt.steps,
                           "bytes_communicated": topo.world.allreduce(opt.bytes_sent),
                           **delay.record(),
                           "sleep_time_s": topo.world.allgather(round(delay.slept, 4))}
                if rec.failures:         # the survivors' replicas, bitwise (a test asserts it)
                    summary["replica_sha256"] = topo.world.allgather(params_digest(model))
                continue
            if cur.begin_epoch():
                slept = delay.slept
            epoch = cur.epoch
            if cur.in_epoch:
                loss = cur.backward(model, opt, delay, device)   # (a straggler sleeps in it)
                sent = _across(opt)
                opt.step()
                link.block(wire_bytes if cfg.algorithm == "ssgd" and getattr(
                    opt, "powersgd", None) is None else _across(opt) - sent)
                cur.step_done(loss.item())
                rec.step_completed()
                # (localsgd: only where the replicas are equal: between two averages a local
                # step communicates nothing, and the preemption check would; checkpoints keep
                # each rank's own optimizer state, local_state_dict)
                if cur.in_epoch and getattr(opt, "replicas_equal", True):
                    ctx.consistent_point(topo.world,
                                         lambda: snapshot(epoch, cur.done, cur.loss_sum),
                                         epoch=epoch, step=opt.steps, writer=topo.rank == 0,
                                         local_state=local)
                continue
            evaluated = contextlib.nullcontext()
            if hasattr(opt, "global_weights"):                # diloco: evaluate the global θ
                evaluated = opt.global_weights()
            elif not getattr(opt, "replicas_equal", True):    # localsgd: one model to evaluate
                opt.average_parameters()
            elif not getattr(opt, "sync_buffers", False):    # (averaged with every step otherwise)
                opt.average_buffers()
            with evaluated:
                ctx.epoch_end(epoch, model, train_loss=cur.train_loss(topo.world),
                              bytes_communicated=topo.world.allreduce(opt.bytes_sent),
                              comm_time_s=round(opt.comm_time, 4),
                              sleep_time_max_s=round(max_over(topo.world, delay.slept - slept),
                                                     4),
                              world_size=topo.size)
            ctx.consistent_point(topo.world, lambda: snapshot(epoch + 1, 0, 0.0), epoch=epoch,
                                 step=opt.steps, writer=topo.rank == 0, force=True,
                                 local_state=local)
            cur.next_epoch()
        except Exception as exc:        # noqa: BLE001 - only a dead rank is handled here
            if not rec.handles(exc):
                raise
            adopted = rec.recover(position=cur.position, load=load_adopted,
                                  state=lambda: snapshot(cur.epoch, cur.done, 0.0))
            growth.grow(adopted, adopt=lambda same: cur.adopt(
                adopted, size_before=rec.size_before,
                keep=list(range(ctx.topo.size)) if same else None),
                payload=lambda: join.live_state(ctx, cur, growth,
                                                snapshot(cur.epoch, cur.done, cur.loss_sum)),
                check=lambda: join.state_digest(model, opt, cur))
            opt.set_comm(ctx.topo.world)
    return RunResult(model=model, summary={**summary, **rec.summary(), **growth.summary()})
