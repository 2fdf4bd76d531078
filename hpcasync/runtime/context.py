"""What the driver hands a runtime, and what a runtime hands back.

The driver (``hpcasync.train``) owns data, model construction, metrics, progress and evaluation;
a runtime owns only its communication pattern and update loop. ``RunContext.epoch_end`` is the one
place an epoch is evaluated, logged and recorded, so every algorithm reports the same way.

Divergence (:mod:`.divergence`): ``ctx.divergence`` watches the losses passed to ``step_done``
(a runtime without ``step_done``, such as the parameter server, calls ``ctx.divergence.check``
itself); ``epoch_end`` refuses a model with non-finite weights, and ``consistent_point`` a
state with non-finite values, each with :class:`~hpcasync.errors.DivergedError` before anything is
recorded or saved.
"""
from __future__ import annotations

import logging
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from .. import inject
from ..checkpoint import PER_RANK, gather_own
from .divergence import DEFAULT_FACTOR, DivergenceGuard

log = logging.getLogger("hpcasync")


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, comm=None, *, batch_size: int = 1000,
             device: str = "cpu", loss_fn: Callable | None = None,
             predictions: bool = False) -> tuple:
    """Mean loss and accuracy of ``model`` on ``dataset``; collective over ``comm`` when given.

    Every rank of ``comm`` evaluates a contiguous slice and the sums are allreduced, so the result is
    the full-set figure on every rank (the model must be identical on those ranks).

    ``loss_fn(output, target)`` is the batch-mean loss (default cross entropy); it is summed as
    mean × batch size (torch's cross entropy and NLL are summed directly, ``reduction="sum"``).
    With ``predictions`` a third value: the share of the images whose predicted class is the
    most predicted one (1.0: a constant predictor; None for outputs that are not one row of
    class scores per image).
    """
    if loss_fn is None:
        loss_fn = F.cross_entropy
    summed = loss_fn in (F.cross_entropy, F.nll_loss)
    n = len(dataset)
    rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    lo, hi = n * rank // size, n * (rank + 1) // size
    was_training = model.training
    model.eval()
    loss_sum, correct, counts = 0.0, 0, None
    for start in range(lo, hi, batch_size):
        stop = min(hi, start + batch_size)
        x = dataset.images[start:stop].to(device, non_blocking=True)
        y = dataset.labels[start:stop].to(device, non_blocking=True)
        out = model(x)
        if summed:
            loss_sum += float(loss_fn(out, y, reduction="sum"))
        else:
            loss_sum += float(loss_fn(out, y)) * (stop - start)
        predicted = out.argmax(1)
        correct += int((predicted == y).sum())
        if predictions and out.dim() == 2:
            c = torch.bincount(predicted.cpu(), minlength=out.shape[1]).double().numpy()
            counts = c if counts is None else counts + c
    model.train(was_training)
    if comm is not None and size > 1:
        from mpi4py import MPI

        if predictions:     # (a rank with no image to score counted nothing: the widest row)
            width = comm.allreduce(0 if counts is None else len(counts), op=MPI.MAX)
            counts = np.zeros(width) if counts is None else counts
        sums = np.array([loss_sum, correct, *(counts if predictions else ())],
                        dtype=np.float64)   # exact for counts < 2**53
        comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
        loss_sum, correct, counts = float(sums[0]), int(sums[1]), sums[2:]
    if not predictions:
        return loss_sum / n, correct / n
    top = None if counts is None or not len(counts) else float(counts.max()) / n
    return loss_sum / n, correct / n, top


def constant_predictor(top_share: float, labels) -> bool:
    """Whether a model that gives ``top_share`` of the test images one class (:func:`evaluate`'s
    third value) has collapsed: at least 99 % of them, on a test set whose most common label
    is under 90 % of its images (where one class is the right answer for nearly all, it is
    not a sign of anything)."""
    labels = torch.as_tensor(labels).reshape(-1)
    if top_share < 0.99 or not len(labels) or labels.is_floating_point() or labels.min() < 0:
        return False                # (not class indices: nothing to compare with)
    return float(torch.bincount(labels.long()).max()) / len(labels) < 0.9


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators with ``seed`` (every rank alike)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def mean_over(comm, value: float) -> float:
    """The mean of a Python number over the ranks of ``comm`` (on every rank)."""
    return comm.allreduce(value) / comm.Get_size()


def max_over(comm, value: float) -> float:
    """The largest value of a Python number over the ranks of ``comm`` (on every rank)."""
    from mpi4py import MPI

    return comm.allreduce(value, op=MPI.MAX)


