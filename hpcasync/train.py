"""The training driver: algorithm-agnostic set-up around one runtime.

Order matters for failure behaviour: everything that can be checked without MPI (options,
runtime-specific option checks, a checkpoint named by ``--resume``, user code named by ``--model``,
``--dataset``, ``--loss``, ``--optimizer`` (imported, then tried: a forward pass of the model on two
training items, on the CPU), the data files, which are read whole) is checked first, so bad input
fails with one line before any rank waits on another. Then
MPI starts, the topology is built, the model is made identically on every rank, and the runtime
runs. Rank 0 writes the metrics stream and shows progress.

Bad input found once MPI runs (a world size that does not fit the algorithm, a checkpoint from
another run) leaves nothing behind: a metrics stream that holds no more than its ``config`` and
``resume`` records is removed before the error is reported. A run that diverged keeps its
``PATH.partial`` stream, ending in a ``diverged`` record.
"""
from __future__ import annotations

import functools
import logging
import platform
import sys
import time

import torch

from .config import OPTIMIZER_ALGORITHMS, TrainConfig
from .errors import DivergedError, HpcasyncError, launcher_rank
from .metrics import MetricsWriter, read_metrics
from . import inject
from .runtime import algorithms, argument_checks, ft, join, runtime_module, startup
from .runtime.logs import setup_logging
from .checkpoint import EXIT_PREEMPTED, CheckpointManager, PreemptionFlag
from .runtime.context import Preempted, Progress, RunContext
from .slurm import SlurmEnv

log = logging.getLogger("hpcasync")


def precheck(cfg: TrainConfig):
    """Checks that need no MPI: options, the runtime's own options, a checkpoint named by
    ``--resume PATH`` (intact, same algorithm and model; the world size is checked once MPI runs),
    that user code (``MODULE:FACTORY``) imports, the data files."""
    cfg.validate(algorithms())
    argument_checks(cfg)
    runtime = runtime_module(cfg.algorithm)
    if hasattr(runtime, "validate"):
        runtime.validate(cfg)
    if cfg.resume not in (None, "auto"):
        from .checkpoint import read_checkpoint

        read_checkpoint(cfg.resume, expect={"algorithm": cfg.algorithm, "model": cfg.model})
    from . import plugins

    for flag, value in (("--model", cfg.model), ("--dataset", cfg.dataset), ("--loss", cfg.loss),
                        ("--optimizer", cfg.optimizer)):
        if plugins.is_spec(value):
            plugins.load_factory(value, flag)
    from .data import locate_dataset

    locate_dataset(cfg.dataset, data_dir=cfg.data_dir, warn=False)
    return runtime


