"""The asynchronous parameter server (ASGD, DC-ASGD, LC-ASGD, SHAT, SMEGA2, DANA-Zero, NAG-ASGD).

One rank (``--ps-rank``, default 0) serves; every other rank is a worker. The PS owns MPI RMA
windows with one slot per worker (``ps.transport``), applies the algorithm's update rule to each
push (``ps.server``) and answers that worker; workers train their shards (``ps.worker``). The
rule objects are the same ones the simulator drives (``hpcasync.rules``, ``hpcasync.sim``).

Example::

    mpiexec -n 4 hpcasync train --algorithm dcasgd-a --dataset fashion-mnist --epochs 2 --hetero HE1

Design: docs/design/ps.md#cli-runtime (epochs, options, the decisions: budget, rejected pushes,
LC-ASGD's oracle, warm-up, buffers, checkpoints, worker-local models, failures, divergence).
"""
from __future__ import annotations

import logging
import os
import time

import torch

from .. import inject
from ..errors import CheckpointError, ConfigError, TopologyError, proc_failure
from ..hetero import DelayModel
from ..hetero import check_options as check_hetero
from .. import registry
from ..rules import make_rule, ps_lr_factor, rule_hyperparameters
from ..rules.base import STOP_IN_SIM_ONLY
from ..runtime import ft, join
from ..runtime.context import Preempted, RunContext, RunResult
from .serving import serve
from .shards import align_resume, check_shards
from .growth import PSGrowth, Regrow, grow, receive, worker_view
from .options import add_arguments, validate_options  # noqa: F401 (the runtime's options)
from .growth import validate as validate_growth
from .takeover import (ServerLost, StartupLost, Takeover, fault_tolerance, known_dead,
                       restart_without_the_dead, take_over)
from .wire import END_GROW

log = logging.getLogger("hpcasync")

#: the parameter-server algorithms, a live view of :mod:`hpcasync.registry`
ALGORITHMS = registry.LiveNames(registry.ps_names)


def rule_hyper(cfg) -> dict:
    """The keyword arguments of ``make_rule(cfg.algorithm, ...)`` from the config."""
    alg, opt = registry.get(cfg.algorithm), cfg.options
    accepted = rule_hyperparameters(alg.name)
    hyper = {"lr": cfg.lr}
    if "weight_decay" in accepted:
        hyper["weight_decay"] = cfg.weight_decay
    if "momentum" in accepted:
        hyper["momentum"] = cfg.momentum if alg.momentum_rule else opt.get("ps_momentum", 0.0)
    hyper.update(registry.given(alg.name, opt))   # the options this algorithm owns
    if "seed" in accepted:                       # lcasgd's LSTM predictor
        hyper["seed"] = cfg.seed
    return hyper


def build_rule(cfg, theta0: torch.Tensor, num_workers: int):
    """The PS rule of ``cfg.algorithm`` (also the worker-side instance, and the simulator's)."""
    return make_rule(cfg.algorithm, theta0, num_workers, **rule_hyper(cfg))


def lr_factor_of(cfg, num_workers: int):
    """The rule's lr schedule as a factor of the workers' lr (``rules.ps_lr_factor``), from
    ``--ps-warmup-epochs``; None for a constant lr."""
    return ps_lr_factor(cfg.algorithm, num_workers, cfg.options.get("ps_warmup_epochs"))


def validate(cfg) -> None:
    """Pre-MPI checks: options that belong to another algorithm, the rule's hyperparameters
    (built on a 1-element θ), the heterogeneity options."""
    opt = cfg.options
    validate_options(cfg)
    probe = build_rule(cfg, torch.zeros(1), 1)
    simulated = "workers" in opt            # (hpcasync sim's config: its --workers)
    if getattr(probe, "stop_stale", False) and not simulated:      # (ParameterServer's check)
        raise ConfigError(STOP_IN_SIM_ONLY)
    check_hetero(opt)
    join.validate(cfg)
    validate_growth(cfg)
    shards = opt.get("ps_ranks", 1)
    world = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
    if join.is_joiner():                # a replacement's own launch: the grown world counts
        world = None
    check_shards(shards, int(world) if world and world.isdigit() else shards + 1,
                 algorithm=cfg.algorithm)