class Progress:
    """A tqdm bar on rank 0 when stderr is a TTY (or ``--progress on``), a no-op otherwise."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._bar = None

    def start(self, total: int, desc: str) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        self.close()
        self._bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)

    def update(self, n: int = 1, **postfix: Any) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix({k: (f"{v:.4f}" if isinstance(v, float) else v)
                                       for k, v in postfix.items()}, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class Preempted(Exception):
    """Raised on every rank at the agreed step after a preemption signal (state already saved)."""


@dataclass
class RunResult:
    model: torch.nn.Module                 # final parameters, identical on every rank of eval_comm
    summary: dict[str, Any] = field(default_factory=dict)   # runtime-specific summary fields


#: the key of a resumed state that holds the world size of the job that wrote it
WRITTEN_SIZE = "written_world_size"


@dataclass
class RunContext:
    cfg: Any                               # TrainConfig
    topo: Any                              # Topology
    train: Any                             # ArrayDataset
    test: Any
    make_model: Callable[[], torch.nn.Module]
    metrics: Any                           # MetricsWriter (enabled on rank 0)
    progress: Progress
    history: list[dict[str, Any]] = field(default_factory=list)
    t0: float = field(default_factory=time.time)

    steps: int = 0                         # training steps taken by this rank (after_step counts)
    checkpoints: Any = None                # CheckpointManager when --checkpoint-dir is given
    preempt: Any = None                    # PreemptionFlag (SIGTERM / SIGUSR1)
    check_every: int = 10                  # steps between preemption agreements (one allreduce)
    checkpoint_every: int = 0              # steps between periodic checkpoints (0: epoch ends only)
    # the loss to train with, loss(output, target) -> scalar batch mean (--loss); epoch_end
    # evaluates with it too
    loss_fn: Callable = F.cross_entropy
    # make_optimizer(params) -> the optimizer of --optimizer/--lr/--momentum/--weight-decay
    # (ssgd, daso); None: the runtime builds its own torch.optim.SGD from cfg
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    # where each rank is in the epoch, for a checkpoint inside it (the synchronous driver's
    # cursor, runtime.recovery.EpochCursor.plan_state): its own loss sum, gathered to rank 0 as
    # ``loss_sums``, the loss count, and the plan where a recovery moved it (``shards``)
    epoch_plan: Callable[[], dict] | None = None
    # a checkpoint of another world size may be resumed (the synchronous driver's runs; the
    # resumed state under :data:`WRITTEN_SIZE` says the size that wrote it)
    any_world_size: bool = False
    divergence: DivergenceGuard = field(default=None, init=False)   # from --divergence-factor

    def __post_init__(self) -> None:
        self.divergence = DivergenceGuard(
            factor=getattr(self.cfg, "divergence_factor", DEFAULT_FACTOR))
        inject.start_run()

    def optimizer_for(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The optimizer a synchronous runtime (ssgd, daso) runs: ``--optimizer`` with --lr,
        --momentum, --weight-decay (``make_optimizer``), else torch's SGD with those."""
        if self.make_optimizer is not None:
            return self.make_optimizer(model.parameters())
        cfg = self.cfg
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay)

    @property
    def is_root(self) -> bool:
        return self.topo.rank == 0

    def after_step(self) -> None:
        """Call once per training step on every training rank: counts steps, runs the hooks."""
        self.steps += 1
        inject.point("step")

    def step_done(self, epoch: int, batch: int, loss: float) -> float:
        """After a synchronous runtime's step ``batch`` (1-based) of ``epoch``: run the per-step
        hooks (:meth:`after_step`), check ``loss`` for divergence (this rank's; DivergedError),
        advance the progress bar and, every ``--log-every`` batches, write a ``step`` record.
        Returns ``loss`` as a float."""
        self.after_step()
        value = float(loss)
        self.divergence.check(value, step=self.steps)
        self.progress.update(1, loss=value)
        if self.cfg.log_every and batch % self.cfg.log_every == 0:
            self.metrics.write("step", epoch=epoch, batch=batch, loss=value)
        return value

    # -- checkpoints and preemption ----------------------------------------------------------------
    def checkpoint_header(self) -> dict[str, Any]:
        return {"algorithm": self.cfg.algorithm, "model": self.cfg.model,
                "world_size": self.topo.size}

    def resume_state(self) -> dict[str, Any] | None:
        """The state to resume from (``--resume auto|PATH``), or None for a fresh start.

        Collective over ``topo.world``: rank 0 reads the file, after checking that it was written
        by the same algorithm, model and world size, and broadcasts it (a large model's file is
        read once, not by every rank from a shared file system); an error reading it is raised
        on every rank, in the same line.
        """
        from ..checkpoint import read_once
        from ..comm.objects import bcast_object
        from ..errors import CheckpointError

        resume = self.cfg.resume
        if not resume:
            return None
        if resume == "auto" and self.checkpoints is None:
            raise CheckpointError("--resume auto needs --checkpoint-dir")
        world = self.topo.world
        found = read_once(lambda: self._read_resume(resume), root=world.Get_rank() == 0,
                          bcast=lambda obj: bcast_object(world, obj, 0), what=f"--resume {resume}")
        if found is None:
            return None
        path, state = found
        if isinstance(state, dict) and isinstance(state.get("divergence"), dict):
            self.divergence.load_state_dict(state["divergence"])    # the writer's reference
        if self.topo.rank == 0:
            log.info("resuming from %s", path)
        self.metrics.write("resume", path=str(path))
        return state

    def _read_resume(self, resume: str) -> tuple[str, dict] | None:
        """``(path, state)`` of ``--resume`` (``auto``: the newest intact checkpoint), or None."""
        from ..checkpoint import read_checkpoint

        expect = self.checkpoint_header()
        if self.any_world_size:
            del expect["world_size"]
        if resume != "auto":
            found = (resume, *read_checkpoint(resume, expect=expect))
        else:
            found = self.checkpoints.load_latest(expect=expect)
        if found is None:
            log.info("no checkpoint in %s: starting fresh", self.checkpoints.directory)
            return None
        path, header, state = found
        if self.any_world_size and isinstance(state, dict):
            state[WRITTEN_SIZE] = header.get("world_size", self.topo.size)
        return str(path), state

    def consistent_point(self, comm, make_state, *, epoch: int, step: int, writer: bool,
                         force: bool = False, local_state=None,
                         agree: bool | None = None) -> None:
        """Call at a point where ``make_state()`` describes the whole job (every rank of ``comm``).

        Every ``check_every`` steps the ranks agree (one allreduce) whether a preemption signal has
        arrived anywhere. A checkpoint is written by the ``writer`` rank when a stop was agreed, at
        every ``checkpoint_every`` steps, or when ``force`` (epoch ends). After an agreed stop every
        rank raises :class:`Preempted`, which the driver turns into exit status 75.

        ``local_state``: a function giving what each rank holds of its own (the optimizer's
        ``local_state_dict``); when it gives anything, the checkpoint keeps every rank's under
        ``per_rank`` (gathered to rank 0 of ``comm``, which must then be the writer).
        ``agree``: the preemption agreement every ``check_every`` steps (None), here (True: an
        epoch end), or not here (False: a step that otherwise communicates nothing, local SGD
        between two averages).
        """
        stop = False
        if force:
            inject.point("epoch_agree")
        due = step % self.check_every == 0 if agree is None else agree
        if due and self.preempt is not None:
            stop = self.preempt.agree(comm)
        periodic = self.checkpoint_every and step % self.checkpoint_every == 0
        if self.checkpoints is not None and (stop or periodic or force):
            inject.point("checkpoint")
            parts = None if local_state is None else gather_own(comm, local_state)
            plan = None if self.epoch_plan is None else self.epoch_plan()
            sums = None if plan is None else comm.gather(plan.pop("loss_sum"), root=0)
            if writer:
                state = make_state()
                if plan is not None and state.get("batch"):     # (0: an epoch's end)
                    state = {**state, **plan, "loss_sums": sums}
                if parts is not None:
                    state = {**state, PER_RANK: parts}
                self.divergence.check_weights(state, where=f"epoch {epoch}, step {step} "
                                              "(checkpoint not written)")
                state = {**state, "divergence": self.divergence.state_dict()}
                path = self.checkpoints.save(state, epoch=epoch, step=step,
                                             **self.checkpoint_header())
                self.metrics.write("checkpoint", path=str(path), epoch=epoch, step=step)
            comm.Barrier()                     # the file is complete before anyone exits
        if stop:
            if self.checkpoints is None:
                log.warning("preempted without --checkpoint-dir: this run's progress is lost")
            raise Preempted(f"preempted at epoch {epoch}, step {step}")

    def epoch_end(self, epoch: int, model: torch.nn.Module, *, train_loss: float,
                  eval_comm=None, **extra: Any) -> dict[str, Any]:
        """Evaluate (collectively over ``eval_comm``, default the world), log and record an epoch.

        Every rank of ``eval_comm`` must call it with an identical model. Ranks outside
        ``eval_comm`` must not call it. Returns the record (on every calling rank).
        """
        comm = self.topo.world if eval_comm is None else eval_comm
        inject.point("epoch_end")
        self.divergence.check_weights(model, where=f"the end of epoch {epoch}")
        test_loss, test_acc, top = evaluate(model, self.test, comm, device=self.topo.device,
                                            loss_fn=self.loss_fn, predictions=True)
        record = {"epoch": epoch, "train_loss": train_loss, "test_loss": test_loss,
                  "test_accuracy": test_acc, "wall_time_s": round(time.time() - self.t0, 3), **extra}
        if top is not None:
            record["top_class_share"] = round(top, 4)
        self.history = [r for r in self.history if r["epoch"] != epoch] + [record]
        self.progress.close()
        if epoch not in self.metrics.epochs:  # (an epoch end redone after a death: written once)
            self.metrics.write("epoch", **record)
        if comm.Get_rank() == 0:
            log.info("epoch %d: train loss %.4f, test loss %.4f, test accuracy %.2f%% (%.1f s)",
                     epoch, train_loss, test_loss, 100 * test_acc, record["wall_time_s"])
            if top is not None and constant_predictor(top, self.test.labels):
                log.warning("epoch %d: the model gives %.1f%% of the test images one class (test "
                            "accuracy %.2f%%): it has collapsed to a constant predictor; the run "
                            "goes on as torch would (docs/guide/troubleshooting.md)",
                            epoch, 100 * top, 100 * test_acc)
        return record
