"""OD-SGD checkpoints: the global state plus every rank's own state, written at an agreed step.

The global model (W_t, W_{t−1}, momentum buffer, step and round counters) is identical on every
rank; the local weights W^l the next gradient is computed on, the dc-adaptive mean square and the
float buffers (BatchNorm statistics, averaged only at epoch ends) differ per rank. A checkpoint
holds the first once and the others for every rank (gathered to rank 0, the writer)::

    {"global": {W, W_prev, buf, steps, rounds}, "locals": [{local, ms, buffers} per rank],
     "epoch": e, "batch": b, "loss_sum": …}           # where a resumed run continues

On resume every rank receives the file from rank 0 (``ctx.resume_state()``) and takes its own
row, so nothing needs to be scattered. Before writing, the round in flight is completed: that
only applies W_t → W_{t+1} earlier than the next ``step()`` would, with the same operands (the
next gradient is computed on W^l, not on W), so an interrupted and resumed run is bitwise equal
to an uninterrupted one.

Example (inside the OD-SGD loop, after ``worker.step()``)::

    consistent_point(ctx, worker, epoch=epoch, batch=i + 1, loss_sum=loss_sum)
"""
from __future__ import annotations

from ..comm.objects import gather_object
from ..errors import CheckpointError

__all__ = ["global_state", "local_state", "load_state", "consistent_point"]


def global_state(worker) -> dict:
    """The state shared by every rank (call with no round in flight)."""
    g = worker.glob
    return {"W": g.W.clone(), "W_prev": g.W_prev.clone(), "buf": g.buf.clone(),
            "steps": worker.steps, "rounds": worker.rounds}


def local_state(worker) -> dict:
    """This rank's own state: local weights W^l, dc-adaptive mean square (or None), buffers."""
    ms = worker.ws.ms
    return {"local": worker.flat.params.detach().cpu().clone(),
            "ms": None if ms is None else ms.detach().cpu().clone(),
            "buffers": worker.flat.buffers.detach().cpu().clone()}


def load_state(worker, shared: dict, local: dict) -> None:
    """Restore :func:`global_state` and this rank's :func:`local_state` into an
    :class:`~hpcasync.odsgd.runtime.ODSGDWorker` (after its ``broadcast_parameters``);
    CheckpointError when they do not fit (another model or local optimizer)."""
    try:
        for name in ("W", "W_prev", "buf"):
            getattr(worker.glob, name).copy_(shared[name])
        worker.flat.params.copy_(local["local"])
        worker.flat.buffers.copy_(local["buffers"])
        if (worker.ws.ms is None) != (local["ms"] is None):
            raise CheckpointError("OD-SGD checkpoint was written with another --odsgd-local-opt")
        if worker.ws.ms is not None:
            worker.ws.ms.copy_(local["ms"])
        worker.steps, worker.rounds = int(shared["steps"]), int(shared["rounds"])
    except (KeyError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"OD-SGD checkpoint state does not fit this run ({exc})") from None
    worker.round = None


def consistent_point(ctx, worker, *, epoch: int, batch: int, loss_sum: float,
                     force: bool = False, label: int | None = None) -> None:
    """After a step, on every rank: a checkpoint and/or an agreed stop
    (:meth:`~hpcasync.runtime.context.RunContext.consistent_point` semantics: agree every
    ``ctx.check_every`` steps, save when stopping, every ``ctx.checkpoint_every`` steps or when
    ``force``, raise ``Preempted`` after a stop).

    Cheap unless a checkpoint is due: only then is the round completed and the per-rank state
    gathered (a collective over the world). ``epoch``/``batch``/``loss_sum``: where a resumed run
    continues; ``label``: the epoch in the file's name (default ``epoch``).
    """
    comm, step = ctx.topo.world, worker.steps
    due = force or bool(ctx.checkpoint_every and step % ctx.checkpoint_every == 0)
    if not due and ctx.preempt is not None and step % ctx.check_every == 0:
        due = ctx.preempt.agree(comm)        # ctx.consistent_point agrees again: the same answer
    if not due:
        return
    worker.synchronize()
    rows = (gather_object(comm, local_state(worker), 0) if ctx.checkpoints is not None
            else None)

    def snapshot() -> dict:
        return {"global": global_state(worker), "locals": rows, "epoch": epoch, "batch": batch,
                "loss_sum": loss_sum}
    ctx.consistent_point(comm, snapshot, epoch=epoch if label is None else label, step=step,
                         writer=ctx.is_root, force=True)
