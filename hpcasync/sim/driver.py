"""``hpcasync sim``: N virtual workers in one process, on a simulated clock.

Takes every option of ``hpcasync train`` (same config object, same validation, data, models and
metrics stream) plus ``--workers N`` and ``--sim-step-time``; the delay model is the one of the
real runtimes (``--hetero``, ``--straggler``, ``--compute-time``, ``--push-delay``). Asynchronous
algorithms drive the very same rule objects as the MPI parameter server (``engine.AsyncSim``);
``ssgd`` runs as synchronous rounds paced by the slowest worker (``engine.SyncSim``).

The JSONL stream has the records of a real run (``config``, ``epoch``, ``summary``), each epoch and
the summary with ``sim_time`` (simulated seconds: a natural step takes ``--sim-step-time``) and the
PS memory the MPI run would have (``ps_state_bytes``, ``ps_transport_bytes`` for ``--ps-transport``,
``ps_buffers_bytes``, ``ps_total_bytes``: ``ps.memory``; the measured ``ps_transport_peak_bytes``
is the MPI run's only). A run
is bit-reproducible: the same options give the same stream except the wall-clock fields
(``time_s``, ``wall_time_s``). No MPI is used. ``--sim-ps-service-time`` and ``--ps-ranks K`` model
the server's service time and K shard servers (``engine``: FIFO queue, ``ps_busy``/``ps_wait_s``
in the epoch records). A diverging run stops with one line, as a real one
(``RunContext.divergence``: every round's mean loss / every accepted push's loss is checked).

Example::

    hpcasync sim --algorithm asgd --workers 32 --dataset fashion-mnist --epochs 1 --hetero HE1
"""
from __future__ import annotations

import logging
import platform
import sys
import time
from types import SimpleNamespace

import torch

from .. import registry
from ..errors import ConfigError

log = logging.getLogger("hpcasync")