def check_resumed_data(state: dict, cfg, batches_per_worker: int) -> None:
    """A checkpoint resumed goes on with each worker's position in batches of its shuffle:
    another batch count per worker and epoch (``--train-limit``, ``--batch-size``) or another
    ``--seed`` would continue in other batches; one line."""
    if state.get("batches_per_worker") != batches_per_worker:
        raise CheckpointError(f"checkpoint has {state.get('batches_per_worker')} batches per "
                              f"worker and epoch, this run {batches_per_worker} (another "
                              "--train-limit or --batch-size?)")
    if state.get("data_seed", cfg.seed) != cfg.seed:
        raise CheckpointError(f"checkpoint was written with --seed {state['data_seed']}, this "
                              f"run has --seed {cfg.seed}: each worker's rest of its epoch "
                              "would be another shuffle's; resume with the same --seed")


def reporting_rank(topo) -> int:
    """The rank that evaluates, writes metrics and shows progress: the PS."""
    return topo.ps_rank


def run(ctx: RunContext) -> RunResult:
    """The PS runtime; under ULFM a dead server is replaced by a worker and the run goes on
    (:mod:`.takeover`); with ``--grow-back`` a replacement takes each dead rank's place
    (:mod:`.growth`)."""
    takeover = lost = state = None
    growth, core = PSGrowth.from_options(ctx), fault_tolerance(ctx)
    ctx.ft = core         # (its ``original``: ids in records, the first launch's ranks)
    if join.joined():                   # a replacement: what the survivors go on from
        state, takeover = _joiner_start(receive(ctx, core))
    while True:
        try:
            result = _run(ctx, takeover, growth, state)
            result.summary.update({"rank_joins": core.joins} if core.joins else {})
            return result
        except ServerLost as exc:
            lost, state = exc, None
            takeover = _grown(ctx, core, growth, take_over(ctx, core, lost, takeover))
        except StartupLost:
            state = None
            if takeover is None:        # every copy of θ is the initial one
                restart_without_the_dead(ctx, core)
            else:                       # not from the initial θ: from what the workers hold
                takeover = _grown(ctx, core, growth,
                                  take_over(ctx, core, lost, takeover, again=True))
        except Regrow as stop:
            state, takeover = _regrow(ctx, core, growth, stop), None


def _grown(ctx: RunContext, core, growth: PSGrowth, takeover: Takeover) -> Takeover:
    """After a takeover (collective over the survivors), with ``--grow-back``: the new server
    spawns a replacement for each dead rank, which joins as a worker in its place
    (:func:`.growth.grow`); every worker then resumes at the takeover's share of its budget."""
    if grow(ctx, core, growth, {"kind": "takeover", "share": takeover.share,
                                "records": takeover.records},
            position=[round(takeover.share, 6)]) is None:
        return takeover
    if takeover.survivors is not None:    # the new server's table, in the grown world's order
        joiners = core.joins[-1]["ranks"]
        rows: list = [None] * ctx.topo.size
        for r, b in zip([r for r in range(ctx.topo.size) if r not in joiners],
                        takeover.survivors):
            rows[r] = b
        takeover.survivors = rows
    return takeover


def _joiner_start(blob: dict) -> tuple[dict | None, Takeover | None]:
    """A replacement's start (:mod:`.growth`): after a worker's death the server's state (a
    worker's view of it), after a takeover the takeover's share of the budget."""
    if blob["kind"] == "takeover":
        return None, Takeover(share=blob["share"], theta=None, records=blob["records"])
    return blob["state"], None


def _regrow(ctx: RunContext, core, growth: PSGrowth, stop: Regrow) -> dict:
    """Every survivor, after the server stopped the workers for a grow-back: the death absorbed
    (the world of the survivors), the world grown back (:func:`.growth.grow`, collective over
    them and the joiners), and the state the run goes on from — the server's own state on the
    server, a worker's view of it elsewhere (its own local model kept)."""
    core.absorb(stop.comm)
    server = stop.state is not None
    blob = grow(ctx, core, growth, {"kind": "worker",
                                    "state": worker_view(stop.state) if server else None},
                position=list(stop.state["ps"]["positions"]) if server else None)
    if blob is None:    # (cannot happen: the server stopped the workers once a spawn worked)
        raise TopologyError("grow-back: no replacement joined after the stop")
    if server:
        return stop.state
    state = dict(blob["state"])
    if stop.local is not None:          # SHAT/ENSEMBLE: this worker's own model goes on
        worker = [r for r in range(ctx.topo.size) if r != ctx.topo.ps_rank].index(ctx.topo.rank)
        locals_ = [None] * len(state["seen"])
        locals_[worker] = stop.local
        state["worker_locals"] = locals_
    return state


