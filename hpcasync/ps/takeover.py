"""The parameter server dies; a worker takes over and training goes on (ULFM, one server rank).

Under ``mpirun --with-ft ulfm`` a worker waiting on a dead server gets ``MPI_ERR_PROC_FAILED``
and raises :class:`ServerLost` (``ps.runtime``). Every surviving worker then calls
:func:`take_over`: the survivors shrink the world, the worker holding the freshest θ becomes the
server with a fresh rule, and every worker resumes at the share of its budget the run had done.

``run`` then runs the parameter-server runtime again on the survivors. With ``--ps-ranks K > 1``
(sharded θ) a server's death still ends the job (one line naming it): rebuilding one shard from
the workers' slices is not done.

Example (``ps.runtime.run``)::

    takeover = None
    while True:
        try:
            return _run(ctx, takeover)
        except ServerLost as lost:
            takeover = take_over(ctx, lost)

Design: docs/design/ps.md#server-takeover (the four steps, what is lost).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from ..runtime.recovery import _kept, _revoke

log = logging.getLogger("hpcasync")


class ServerLost(Exception):
    """Raised on a worker whose server died (ULFM, one server): carries what the worker holds."""

    def __init__(self, opt, dead: list[int], budget: int):
        super().__init__(f"the parameter server died (ranks {dead})")
        self.opt, self.dead, self.budget = opt, list(dead), budget


class StartupLost(Exception):
    """Raised on every survivor when a rank died while the parameter server was being set up."""


def known_dead(comm) -> bool:
    """After an MPI error while setting up (ULFM): whether a rank of ``comm`` died, found by a
    barrier over ``comm`` (it fails with ``MPI_ERR_PROC_FAILED``, or ``MPI_ERR_REVOKED`` when
    another survivor has begun :func:`restart_without_the_dead`). A collective over a duplicate
    of ``comm`` (``MPI_Win_allocate``) reports a dead member with its own error class
    (``MPI_ERR_WIN``), and ``comm`` may not know of the death yet."""
    from mpi4py import MPI

    from ..runtime.recovery import proc_failure

    try:
        comm.Barrier()
    except MPI.Exception as exc:
        return proc_failure(exc)
    return False


def _shrink(ctx, comms) -> tuple:
    """Revoke ``comms`` (the world first), shrink the world: ``(new world, ranks kept (old
    numbering), dead ranks (original numbering))``; ``ctx.original_ranks`` follows."""
    topo = ctx.topo
    _revoke(comms)
    new = topo.world.Shrink()
    kept = _kept(topo.world, new)
    original = getattr(ctx, "original_ranks", list(range(topo.size)))
    ctx.original_ranks = [original[r] for r in kept]
    return new, kept, [original[r] for r in range(topo.size) if r not in kept]


def _become_reporter(ctx, rank: int) -> None:
    """The new server (rank ``rank`` of the original world) writes the metrics and the log."""
    m = ctx.metrics
    if not m.enabled and getattr(m, "path", None) is not None:
        m.reopen_append()
    from ..train import setup_logging

    setup_logging(rank, report_rank=rank)


def restart_without_the_dead(ctx) -> None:
    """A death during set-up (the first broadcast, the windows): shrink the world and start the
    run again on the survivors (collective over them). The server keeps its role if it
    survived; otherwise the lowest surviving rank serves (every copy of θ is the initial one)."""
    topo = ctx.topo
    new, kept, dead = _shrink(ctx, (topo.world,))
    server = kept.index(topo.ps_rank) if topo.ps_rank in kept else 0
    ctx.topo = dataclasses.replace(topo.shrunk(new), ps_rank=server)
    if new.Get_rank() == server:
        _become_reporter(ctx, ctx.original_ranks[server])
        log.warning("rank(s) %s died while the parameter server was set up; starting again with "
                    "%d ranks", ", ".join(map(str, dead)), new.Get_size())
        ctx.metrics.write("rank_failed", dead_ranks=dead, phase="startup",
                          world_size=new.Get_size())


@dataclasses.dataclass
class Takeover:
    """What a run on the survivors starts from (``ps.runtime``)."""
    share: float                      # the share of every worker's budget already done
    theta: torch.Tensor | None        # on the new server: the freshest θ; None elsewhere
    records: list                     # every takeover so far (for the summary)
    own_buffers: torch.Tensor | None = None   # this rank's float buffers when the server died
    buffers: list | None = None       # on the new server: every survivor's float buffers (new
                                      # world's rank order); None elsewhere
    int_buffers: dict | None = None   # this rank's own integer buffers (num_batches_tracked)
    int_max: dict | None = None       # on the new server: the survivors' max of each integer
                                      # buffer


def _int_buffers(model) -> dict:
    return {n: b.detach().cpu().clone() for n, b in model.named_buffers()
            if not b.is_floating_point()}


def restore_buffers(opt, takeover: Takeover) -> None:
    """After a takeover, once the new ``ParameterServer`` is built (its broadcast gave every
    worker the new server's buffers): nothing of the BatchNorm state is reset.

    A worker keeps its own buffers (float and integer), as it would have under the old server.
    The new server's buffer table (``average_buffers``) is seeded with every remaining worker's
    current float buffers, each marked seen, and its model takes their mean the way
    ``load_theta`` computes it (``_buffers[seen].mean(0)``, bitwise); its integer buffers
    (``num_batches_tracked``) take the survivors' max (the server never trains: no count of its
    own). The new server's own buffers from its time as a worker are not in the table (it no
    longer pushes)."""
    flat, module = opt.flat, opt.flat.module
    if takeover.own_buffers is None:
        return
    ints = takeover.int_max if opt.is_server else takeover.int_buffers
    for name, buf in module.named_buffers():
        if name in ints:
            buf.copy_(ints[name].to(buf))
    if not flat.buffer_numel:
        return
    if opt.is_server:
        if opt.sync_buffers:
            rows = torch.stack([takeover.buffers[r] for r in opt.worker_ranks])
            opt.load_buffer_state({"buffers": rows, "seen": [True] * len(opt.worker_ranks)})
            opt.load_theta()
        else:                    # no average: the mean of the workers' buffers all the same
            flat.buffers.copy_(torch.stack([takeover.buffers[r] for r in opt.worker_ranks])
                               .mean(0).to(flat.buffers))
    else:
        flat.buffers.copy_(takeover.own_buffers.to(flat.buffers))
    dump_buffers(f"takeover-{'server' if opt.is_server else 'worker'}-{opt.comm.Get_rank()}",
                 model=flat.buffers, worker_ranks=list(opt.worker_ranks),
                 survivors=takeover.buffers if opt.is_server else None,
                 ints={n: b.detach().cpu().clone() for n, b in module.named_buffers()
                       if n in ints})


def dump_buffers(tag: str, **what) -> None:
    """Testing hook: ``HPCASYNC_DUMP_BUFFERS=DIR`` saves ``what`` (tensors cloned to the CPU) to
    ``DIR/<tag>.pt`` (the BatchNorm state at a takeover, after a worker's death)."""
    where = os.environ.get("HPCASYNC_DUMP_BUFFERS")
    if not where:
        return
    os.makedirs(where, exist_ok=True)
    copy = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in what.items()}
    torch.save(copy, os.path.join(where, f"{tag}.pt"))