class _LocalComm:
    """The one-process stand-in for a communicator in ``evaluate`` (size 1: no reduction)."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1


#: ``hpcasync train`` options the simulator has no use for: given (not at the parser's
#: default), they would be ignored, so :func:`check` refuses them (the families' own options
#: are refused by ``runtime.argument_checks`` when they are not the algorithm's; SSGD's bucket
#: options and emulated link, which the simulator's SSGD has no use for, are listed here)
TRAIN_ONLY = ("ranks_per_node", "checkpoint_dir", "resume", "checkpoint_every", "checkpoint_keep",
              "grow_back", "max_ranks", "min_ranks", "ssgd_overlap", "ssgd_bucket_mb",
              "ssgd_progress", "link_delay_us_per_mb")


def check(cfg) -> None:
    """Pre-run checks: the driver's precheck plus the simulator's options."""
    from ..train import precheck

    workers = cfg.options.get("workers")
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"--workers must be a positive integer, got {workers!r}")
    step = cfg.options.get("sim_step_time")
    if not isinstance(step, (int, float)) or not step > 0 or step == float("inf"):
        raise ConfigError(f"--sim-step-time must be a finite number > 0, got {step!r}")
    service = cfg.options.get("sim_ps_service_time", 0.0)
    if not isinstance(service, (int, float)) or not 0 <= service < float("inf"):
        raise ConfigError(f"--sim-ps-service-time must be a finite number >= 0, got {service!r}")
    shards = cfg.options.get("ps_ranks", 1)
    if not isinstance(shards, int) or shards < 1:
        raise ConfigError(f"--ps-ranks must be a positive integer, got {shards!r}")
    for flag, value, default in (("--optimizer", cfg.optimizer, "sgd"),
                                 ("--loss", cfg.loss, "cross_entropy")):
        if value != default:
            raise ConfigError(f"{flag} {value}: the simulator trains with SGD and cross entropy; "
                              f"{flag} applies to hpcasync train")
    if cfg.options.get("compress", "none") != "none":
        raise ConfigError("--compress applies to hpcasync train: the simulator averages "
                          "uncompressed gradients")
    if cfg.algorithm not in registry.simulated_names():
        raise ConfigError(f"the simulator runs {', '.join(registry.simulated_names())}; "
                          f"not {cfg.algorithm}")
    if cfg.backend != "mpi":
        raise ConfigError("the simulator does not use --backend; leave it at mpi")
    from ..options import command_parser

    pristine = command_parser("sim")
    for name in TRAIN_ONLY:
        default = pristine.get_default(name)
        if (getattr(cfg, name) if hasattr(cfg, name) else cfg.options.get(name, default)) != default:
            raise ConfigError(f"--{name.replace('_', '-')} applies to hpcasync train: the "
                              "simulator runs in one process, without MPI")
    if cfg.device == "cuda":
        raise ConfigError("--device cuda applies to hpcasync train: the simulator runs on the CPU")
    precheck(cfg)


def simulate(cfg) -> dict:
    """Run the simulation described by ``cfg``; returns the summary record."""
    from ..data import load_dataset
    from ..hetero import DelayModel
    from ..metrics import MetricsWriter
    from ..models import build_model
    from ..runtime.context import Progress, RunContext, seed_everything
    from ..runtime.logs import setup_logging
    from ..train import params_digest

    check(cfg)
    setup_logging(0)
    W = cfg.options["workers"]
    threads = cfg.threads or 1          # one process: more threads rarely pay for lenet-sized steps
    torch.set_num_threads(threads)
    seed_everything(cfg.seed)
    train_set, test_set = load_dataset(cfg.dataset, data_dir=cfg.data_dir,
                                       train_limit=cfg.train_limit, test_limit=cfg.test_limit)
    if len(train_set) // W < cfg.batch_size:
        raise ConfigError(f"each of the {W} workers gets {len(train_set) // W} training examples, "
                          f"fewer than one batch of {cfg.batch_size}")
    synchronous = not registry.get(cfg.algorithm).is_ps
    # rank numbering of the real job this simulates: the PS is --ps-rank (async), no PS (sync)
    ranks = list(range(W)) if synchronous else [r for r in range(W + 1) if r != cfg.ps_rank]
    if not synchronous and cfg.ps_rank > W:
        raise ConfigError(f"--ps-rank {cfg.ps_rank} does not exist in a job of {W} workers + PS")
    delay = DelayModel.from_options(cfg.options, worker_ranks=ranks, seed=cfg.seed)

    def make_model() -> torch.nn.Module:
        torch.manual_seed(cfg.seed)
        return build_model(cfg.model, train_set.input_shape, train_set.num_classes)

    progress_on = cfg.progress == "on" or (cfg.progress == "auto" and sys.stderr.isatty())
    metrics = MetricsWriter(cfg.metrics, tensorboard=cfg.tensorboard)
    topo = SimpleNamespace(rank=0, size=1, device="cpu", world=_LocalComm(), ps_rank=cfg.ps_rank)
    ctx = RunContext(cfg=cfg, topo=topo, train=train_set, test=test_set, make_model=make_model,
                     metrics=metrics, progress=Progress(progress_on))
    metrics.write("config", config=cfg.to_record(), world_size=W if synchronous else W + 1,
                  simulated=True, workers=W, delay=delay.to_record(), num_nodes=1,
                  ranks_per_node=1, device="cpu", threads_per_rank=threads,
                  torch=torch.__version__, python=platform.python_version(),
                  train_size=len(train_set), test_size=len(test_set))
    log.info("sim %s: %d virtual workers, %s", cfg.algorithm, W, delay.describe())
    t0 = time.time()
    model = make_model()
    if synchronous:
        extra = _run_sync(ctx, model, delay, W)
    else:
        extra = _run_async(ctx, model, delay, W)
    wall = time.time() - t0
    last = ctx.history[-1] if ctx.history else {}
    summary = {"algorithm": cfg.algorithm, "world_size": W if synchronous else W + 1,
               "model": cfg.model, "dataset": cfg.dataset, "epochs": cfg.epochs,
               "test_accuracy": last.get("test_accuracy"), "test_loss": last.get("test_loss"),
               "wall_time_s": round(wall, 3), "simulated": True, "workers": W,
               "params_sha256": params_digest(model), **extra}
    metrics.write("summary", **summary)
    metrics.close()
    acc = summary["test_accuracy"]
    log.info("done: sim %s with %d workers, test accuracy %s, simulated %.2f s, wall %.1f s",
             cfg.algorithm, W, f"{100 * acc:.2f}%" if acc is not None else "n/a",
             extra["sim_time"], wall)
    return summary


def _run_async(ctx, model, delay, W: int) -> dict:
    from ..ps.memory import memory_record
    from ..ps.runtime import build_rule, lr_factor_of
    from .engine import AsyncSim

    cfg = ctx.cfg
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).float()
    rule, worker_rule = build_rule(cfg, theta0, W), build_rule(cfg, theta0, W)
    oracle = cfg.algorithm == "lcasgd" and cfg.options.get("lc_predictor") == "oracle"
    log_every = cfg.log_every

    def memory() -> dict:
        """The PS memory the MPI run would have (``ps.memory``: rule + the transport of
        ``--ps-transport``, its bound, + the buffer table), computed without MPI."""
        return memory_record(cfg.options.get("ps_transport", "rma"), W, sim.flat.numel,
                             sim.flat.buffer_numel, rule.state_bytes())

    def on_epoch(epoch: int, record: dict) -> None:
        train_loss = record.pop("train_loss")
        ctx.epoch_end(epoch, model, train_loss=train_loss, eval_comm=_LocalComm(), **record,
                      **memory(), lr=rule.lr)
        if epoch < cfg.epochs:
            ctx.progress.start(sim.pushes_per_epoch, f"epoch {epoch + 1}/{cfg.epochs}")

    def on_push(w: int, tau: int, loss: float, t: float) -> None:
        ctx.progress.update(1, loss=loss, tau=tau)
        n = sim.stats.accepted
        ctx.divergence.check(loss, step=n)
        if log_every and n % log_every == 0:
            ctx.metrics.write("push", push=n, worker=w, version=rule.version - rule.moved,
                              staleness=tau, loss=loss, lr=rule.lr, sim_time=t)

    sim = AsyncSim(rule, worker_rule, model, ctx.train, delay, num_workers=W, epochs=cfg.epochs,
                   batch_size=cfg.batch_size, seed=cfg.seed,
                   step_time=cfg.options["sim_step_time"], on_epoch=on_epoch,
                   lr_factor=lr_factor_of(cfg, W), oracle=oracle, on_push=on_push,
                   service_time=cfg.options.get("sim_ps_service_time", 0.0),
                   shards=cfg.options.get("ps_ranks", 1))
    rule.check_run_length(sim.pushes_per_epoch * cfg.epochs)    # (the MPI server's check)
    ctx.progress.start(sim.pushes_per_epoch, f"epoch 1/{cfg.epochs}")
    stats = sim.run()
    ctx.progress.close()
    return {**stats.summary(), "sim_time": sim.sim_time, **memory(),
            "rule_workers": rule.worker_summary()}


def _run_sync(ctx, model, delay, W: int) -> dict:
    from .engine import SyncSim

    cfg = ctx.cfg

    def on_epoch(epoch: int, record: dict) -> None:
        train_loss = record.pop("train_loss")
        ctx.epoch_end(epoch, model, train_loss=train_loss, eval_comm=_LocalComm(), **record)
        if epoch < cfg.epochs:
            ctx.progress.start(sim.per_worker, f"epoch {epoch + 1}/{cfg.epochs}")

    def on_round(loss: float, t: float) -> None:
        ctx.progress.update(1, loss=loss)
        ctx.divergence.check(loss, step=sim.rounds)

    sim = SyncSim(model, ctx.train, delay, num_workers=W, epochs=cfg.epochs,
                  batch_size=cfg.batch_size, seed=cfg.seed, lr=cfg.lr, momentum=cfg.momentum,
                  weight_decay=cfg.weight_decay, step_time=cfg.options["sim_step_time"],
                  on_epoch=on_epoch, on_round=on_round)
    ctx.progress.start(sim.per_worker, f"epoch 1/{cfg.epochs}")
    sim.run()
    ctx.progress.close()
    return {"sim_time": sim.sim_time, "rounds": sim.rounds}


def main(ns) -> int:
    """The ``hpcasync sim`` handler."""
    from ..config import config_from_args

    simulate(config_from_args(ns))
    return 0