def _run(ctx: RunContext, takeover: Takeover | None, growth: PSGrowth,
         grown: dict | None = None) -> RunResult:
    """One run over the current world: from ``takeover`` (a worker took over a dead server),
    from ``grown`` (the state in memory after a grow-back, :mod:`.growth`), else from the start
    or ``--resume``."""
    from mpi4py import MPI

    from ..topology import server_ranks
    from .. import api
    from .worker import run_worker, send_local

    cfg, topo = ctx.cfg, ctx.topo
    K = check_shards(cfg.options.get("ps_ranks", 1), topo.size,      # every rank, before MPI work
                     algorithm=cfg.algorithm)
    servers = server_ranks(topo.ps_rank, K, topo.size)
    worker_ranks = [r for r in range(topo.size) if r not in servers]
    W = len(worker_ranks)
    if W < 1:
        raise TopologyError(f"{cfg.algorithm} needs a parameter server and at least one worker: "
                            f"start 2 or more ranks")
    if len(ctx.train) // W < cfg.batch_size:
        raise ConfigError(f"each of the {W} workers gets {len(ctx.train) // W} training examples, "
                          f"fewer than one batch of {cfg.batch_size}")
    delay = DelayModel.from_options(cfg.options, worker_ranks=worker_ranks, seed=cfg.seed)
    batches_per_worker = (len(ctx.train) // W) // cfg.batch_size
    state = grown if grown is not None else ctx.resume_state() if takeover is None else None
    if state is not None and state.get("ps_ranks", 1) != K:
        raise CheckpointError(f"checkpoint was written by {state.get('ps_ranks', 1)} server "
                              f"ranks (--ps-ranks), this run has {K}")       # every rank raises
    if state is not None:
        check_resumed_data(state, cfg, batches_per_worker)      # every rank raises
    stop_flag = (lambda: ctx.preempt.requested) if ctx.preempt is not None else None
    try:
        inject.point("startup")
        if takeover is not None and takeover.opt is not None:
            # the run's optimizer set up again on the survivors (your own loop's take_over): the
            # new server from the takeover's θ, fresh rules, the budget over the new workers
            opt, own = takeover.opt, takeover.own_buffers
            opt.steps_per_epoch = batches_per_worker
            opt.take_over(topo.world, topo.ps_rank, {
                "vote": (None, 0, None, None), "theta": None, "local": None,
                "buffers": own if own is not None else opt.flat.buffers.clone()},
                ps_ranks=K, theta=takeover.theta, survivors=takeover.survivors)
        else:
            if takeover is not None:        # a replacement joining after a takeover (.growth)
                inject.point("adopt", fire=topo.is_ps)
            opt = api.optimizer(cfg.algorithm, ctx.make_model(), comm=topo.world,
                                ps_rank=topo.ps_rank,
                                transport=cfg.options.get("ps_transport", "rma"), ps_ranks=K,
                                steps_per_epoch=batches_per_worker, epochs=cfg.epochs,
                                warmup_epochs=cfg.options.get("ps_warmup_epochs"),
                                start=False, **rule_hyper(cfg))     # (your own loop's call)
    except MPI.Exception:               # a death while setting up (ULFM): start again without it
        if not (ft.ulfm_enabled() and known_dead(topo.world)):
            raise
        raise StartupLost() from None
    if not opt.attached:                # the constructor met the death and stayed unattached
        raise StartupLost()
    model = opt.flat.module
    flat = opt.flat
    if takeover is not None:
        if topo.is_ps:
            inject.dump(f"adopted{len(takeover.records)}-{ctx.ft.original[topo.rank]}",
                         theta=flat.params)
    if state is not None and K > 1:    # each server its shard's file, positions aligned
        base = (ctx.checkpoints.directory if ctx.checkpoints is not None
                else os.path.dirname(os.path.abspath(cfg.resume)))
        state = align_resume(opt, base, state, ctx.checkpoint_header())
    summary: dict = {}
    ulfm = ft.ulfm_enabled()
    if opt.is_server:
        log.info("%s: PS rank%s %s, %d workers, transport %s, %s; %s", cfg.algorithm,
                 "s" if K > 1 else "", ", ".join(map(str, servers)), W, opt.transport.name,
                 delay.describe(), ft.describe(ulfm))
        try:
            summary, stopping = serve(ctx, opt, model, W, batches_per_worker, state, stop_flag,
                                      ulfm, takeover, growth)
        except Exception as exc:    # noqa: BLE001 - K > 1: another server died (ps.takeover)
            if not (ulfm and K > 1 and proc_failure(exc)):
                raise
            raise ServerLost(opt, [], cfg.epochs * batches_per_worker) from None
    else:
        oracle = cfg.algorithm == "lcasgd" and cfg.options.get("lc_predictor") == "oracle"
        start = 0 if takeover is None else int(takeover.share * cfg.epochs * batches_per_worker)
        if state is not None:          # its position, and its buffers as of its last push
            start = int(state["ps"]["positions"][opt.worker])
            if state["seen"][opt.worker]:
                flat.buffers.copy_(state["buffers"][opt.worker])
            elif state.get("mean_buffers") is not None:     # a replacement (.growth)
                flat.buffers.copy_(state["mean_buffers"])
            saved = state.get("worker_locals")     # SHAT/ENSEMBLE: its own model (stop checkpoint)
            if opt.keeps_local and saved and saved[opt.worker] is not None:
                opt.resume_local(saved[opt.worker])
        kept = (takeover is not None and takeover.local is not None and opt.keeps_local
                and start < cfg.epochs * batches_per_worker)
        if kept:                    # SHAT/ENSEMBLE after a takeover: its own model goes on
            opt.resume_local(takeover.local)
        try:
            if kept:                # (the first reply, then the local model: a testing hook's)
                opt.start()
                inject.dump(f"resumed{len(takeover.records)}-{ctx.ft.original[topo.rank]}",
                             local=flat.params)
            wstats = run_worker(opt, model, ctx.train, epochs=cfg.epochs,
                                batch_size=cfg.batch_size, seed=cfg.seed, device=topo.device,
                                delay=None if delay.trivial else delay, oracle=oracle,
                                after_step=ctx.after_step,
                                start_step=start, stop_requested=stop_flag, loss_fn=ctx.loss_fn)
            stopping = opt.finish(stop_requested=None if wstats.stop_sent or wstats.stopped
                                  else stop_flag,
                                  collective=False)
            if opt.transport.end_code == END_GROW:
                stopping = "grow"               # every rank leaves for a grow-back (.growth)
            elif stopping and opt.keeps_local and ctx.checkpoints is not None:
                send_local(opt)                 # into the PS's stop checkpoint
        except MPI.Exception as exc:
            dead = ft.failed_ranks(topo.world, exc) if ulfm else None
            if dead is None:
                raise
            # a worker talks only to the server(s): one died (ps.takeover)
            raise ServerLost(opt, dead, cfg.epochs * batches_per_worker) from None
        summary = {"worker": opt.worker, "worker_steps": wstats.steps,
                   "worker_sleep_s": round(wstats.sleep_time, 3),
                   "worker_compute_s": round(wstats.compute_time, 3),
                   "worker_cpu_s": round(wstats.cpu_time, 3),
                   "worker_wait_s": round(opt.transport.wait_time, 3),
                   "worker_start_step": wstats.start_step}
    # the survivors (all ranks without ULFM) go on together; a dead rank cannot free windows
    inject.point("final")
    comm, lost = ft.survivors(topo.world, ulfm)
    root = ft.translate(topo.ps_rank, topo.world, comm) if lost else topo.ps_rank
    opt.close(comm, root, collective=not lost, broadcast_model=False)
    gone = [r for r in servers if lost and ft.translate(r, topo.world, comm) < 0]
    if stopping == "grow" and not gone:
        raise Regrow(comm, growth.state if opt.is_server else None,
                     opt.local_model() if opt.keeps_local and not opt.is_server else None)
    if gone:                 # a server (of any shard) died after the end messages
        if comm.Get_rank():  # the first survivor says it once; its MPI_Abort ends this wait
            time.sleep(10)
        raise _ps_failed(gone[0])
    if stopping:             # the PS has written the checkpoint (if any) before closing
        comm.Barrier()
        raise Preempted("preempted: the parameter server stopped every worker after its "
                        "current push")
    opt.hand_out(comm, root)    # every rank ends with the PS's θ (and its averaged buffers)
    per_worker = comm.gather(summary if not opt.is_server else None, root=root)
    if topo.is_ps:
        summary["workers"] = [s for s in per_worker if s is not None]
        summary["hetero"] = delay.to_record()
        ft.record_late_deaths(summary, lost, worker_ranks)
    summary = comm.bcast(summary, root=root)
    return RunResult(model=model, summary=summary)


def _ps_failed(rank: int) -> ft.PSFailed:
    return ft.PSFailed(f"the parameter server (rank {rank}) died; the run cannot go on: "
                       "resume from its last checkpoint with --resume auto")


