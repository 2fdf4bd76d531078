"""OD-SGD runtime: one synchronous global round in flight while every worker computes ahead
(Xu et al., "OD-SGD: One-step Delay Stochastic Gradient Descent for Distributed Training",
arXiv 2005.06728). LocalOpt and the global step are in :mod:`hpcasync.odsgd.steps`, one round as
pure functions (shared with the simulator) in :mod:`.core`; the MPI pipeline in :mod:`.pipeline`; the CLI loop is here.

Every rank is a worker. Round t is an allreduce-average of the N gradients g_t^k followed by the same
momentum-SGD step on every rank, so the global model stays bitwise identical everywhere::

    ḡ_t = (1/N) Σ_k g_t^k ;   v ← γ·v + ḡ_t + wd·W_t ;   W_{t+1} = W_t − η·v

Worker k does not wait for round t: it builds local weights from the last global weights it has and
its own gradient, W^l_{t+1} = LocalOpt(W_t, g_t^k) (``sgd``, ``dc``, ``dc-adaptive``; Δ = ``last-step``
W_t − W_{t−1} or ``gap`` W_t − W^l_t), and computes g_{t+1}^k there while the round is in flight.
Per step: backward → wait for round t−1 (→ W_t) → start round t with g_t (nonblocking) → W^l_{t+1}
→ forward/backward on W^l_{t+1} overlapping round t → ...

Staleness (tested): the gradient applied in round t (t ≥ warm-up + 1) was computed on
LocalOpt(W_{t−1}, g_{t−1}^k) — local weights built from the global model exactly one round older than
W_t, to which it is applied. The first ``warmup_iters`` steps are plain SSGD (blocking average,
then the same step; bitwise equal to :class:`~hpcasync.ssgd.runtime.DistributedOptimizer` with
``torch.optim.SGD``). Epochs end by completing the round in flight and evaluating on W; the
next epoch resumes on the local weights, so staleness stays exactly one across epochs.

Collectives, not the PS (measured, 61.7 k floats = LeNet, medians of 5×100 rounds): our allreduce
0.28 ms vs a PS-style round (gather to one rank, average, broadcast) 0.29 ms on 4 ranks; 0.07 vs
0.13 ms on 2 ranks — and a real PS also takes a rank away from training. So the round is an allreduce,
on a private duplicate of the communicator.

Progress of the round while Python computes (``--odsgd-progress``): a nonblocking reduction moves only
inside MPI calls of this process (:mod:`hpcasync.comm.handle`), so something must test it.
``thread`` (default) drives it from a helper thread that tests it every 0.2 ms and sleeps between
(MPI is initialised THREAD_MULTIPLE); ``hooks`` tests it from forward pre-hooks of every leaf module
and post-accumulate-grad hooks of every parameter; ``none`` leaves it until the wait. Measured on a
2-core box shared with other jobs, 4 ranks, LeNet, batch 64, the modes interleaved, 60 steps × 5
repetitions, medians of the per-rank means, ms per step (compute = forward+backward)::

    mode     compute   wait   update   step   overlap        (SSGD: the same loop, blocking rounds)
    ssgd       20.2    14.8     0.1    35.3    0
    none       20.8    14.4     0.8    35.5    0.60
    hooks      33.6     0.8     1.9    36.4    0.97
    thread     18.0     7.5     3.4    29.6    0.69

(two earlier repetitions of the benchmark: ssgd 55.1 / 50.4, thread 40.0 / 30.3 ms per step.)
``hooks`` hides nearly all the wait but pays for it in compute: each ``test()`` enters MPI progress,
which yields the core (``mpi_yield_when_idle``) on an oversubscribed node; ``none`` waits as long as
SSGD; ``thread`` was fastest in every 4-rank repetition, hence the default. Most of the wait here is
waiting for ranks that are descheduled (each rank gets ~6 ms of CPU per 30-35 ms step), which no
overlap can hide. Full runs (``hpcasync train --algorithm odsgd --dataset fashion-mnist --model
lenet --epochs 2``, batch 32, 4 ranks; 200 of the 468 steps of epoch 1 are warm-up): test accuracy
83.2 % / 86.5 % after epochs 1 / 2 in every mode (SSGD 85.7 % / 87.3 %); epoch 2 (all OD steps)
compute / wait per step: thread 5.3 / 9.5 and 6.2 / 5.4 ms, hooks 14.8 / 0.1 and 13.3 / 2.7 ms,
none 5.7 / 17.2 and 5.8 / 9.6 ms; epoch-2 time thread 7.9 / 6.9 s vs SSGD 6.9 / 11.9 s (two runs each).

Metrics per epoch (means over ranks): ``compute_time_s``, ``wait_time_s`` (blocked on a round;
warm-up rounds count whole), ``update_time_s`` (local/global steps, starting rounds),
``round_time_s`` (rounds' start-to-completion time), ``overlap_fraction`` = 1 − wait/round time
(the share of the rounds' time this rank spent computing rather than blocked; with ``none`` a round
does not progress while computing, so there it is only an upper bound), ``wait_time_max_s``,
``compute_ms_per_step``, ``wait_ms_per_step``, ``warmup_steps``.

Example (a user's own loop; :class:`~hpcasync.odsgd.ODSGD`, also ``hpcasync.optimizer("odsgd", ...)``)::

    opt = ODSGD(model, lr=0.05, momentum=0.9)
    for x, y in loader:
        opt.zero_grad(); F.cross_entropy(model(x), y).backward()
        opt.step()                        # params now hold W^l_{t+1}
    opt.finish()                          # params hold the global model W

The simulator drives the same math for N virtual workers with :func:`simulate_round`.

Defaults: the authors' local rule — ``dc-adaptive`` on g/N with η_l 0.5 and mean-square momentum 0
(:mod:`.steps` has the conversion from the earlier η_l·g). LeNet / Fashion-MNIST, 4 ranks, global
--lr 0.05 --momentum 0.9, seed 0, 2 epochs: η_l 0.25 → 85.7 %, 0.5 → 87.6 %, 1.0 → 86.4 %; η_l 2.0
(= the earlier 0.5 at 4 ranks) diverged at step 207, right after the 200 SSGD warm-up steps — the earlier record
"η_l 0.5 diverged" was the missing 1/N. The spec's ResNet-20 / CIFAR reference: --lr 0.1
--momentum 0.95 --odsgd-local-lr 0.5.

Checkpoints and preemption (:mod:`.checkpoint`): the ranks agree on a stop every
``ctx.check_every`` steps (one allreduce, as SSGD); a checkpoint completes the round in flight (the
same operands, only earlier: the trajectory is unchanged, mid-epoch as at epoch ends) and gathers
every rank's local weights, mean square and buffers to rank 0, which writes them with the global
state; a resumed run ends bitwise equal to an uninterrupted one. Heterogeneity options act as in
SSGD (:class:`~hpcasync.ssgd.runtime.StepDelay`: the straggler sleeps after its compute).

Differences from the paper: Δ = ``last-step`` is the default, as in the authors' code; the
``dc-adaptive`` mean square starts at zero and is only updated by local steps (not during warm-up);
epoch ends complete the round in flight (needed to evaluate one model) without changing the sequence
of global updates; the round is an allreduce, not a PS push/pull (reason above).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import time

import torch

from ..errors import ConfigError
from ..hetero import StepDelay
from ..runtime.context import RunContext, RunResult
from ..runtime.ft import signal_hook, ulfm_enabled
from ..runtime.recovery import EpochCursor, SyncRecovery
from .checkpoint import consistent_point, global_state, load_state
from .core import GlobalState, ODSGDHyper, WorkerState, global_update, local_update, simulate_round
from .optimizer import ODSGD
from .pipeline import PROGRESS_MODES, ODSGDWorker, StepTimes

__all__ = ["ODSGDWorker", "StepTimes", "ODSGDHyper", "GlobalState", "WorkerState", "local_update",
           "global_update", "simulate_round", "add_arguments", "validate", "run"]

log = logging.getLogger("hpcasync")

# -- CLI ------------------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    group = parser.add_argument_group("odsgd")
    group.add_argument("--odsgd-local-opt", default="dc-adaptive",
                       help="local optimizer: sgd, dc or dc-adaptive (default)")
    group.add_argument("--odsgd-local-lr", type=float, default=0.5,
                       help="local lr η_l on g/N, as the authors' (0.5)")
    group.add_argument("--odsgd-delta", default="last-step",
                       help="Δ of the dc modes: last-step (W_t − W_t−1, default) or gap (W_t − W^l_t)")
    group.add_argument("--odsgd-warmup-iters", type=int, default=200,
                       help="first N steps are plain SSGD (200)")
    group.add_argument("--odsgd-lambda", type=float, default=None,
                       help="λ (dc, default 0.04) or λ₀ (dc-adaptive, default 2)")
    group.add_argument("--odsgd-ms-momentum", type=float, default=0.0,
                       help="dc-adaptive mean-square momentum m (0: the authors' CADCASGD)")
    group.add_argument("--odsgd-progress", default="thread",
                       help="how the round in flight progresses: thread (default), hooks, none")


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
    inject = signal_hook(topo.rank)          # testing: HPCASYNC_INJECT_SIGNAL=RANK:STEP
    state = ctx.resume_state()
    rec = SyncRecovery(ctx, enabled=ulfm_enabled())
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

    def setup(rank: int) -> None:
        worker.broadcast_parameters(root=0)
        if state is not None:                # (after the broadcast, which sets W from params)
            load_state(worker, state["global"], state["locals"][rank])

    # positions (epoch, batches done, started), recovery and re-sharding as in hpcasync.ssgd
    cur = EpochCursor(ctx, epoch=start_epoch, done=start_batch, loss_sum=loss_carry)
    summary = None
    while summary is None:
        topo = ctx.topo
        try:
            cur.start(lambda: setup(topo.rank))
            if cur.finished:                               # the final gathers
                ctx.kill_point("final")
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
                if inject is not None:
                    inject()
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
            cur.adopt(rec.recover(position=(*cur.position, worker.rounds), state=adopted_state,
                                  load=load_adopted, revoke=(worker.round_comm,)))
            opt.set_comm(ctx.topo.world)
    opt.finish(average_buffers=False)        # buffers were averaged at the last epoch end
    return RunResult(model=model, summary={
        "steps": worker.steps, "rounds": worker.rounds,
        "warmup_steps": min(worker.steps, hp.warmup_iters),
        "local_opt": hp.local_opt, "delta": hp.delta, "progress": worker.progress,
        "compute_time_s": round(sum(r["compute_time_s"] for r in ctx.history), 4),
        "wait_time_s": round(sum(r["wait_time_s"] for r in ctx.history), 4),
        **summary, **delay.record(), **rec.summary()})


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