def take_over(ctx, lost: ServerLost, previous: Takeover | None = None) -> Takeover:
    """Collective over the surviving workers (docs/design/ps.md#server-takeover); replaces
    ``ctx.topo``."""
    detected = time.time()
    t0 = time.perf_counter()
    opt, topo = lost.opt, ctx.topo
    new, _, dead = _shrink(ctx, (topo.world, *[c for c in opt.layout.comms if c is not None]))
    # the old optimizer's windows are on the revoked world (left to MPI_Finalize); it must not
    # "finish" at exit (its atexit hook, alive while gc has not collected it: a push on a revoked
    # communicator, MPI_Abort after the run had finished)
    opt._closed = True
    mine = (int(opt.version), min(1.0, opt.steps / max(1, lost.budget)))
    every = new.allgather(mine)
    server = max(range(len(every)), key=lambda r: (every[r][0], -r))
    # every survivor's BatchNorm state as it is now, to the new server (the fresh models built
    # next must not reset it; restore_buffers)
    own = opt.flat.buffers.detach().cpu().clone()
    own_ints = _int_buffers(opt.flat.module)
    states = new.gather((own, own_ints), root=server)
    int_max = (None if states is None else
               {n: torch.stack([ints[n] for _, ints in states]).max(0).values for n in own_ints})
    share = sum(s for _, s in every) / len(every)
    ctx.topo = dataclasses.replace(topo.shrunk(new), ps_rank=server)
    record = {"dead_ranks": dead, "new_server": ctx.original_ranks[server],
              "theta_version": every[server][0], "share_done": round(share, 4),
              "workers": new.Get_size() - 1, "detected_unix": round(detected, 4),
              "recovery_s": round(time.perf_counter() - t0, 4)}
    records = (previous.records if previous is not None else []) + [record]
    if new.Get_rank() == server:
        _become_reporter(ctx, ctx.original_ranks[server])
        log.warning("the parameter server (rank(s) %s) died; rank %d takes over with θ of "
                    "version %d, %d workers go on from %.1f %% of their budget",
                    ", ".join(map(str, dead)), ctx.original_ranks[server], every[server][0],
                    new.Get_size() - 1, 100 * share)
        ctx.metrics.write("server_failed", **record)
    os.environ.pop("HPCASYNC_INJECT_KILL", None)     # testing hooks named the old ranks
    theta = None
    if new.Get_rank() == server:          # its last reply (before any: the broadcast start)
        theta = opt.last_reply()
        if opt.keeps_local:
            log.warning("%s: the workers' local models are dropped at the takeover; every "
                        "worker goes on from the new server's θ", opt.algorithm)
    return Takeover(share=share, theta=theta, records=records, own_buffers=own,
                    buffers=None if states is None else [b for b, _ in states],
                    int_buffers=own_ints, int_max=int_max)
