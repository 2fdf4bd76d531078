"""The parameter server dies; a worker takes over and training goes on (ULFM).

Under ``mpirun --with-ft ulfm`` a worker waiting on a dead server gets ``MPI_ERR_PROC_FAILED``
and raises :class:`ServerLost` (``ps.runtime``). Every surviving worker then calls
:func:`take_over`: the reset of the run's one fault-tolerance object
(:class:`~hpcasync.runtime.elastic.FaultTolerance`, the synchronous families' and your own
loop's too) over a :class:`PSWorld`, whose rebuild elects the worker holding the freshest θ as
the server; it serves with a fresh rule, and every worker resumes at the share of its budget the
run had done. A death inside the takeover's exchange redoes it on the survivors (the reset is
atomic: one ``MPI_Comm_agree`` ends each attempt); a death while the new server is set up runs
the takeover again (``again=True``) from the θ the workers hold; SHAT's and ENSEMBLE's workers
keep their local models. With ``--ps-ranks K > 1`` a dead shard server's slice is rebuilt from
the workers' freshest reply for it.

Example (``ps.runtime.run``)::

    takeover, core = None, fault_tolerance(ctx)
    while True:
        try:
            return _run(ctx, takeover)
        except ServerLost as lost:
            takeover = take_over(ctx, core, lost)

Design: docs/design/ps.md#server-takeover (the steps, what is lost).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from .. import inject
from ..comm.objects import gather_object
from ..errors import proc_failure, ranks_in
from ..runtime import join
from ..runtime.elastic import FaultTolerance, Membership, revoke_all, sync_root

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

    try:
        comm.Barrier()
    except MPI.Exception as exc:
        return proc_failure(exc)
    return False


def _become_reporter(ctx, rank: int) -> None:
    """The new server (rank ``rank`` of the original world) writes the metrics and the log."""
    m = ctx.metrics
    if not m.enabled and getattr(m, "requested", False):
        m.reopen_append()
    from ..runtime.logs import setup_logging

    setup_logging(rank, report_rank=rank)


class PSWorld(Membership):
    """The world of a CLI parameter-server run (``ctx.topo``) under the one fault-tolerance object
    (:class:`~hpcasync.runtime.elastic.FaultTolerance`, whose reset shrinks it atomically): its
    rebuild is a takeover (``lost``, the :class:`ServerLost` of this rank: the survivors elect a
    server and give it θ and their buffers, :func:`_exchange`), or, with no ``lost``, a start
    again on the survivors after a death while the server was set up from the initial θ (the
    server keeps its role if it survived, else the lowest survivor serves). The run's
    ``ctx.topo`` is the survivors' after the rebuild. A worker's death is absorbed (the server
    retired it and served the others on: :meth:`absorb`), and a grow-back refills the emptied
    places (:meth:`regrow`, the server's spawn: :func:`hpcasync.ps.growth.grow`)."""

    refill_only = True      # a worker's place fixes its shard and position

    def __init__(self, ctx):
        self.ctx, self.lost, self.held, self.got, self.first = ctx, None, None, None, None
        self._before = ctx.topo

    @property
    def comm(self):
        return self.ctx.topo.world

    def comms(self) -> list:
        layout = getattr(getattr(self.lost, "opt", None), "layout", None)
        return [self.ctx.topo.world, *[c for c in getattr(layout, "comms", ()) if c is not None]]

    def check_reset(self) -> None:
        """Revoke what a survivor may still be blocked on (the world, the per-shard ones)."""
        self._before, self.first = self.ctx.topo, None
        revoke_all(self.comms())

    def rebuild(self, new) -> None:
        before = self._before
        kept = ranks_in(new.Get_group(), before.world)
        if self.first is None:      # the deaths that began the reset (the others: inside it)
            self.first = [self.ctx.ft.original[r] for r in range(before.size)
                          if r not in kept]
        if self.lost is None:
            server, self.got = kept.index(before.ps_rank) if before.ps_rank in kept else 0, None
        else:
            layout = self.lost.opt.layout
            self.got = exchange(new, self.held, layout.K, layout.slice)
            server = self.got[1]
        self.ctx.topo = dataclasses.replace(before.shrunk(new), ps_rank=server)

    def absorb(self, new) -> None:
        self.ctx.topo = self.ctx.topo.shrunk(new)

    def regrow(self, grown) -> None:
        """The topology of the grown world, the server at the spawner's place (the sync root)."""
        self.ctx.topo = join._topology(grown, self.ctx.cfg, sync_root())
        join._joined.setdefault("grew", True)       # (freed before MPI_Finalize: join.release)

    def shrunk(self, record: dict) -> None:
        """Said by the caller (:func:`take_over`, :func:`restart_without_the_dead`,
        :func:`hpcasync.ps.growth.grow`)."""


def fault_tolerance(ctx):
    """The run's fault-tolerance object over a :class:`PSWorld`. Its reset never grows: the
    server grows the world back itself once the reset or an absorption is said
    (:func:`hpcasync.ps.growth.grow`, ``FaultTolerance.grow`` with the server's spawn), also on a
    replacement (whose object the survivors' grow-back marked)."""
    core = FaultTolerance(PSWorld(ctx), ulfm=True)
    core.grow_back = False
    return core


def _reset(ctx, core, lost, held=None) -> dict:
    """``core.reset()`` over the :class:`PSWorld` (collective over the survivors). Returns the
    reset's ``failures`` record."""
    world = core.membership
    world.lost, world.held = lost, held
    core.reset()
    return core.failures[-1]


def restart_without_the_dead(ctx, core) -> None:
    """A death during set-up (the first broadcast, the windows): shrink the world and start the
    run again on the survivors (collective over them; :class:`PSWorld`). Every copy of θ is the
    initial one."""
    record = _reset(ctx, core, None)
    if ctx.topo.rank == ctx.topo.ps_rank:
        _become_reporter(ctx, core.original[ctx.topo.rank])
        log.warning("rank(s) %s died while the parameter server was set up; starting again with "
                    "%d ranks", ", ".join(map(str, record["dead_ranks"])), ctx.topo.size)
        ctx.metrics.write("rank_failed", dead_ranks=record["dead_ranks"], phase="startup",
                          world_size=ctx.topo.size)


@dataclasses.dataclass
class Takeover:
    """What a run on the survivors starts from (``ps.runtime``)."""
    share: float                      # the share of every worker's budget already done
    theta: torch.Tensor | None        # on the new server: the θ it serves from; None elsewhere
    records: list                     # every takeover so far (for the summary)
    own_buffers: torch.Tensor | None = None   # this rank's float buffers when the server died
    int_buffers: dict | None = None   # this rank's own integer buffers (num_batches_tracked)
    survivors: list | None = None     # on the new server: every survivor's buffers (new world's
                                      # rank order; ParameterServer.take_over's); None elsewhere
    local: torch.Tensor | None = None    # SHAT/ENSEMBLE: this rank's own model (a worker goes
                                         # on from it; the new server's leaves the ensemble)
    opt: Any = None                   # the run's ParameterServer, set up again on the survivors
    vote: tuple | None = None         # what this rank brought to the election


def take_over(ctx, core, lost: ServerLost, previous: Takeover | None = None, *,
              again: bool = False) -> Takeover:
    """Collective over the survivors (docs/design/ps.md#server-takeover): the reset of ``core``
    (:func:`fault_tolerance`) over them; replaces ``ctx.topo``.
    ``again``: the set-up after the takeover ``previous`` lost a rank (the new server, or a
    worker): the takeover runs again on the survivors, from what they hold since ``lost`` (each
    one's latest reply, buffers) and at ``previous``'s share of the budget. With K > 1 shard
    servers the survivors include servers: each shard's slice comes from its surviving server,
    or else from the workers' freshest reply for that shard (:func:`_shard_sources`)."""
    opt = lost.opt
    K = opt.layout.K
    # its windows are on the revoked world (left to MPI_Finalize): until it is set up again on
    # the survivors it must not "finish" at exit (its atexit hook: a push on a revoked
    # communicator, MPI_Abort after the run had ended)
    opt._closed = True
    held = opt.holding(opt.shard if opt.is_server else -1, K)    # (your own loop's too)
    # its vote: what it holds; after a set-up that failed, the vote it brought to that takeover
    mine = previous.vote if again else held["vote"]
    if not (again or opt.is_server) and previous is not None and not opt.started:
        mine = (previous.records[-1]["theta_version"], *mine[1:])   # lost before its first
                                                    # reply: it holds the previous takeover's θ
    # every survivor's BatchNorm state (and SHAT's/ENSEMBLE's local model) as it is now, to the
    # new server (the set-up's broadcast must not reset it: ParameterServer.take_over's
    # survivors); after a set-up that failed (its broadcast may have overwritten the model), as
    # it was before it
    stale = previous is not None and previous.own_buffers is not None and (
        again or not opt.started)
    own = previous.own_buffers if stale else held["buffers"].cpu()
    own_ints = previous.int_buffers if stale else held["ints"]
    local = previous.local if stale else held["local"]
    # atomic (the core's reset): the exchange completes on every survivor, or all shrink again
    # and redo it (a death inside it: a gather can complete on its senders and fail on its root)
    failure = _reset(ctx, core, lost, {**held, "vote": mine, "buffers": own, "ints": own_ints})
    first, dead = core.membership.first, failure["dead_ranks"]
    every, server, sources, theta, states = core.membership.got
    if K == 1 and ctx.topo.rank == server:
        theta = held["theta"]
    # the share of every worker's budget done: the workers' mean (the same again after a set-up)
    workers = [min(1.0, e[1] / max(1, lost.budget)) for e in every if e[2] < 0]
    share = previous.share if again else sum(workers) / len(workers)
    me, original = ctx.topo.rank, core.original
    record = {"dead_ranks": dead, "new_server": original[server],
              "theta_version": (every[server][0] if K == 1 else min(v for _, v in sources)),
              "share_done": round(share, 4), "workers": ctx.topo.size - K,
              "detected_unix": failure["detected_unix"], "recovery_s": failure["recovery_s"],
              "phase": "setup" if again else "training"}
    if K > 1:
        record["shard_sources"] = [{"rank": original[r], "version": v,
                                    "from": "server" if every[r][2] >= 0 else "reply"}
                                   for r, v in sources]
    records = (previous.records if previous is not None else []) + [record]
    if me == server:
        _become_reporter(ctx, original[server])
        what = ("a rank of the new server's set-up" if again else
                "the parameter server" if K == 1 else "a shard server")
        if len(dead) > len(first):     # more deaths inside this takeover's exchange
            what += (f" (rank(s) {', '.join(map(str, first))}), and rank(s) "
                     f"{', '.join(str(r) for r in dead if r not in first)} during the takeover,")
            dead_said = ""
        else:
            dead_said = f" (rank(s) {', '.join(map(str, dead))})"
        if K == 1:
            log.warning("%s%s died; rank %d takes over with θ of version %d, %d "
                        "workers go on from %.1f %% of their budget", what,
                        dead_said, original[server], every[server][0],
                        ctx.topo.size - 1, 100 * share)
        else:
            log.warning("%s%s died; rank %d serves shard 0 of %d, θ rebuilt from %s, "
                        "%d workers go on from %.1f %% of their budget", what,
                        dead_said, original[server], K,
                        ", ".join(f"shard {s}: rank {original[r]}'s "
                                  f"{'θ' if every[r][2] >= 0 else 'reply'} (version {v})"
                                  for s, (r, v) in enumerate(sources)),
                        ctx.topo.size - K, 100 * share)
        ctx.metrics.write("server_failed", **record)
    inject.forget(inject.KILL_ENV)      # (a push count of the old server's run)
    if os.environ.get(inject.DUMP_ENV):       # each survivor's θ, for a test
        inject.dump(f"takeover{len(records)}-reply-{original[me]}", version=mine[0],
                     theta=None if opt.is_server else held["theta"], versions=mine[3],
                     server_theta=opt.rule.theta if opt.is_server else None,
                     shard=mine[2], server=original[server], local=local, rebuilt=theta)
    if me == server and opt.keeps_local:
        log.warning("%s: every worker keeps its local model; the new server's (rank %d) "
                    "leaves the ensemble and the rule's per-worker state starts afresh",
                    opt.algorithm, original[server])
    return Takeover(share=share, theta=theta, records=records, own_buffers=own,
                    int_buffers=own_ints, survivors=states, local=local, opt=opt, vote=mine)


def exchange(new, held: dict, K: int, slice_of, *, set_up: bool = True) -> tuple:
    """Collective over ``new``, the survivors of a server's death: every survivor's vote
    (``held``, :meth:`~.optimizer.ParameterServer.holding`'s: allgathered), the new server
    (:func:`elect`) and, where the server was ``set_up`` (else every θ and buffer is the initial
    one), θ assembled on it from each shard's source with K > 1 (each gives its slice of
    ``held["theta"]``, ``slice_of(theta, s)``: :func:`gather_shards`) and every survivor's
    buffers (``{"buffers", "ints"}``, a gather to it). Returns ``(every, server, sources, θ,
    buffers)``; θ None with K = 1 (the server's own) and elsewhere, buffers None elsewhere. The
    CLI's takeover and your own loop's (:meth:`hpcasync.elastic._FrontDoor._take_over`) run it."""
    every = new.allgather(held["vote"])
    inject.point("takeover")
    server, sources = elect(every, K)
    theta = survivors = None
    if set_up:
        if K > 1:
            theta = gather_shards(new, sources, server, lambda s: slice_of(held["theta"], s))
        survivors = new.gather({"buffers": held["buffers"].cpu(), "ints": held["ints"]},
                               root=server)
    return every, server, sources, theta, survivors


def elect(every: list, K: int) -> tuple[int, list | None]:
    """Who serves after a server's death, from every survivor's ``(version, _, shard,
    versions)`` (``shard`` -1 on a worker, ``versions`` its reply's version per shard): the
    surviving server of the lowest shard, else the worker holding the newest reply (of shard 0;
    the lowest rank among equals). Returns ``(rank, sources)``, ``sources`` (K > 1) each
    shard's :func:`_shard_sources`."""
    workers = [r for r, e in enumerate(every) if e[2] < 0]
    servers = sorted((e[2], r) for r, e in enumerate(every) if e[2] >= 0)
    server = (servers[0][1] if servers else
              max(workers, key=lambda r: (every[r][3][0] if K > 1 else every[r][0], -r)))
    return server, (_shard_sources(every, K) if K > 1 else None)


def gather_shards(comm, sources: list, server: int, piece) -> torch.Tensor | None:
    """Collective over ``comm``: θ assembled on ``server`` from each shard's source
    (``sources[s] = (rank, version)``), which gives ``piece(s)``, its slice of shard ``s``; None
    elsewhere."""
    me = comm.Get_rank()
    pieces = gather_object(comm, {s: piece(s) for s, (r, _) in enumerate(sources) if r == me},
                           server)
    if pieces is None:
        return None
    merged = {s: t for part in pieces for s, t in part.items()}
    return torch.cat([merged[s] for s in range(len(sources))])


def _shard_sources(every: list, K: int) -> list[tuple[int, int]]:
    """For each shard, ``(rank, version)``: where its slice comes from — its surviving server
    (``every[r] = (version, None, shard, None)``), else the worker whose reply for that shard is
    the freshest (``every[r] = (version, share, -1, versions)``, the lowest rank among equals)."""
    out = []
    for s in range(K):
        server = [r for r, e in enumerate(every) if e[2] == s]
        if server:
            out.append((server[0], every[server[0]][0]))
            continue
        r = max((r for r, e in enumerate(every) if e[2] < 0), key=lambda r: (every[r][3][s], -r))
        out.append((r, every[r][3][s]))
    return out