def params_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters and buffers, in order: equal digests = bitwise equal."""
    return join.digest([*model.parameters(), *model.buffers()])


_STARTUP_EVENTS = frozenset({"config", "resume"})


def discard_startup_stream(metrics: MetricsWriter) -> None:
    """Close ``metrics`` unfinished and delete its ``.partial`` file and its TensorBoard event
    file if they hold only start-up records (the run failed on its input before doing anything)."""
    if not metrics.enabled:
        return
    metrics.close(complete=False)
    try:
        events = (set(metrics.counts) if metrics.path is None
                  else {r.get("event") for r in read_metrics(metrics.partial)})
    except (OSError, ValueError):
        return
    if events <= _STARTUP_EVENTS:
        if metrics.path is not None:
            metrics.partial.unlink(missing_ok=True)
        if metrics.tb_file is not None:
            metrics.tb_file.unlink(missing_ok=True)


def train(cfg: TrainConfig) -> dict:
    """Run one training job described by ``cfg`` on the MPI world; returns the summary record."""
    runtime = precheck(cfg)

    from . import plugins
    from .data import load_dataset
    from .models import build_model
    from . import api
    from .topology import init_mpi

    # read (and so check) the data before MPI starts: a bad file is then said once, by rank 0
    setup_logging(launcher_rank())
    join.prepare_joiner()       # a replacement spawned by --grow-back (runtime.join)
    inject.point("data")
    train_set, test_set = load_dataset(cfg.dataset, data_dir=cfg.data_dir,
                                       train_limit=cfg.train_limit, test_limit=cfg.test_limit)
    # try the model, loss and optimizer on the data (CPU) while an error is still said once
    loss_fn = plugins.make_loss(cfg.loss)
    opt_kwargs = {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay}
    # (the optimizer only where the algorithm trains with it: TrainConfig.validate checked the rest)
    uses_optimizer = cfg.algorithm in OPTIMIZER_ALGORITHMS
    plugins.check_run(cfg.model, train_set, loss=cfg.loss, loss_fn=loss_fn,
                      optimizer=cfg.optimizer if uses_optimizer else None, **opt_kwargs)
    shape = {"input_shape": list(train_set.input_shape), "num_classes": train_set.num_classes}
    specs = {f"{key}_spec": {**plugins.spec_record(value, f"--{key}"), **shape}
             for key, value in (("model", cfg.model), ("dataset", cfg.dataset))
             if plugins.is_spec(value)}
    startup.entering_mpi()
    init_mpi()
    startup.done()          # from here a dead rank is ULFM's to report (errors.fail_fast)
    inject.point("mpi")
    # your own loop's start (a replacement: merged into the running job's world); the roles are
    # the runtime's, whose checks say the CLI's options (--ps-ranks), so none is asked here
    topo = api.init(None, ranks_per_node=cfg.ranks_per_node, device=cfg.device,
                    ps_rank=cfg.ps_rank, threads=cfg.threads or None, seed=cfg.seed,
                    fail_fast=False).topology     # (the CLI's own: errors.run_main)
    # the rank that logs, writes metrics and shows progress (a PS runtime: the PS rank); a
    # joiner never does (a survivor holds the stream)
    report = runtime.reporting_rank(topo) if hasattr(runtime, "reporting_rank") else 0
    report = -1 if join.joined() else report
    setup_logging(topo.rank, report_rank=report)
    if topo.rank == report:
        log.info("hpcasync %s: %s", cfg.algorithm, topo.describe())
        if cfg.device != "cpu" and topo.device == "cpu":
            log.info("no GPU visible: running on the CPU")
    asked = [f"--{k.replace('_', '-')}" for k in ("grow_back", "min_ranks") if cfg.options.get(k)]
    if asked and not ft.ulfm_enabled():
        ft.say_without_ulfm(" and ".join(asked), topo.rank)

    def make_model() -> torch.nn.Module:
        torch.manual_seed(cfg.seed)
        return build_model(cfg.model, train_set.input_shape, train_set.num_classes).to(topo.device)

    progress_on = cfg.progress == "on" or (cfg.progress == "auto" and sys.stderr.isatty())
    metrics = MetricsWriter(cfg.metrics, enabled=topo.rank == report, tensorboard=cfg.tensorboard,
                            keep_previous=bool(cfg.resume))     # (the resumed run's records)
    checkpoints = (CheckpointManager(cfg.checkpoint_dir, keep=cfg.checkpoint_keep)
                   if cfg.checkpoint_dir else None)
    ctx = RunContext(cfg=cfg, topo=topo, train=train_set, test=test_set, make_model=make_model,
                     metrics=metrics, progress=Progress(progress_on and topo.rank == report),
                     checkpoints=checkpoints, preempt=PreemptionFlag(),
                     checkpoint_every=cfg.checkpoint_every, loss_fn=loss_fn,
                     make_optimizer=functools.partial(plugins.make_optimizer, cfg.optimizer,
                                                      **opt_kwargs))
    metrics.write("config", config=cfg.to_record(), world_size=topo.size,
                  num_nodes=topo.num_nodes, ranks_per_node=topo.local_size, device=topo.device,
                  threads_per_rank=torch.get_num_threads(), torch=torch.__version__,
                  python=platform.python_version(),
                  train_size=len(train_set), test_size=len(test_set),
                  slurm=SlurmEnv.from_environ().record(), **shape, **specs)
    t0 = time.time()
    try:
        result = runtime.run(ctx)
    except Preempted as stop:
        metrics.write("preempted", reason=str(stop), steps=ctx.steps)
        metrics.close(complete=False)
        if topo.rank == 0:
            log.warning("%s: exiting with status %d so the scheduler can requeue the job",
                        stop, EXIT_PREEMPTED)
        sys.stdout.flush()
        sys.exit(EXIT_PREEMPTED)
    except DivergedError as exc:
        metrics.write("diverged", reason=str(exc), steps=ctx.steps)
        metrics.close(complete=False)
        raise
    except HpcasyncError:
        discard_startup_stream(metrics)
        raise
    finally:
        ctx.preempt.restore()
    # a replacement that joined (runtime.join) took the run's start (ctx.t0) with the live state
    wall = time.time() - (ctx.t0 if join.joined() else t0)
    if ctx.topo is not topo:      # the run survived dead ranks (runtime.recovery, ps.takeover)
        topo = ctx.topo
        report = runtime.reporting_rank(topo) if hasattr(runtime, "reporting_rank") else 0
    last = ctx.history[-1] if ctx.history else {}
    summary = {"algorithm": cfg.algorithm, "world_size": topo.size, "model": cfg.model,
               "dataset": cfg.dataset, "epochs": cfg.epochs,
               "params_sha256": params_digest(result.model),
               "test_accuracy": last.get("test_accuracy"), "test_loss": last.get("test_loss"),
               "wall_time_s": round(wall, 3), **result.summary}
    metrics.write("summary", **summary)
    metrics.close()
    if metrics.kept is not None:
        log.warning("--metrics %s held a run's records: kept as %s", cfg.metrics, metrics.kept)
    if topo.rank == report:
        if cfg.resume and not ctx.history:
            log.warning("the checkpoint resumed from had trained --epochs %d already: nothing was "
                        "trained (raise --epochs to go on)", cfg.epochs)
        acc = summary["test_accuracy"]
        log.info("done: %s on %d ranks, test accuracy %s, %.1f s", cfg.algorithm, topo.size,
                 f"{100 * acc:.2f}%" if acc is not None else "n/a", wall)
    topo.free()
    join.release(topo)          # (a run that grew: before MPI_Finalize)
    return summary
