"""The server rank's part of the CLI's parameter-server run (:func:`hpcasync.ps.runtime.run`):
serve every push, record epochs (evaluated on the server alone), write checkpoints (epoch,
periodic, at SIGTERM, at a stop), and leave θ in the model. After a takeover
(:mod:`.takeover`) the epoch clock starts where the workers resume, and the first push served is
timed (``server_resumed``).

Example (``ps.runtime._run``, on the server rank)::

    summary, stopping = serve(ctx, opt, model, W, batches_per_worker, state, stop_flag, ulfm,
                              takeover, growth)
"""
from __future__ import annotations

import logging
import os
import time

from .. import inject
from ..runtime import ft
from ..runtime.context import RunContext
from .shards import shard_snapshot
from .takeover import Takeover

log = logging.getLogger("hpcasync")


def serve(ctx: RunContext, opt, model, W: int, batches_per_worker: int,
          state: dict | None, stop_flag, ulfm: bool,
          takeover: Takeover | None, growth) -> tuple[dict, bool | str]:
    """The PS rank's part of :func:`hpcasync.ps.runtime.run`: serve, record epochs, write checkpoints, leave θ in
    the model. Returns the summary and whether the run stops for a preemption (True) or for a
    grow-back (``"grow"``: ``growth.state`` holds the server's state, :mod:`.growth`; ``growth``
    is the run's :class:`~.growth.PSGrowth`, which spawns a dead worker's replacement while
    serving)."""
    from mpi4py import MPI

    from .worker import collect_locals

    cfg, rule, transport = ctx.cfg, opt.rule, opt.transport

    def on_epoch(epoch: int, record: dict) -> None:
        opt.load_theta()
        train_loss = record.pop("train_loss")
        ctx.epoch_end(epoch, model, train_loss=train_loss, eval_comm=MPI.COMM_SELF, **record,
                      **transport.memory_record(rule.state_bytes()), lr=rule.lr)
        if epoch < cfg.epochs:
            ctx.progress.start(pushes_per_epoch, f"epoch {epoch + 1}/{cfg.epochs}")

    first = [takeover is not None]           # after a takeover: time the first push served

    def on_push(w: int, staleness: int, loss: float) -> None:
        if first[0]:
            first[0] = False
            takeover.records[-1]["first_push_unix"] = round(time.time(), 4)
            ctx.metrics.write("server_resumed", **takeover.records[-1])
        inject.point("served")
        ctx.progress.update(1, loss=loss, tau=staleness)
        n = server.stats.accepted
        if cfg.log_every and n % cfg.log_every == 0:
            ctx.metrics.write("push", push=n, worker=w, version=rule.version - rule.moved,
                              staleness=staleness, loss=loss, lr=rule.lr)

    def state_now(kind: str) -> dict:
        """The PS state now: what a checkpoint holds, and what a grow-back goes on from."""
        return {"ps": server.state_dict(), **opt.buffer_state(), "kind": kind,
                "batches_per_worker": batches_per_worker, "data_seed": cfg.seed,
                "divergence": ctx.divergence.state_dict()}

    def save(kind: str, worker_locals: list | None = None) -> None:
        """A checkpoint of the PS state now (module doc); epoch label as SSGD's: the epoch in
        progress, or the one just crossed."""
        epoch = server.next_epoch - 1 if kind == "epoch" else server.next_epoch
        inject.point("checkpoint")
        snapshot = state_now(kind)
        if worker_locals is not None:
            snapshot["worker_locals"] = worker_locals
        path = shard_snapshot(opt, ctx.checkpoints, snapshot, epoch=epoch,
                              step=server.stats.accepted, header=ctx.checkpoint_header())
        ctx.metrics.write("checkpoint", path=str(path), epoch=epoch, step=server.stats.accepted,
                          kind=kind, positions=list(server.positions))
        return path

    # SIGTERM: checkpoint at once (between pushes: while waiting, or at the loop's top)
    sigterm = ft.SigtermCheckpoint(ctx.preempt, save if ctx.checkpoints is not None else None,
                                   world_size=ctx.topo.size, ulfm=ulfm)
    transport.idle_hook = sigterm.poll

    def on_failure(record: dict) -> None:
        ctx.metrics.write("worker_failed", **record, detected_unix=round(time.time(), 4))
        if os.environ.get("HPCASYNC_DUMP_BUFFERS"):       # testing hook (ps.takeover)
            opt.load_theta()
            inject.dump(f"worker-failed-{record['worker']}", model=opt.flat.buffers,
                         **opt.buffer_state())

    # at the loop's top: SIGTERM's checkpoint, a dead worker's replacement (growth), the stop
    hooks = {"on_failure": on_failure,
             "stop_requested": lambda: stop_flag is not None and stop_flag()}
    growth.wire(hooks, lambda: server, transport, ctx.topo.size, before=sigterm.poll)
    pushes_per_epoch = W * batches_per_worker
    server = opt.make_server(on_epoch=on_epoch, on_push=on_push,
                             on_checkpoint=save if ctx.checkpoints is not None else None,
                             checkpoint_every=ctx.checkpoint_every, **hooks,
                             on_accept=lambda w, loss: ctx.divergence.check(
                                 loss, step=server.stats.accepted))
    resumed_at = 0
    if state is not None:           # this shard's state (align_resume)
        server.load_state_dict(state["ps"])
        budget = cfg.epochs * batches_per_worker          # --epochs may have changed
        server.finished = [p >= budget for p in server.positions]
        opt.load_buffer_state(state)
        resumed_at = server.stats.accepted
        if state.get("kind") == "grow":         # not a resume: the same run, grown back
            resumed_at = state["resumed_at_push"]
            server.failed_before = list(state["ps"]["failed_workers"])
        elif opt.keeps_local and not state.get("worker_locals"):
            log.warning("%s: this %s checkpoint holds no worker-local models (only stop "
                        "checkpoints do): every worker restarts from θ", cfg.algorithm,
                        state.get("kind", "PS"))
        inject.dump(f"ps-{state.get('kind', 'resume')}-shard{max(opt.shard, 0)}",
                    theta=server.rule.theta, version=server.rule.version)
        log.info("PS: %s after %d accepted pushes; worker positions %s",
                 "going on" if state.get("kind") == "grow" else "resuming",
                 server.stats.accepted, server.positions)
    if takeover is not None:        # a worker took over: the clock starts where they resume
        budget = cfg.epochs * batches_per_worker
        server.start_at(int(takeover.share * budget))
        # (the server died after every last push was answered: nothing left, no push to wait for)
        server.finished = [p >= budget for p in server.positions]
        # a death at an epoch's last push, before or after its record: the stream says which
        # (one server); else (the shard servers must agree) the epoch is recorded again
        recorded = ctx.metrics.epochs if getattr(ctx.metrics, "requested", False) else None
        crossed = server.stats.accepted // pushes_per_epoch
        if recorded is not None and opt.layout.K == 1:
            server.next_epoch = min(server.next_epoch, max(recorded, default=0) + 1)
        elif crossed and server.stats.accepted == crossed * pushes_per_epoch:
            server.next_epoch = crossed
    done_in_epoch = server.stats.accepted - (server.next_epoch - 1) * pushes_per_epoch
    ctx.progress.start(pushes_per_epoch - max(0, done_in_epoch),
                       f"epoch {min(server.next_epoch, cfg.epochs)}/{cfg.epochs}")
    stats = server.serve()
    ctx.progress.close()
    server.finish()
    if server.grow:                     # every worker left: the run goes on in memory
        growth.state = {**state_now("grow"), "resumed_at_push": resumed_at}
        # the workers replaced now: records, not resumes
        growth.state["ps"]["failed_workers"] = server.replaced_workers()
        return {}, "grow"
    if server.stopping:
        if ctx.checkpoints is not None:
            save("stop", collect_locals(opt, server.failed)
                 if opt.keeps_local and opt.shard <= 0 else None)
        else:
            log.warning("preempted without --checkpoint-dir: this run's progress is lost")
    opt.load_theta()
    return {**stats.summary(), "transport": transport.name, "ps_rank": ctx.topo.ps_rank,
            "num_workers": W, "bytes_moved": transport.bytes_in + transport.bytes_out,
            **transport.memory_record(rule.state_bytes()),
            "ps_apply_s": round(server.apply_time, 3),
            "ps_idle_s": round(transport.wait_time, 3), "ps_peeks": server.peeks,
            "resumed_at_push": resumed_at, "fault_tolerance": "ulfm" if ulfm else "none",
            **({"resume_lost_pushes": state["resume_lost_pushes"]}
               if state is not None and "resume_lost_pushes" in state else {}),
            "failed_workers": server.failed_before + list(server.failed.values()),
            "rule_workers": rule.worker_summary(),
            "server_failures": takeover.records if takeover is not None else []}, server.stopping
