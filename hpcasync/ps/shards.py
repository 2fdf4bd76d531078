"""A sharded parameter server (``--ps-ranks K``): θ cut into K contiguous shards, one per server.

Shard s holds a contiguous slice of the flat θ with its own communicator, transport and rule; a
worker pushes slice s of its gradient to server s and takes each reply slice through shard s's
worker-side rule. Shard 0's server sequences the pushes (:mod:`.ordering`), so K servers give
bitwise the single server's θ for that order.

Example (what ``hpcasync train --ps-ranks 2`` does on 4 ranks: servers 0 and 1, workers 2 and 3)::

    layout = ShardLayout.build(comm, ps_rank=0, shards=2, numel=flat.numel)    # collective
    layout.bounds        # [(0, ceil(n / 2)), (ceil(n / 2), n)]

Differences from the reference design (Li et al., "Scaling Distributed Machine Learning with the
Parameter Server", OSDI 2014, which shards key ranges over server nodes with consistent hashing and
replicates them): contiguous ranges, no replication, and no server-to-server traffic beyond the
push order and the epoch records; a resume from shards cut apart loses a few pushes on some
slices.

Design: docs/design/ps.md#sharded-server (layout, bad pushes, epoch records, checkpoints, resume
from shards cut apart).
"""
from __future__ import annotations

import logging
import time

import torch

from ..errors import ConfigError, HpcasyncError
from ..topology import server_ranks

log = logging.getLogger("hpcasync")

_TAG_EPOCH = 4191          # server s > 0 -> server 0: its slice at an epoch crossing; empty: end


class ShardError(HpcasyncError):
    """The shard servers disagree (on epochs crossed): a bug or a lost push, never waited out."""


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]``: ``numel`` elements in ``shards`` contiguous ranges, the first
    ``numel % shards`` one element longer than the rest."""
    base, rest = divmod(numel, shards)
    bounds, lo = [], 0
    for s in range(shards):
        hi = lo + base + (s < rest)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def check_shards(shards, world_size: int, numel: int | None = None,
                 algorithm: str | None = None) -> int:
    """``shards`` as an int, or a one-line ConfigError: 1 <= K < world size (one worker at least),
    and K <= the number of parameters."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ConfigError(f"--ps-ranks must be a positive integer, got {shards!r}")
    if shards == 1 and world_size < 2 and algorithm is not None:
        raise ConfigError(f"{algorithm} needs a parameter server and at least one worker: "
                          f"start 2 or more ranks (this run has {world_size})")
    if shards >= world_size:
        raise ConfigError(f"--ps-ranks {shards} leaves no worker in a world of {world_size} "
                          f"ranks: start more than {shards} ranks")
    if numel is not None and shards > numel:
        raise ConfigError(f"--ps-ranks {shards} is more than the model's {numel} parameters")
    return shards


class ShardLayout:
    """Who serves which slice (docs/design/ps.md#sharded-server). Attributes: ``servers`` (world
    ranks), ``workers`` (world ranks), ``bounds``, ``shard`` (this rank's shard, -1 on a worker),
    ``comms`` (shard s's communicator, None where this rank is not in it)."""

    def __init__(self, comm, ps_rank: int, shards: int, numel: int):
        size, rank = comm.Get_size(), comm.Get_rank()
        check_shards(shards, size, numel)
        self.comm, self.K = comm, shards
        self.servers = server_ranks(ps_rank, shards, size)
        self.workers = [r for r in range(size) if r not in self.servers]
        self.bounds = shard_bounds(numel, shards)
        self.shard = self.servers.index(rank) if rank in self.servers else -1
        self.comms: list = [None] * shards

    @classmethod
    def build(cls, comm, *, ps_rank: int, shards: int, numel: int) -> "ShardLayout":
        """Collective over ``comm`` when ``shards > 1`` (K communicator creations)."""
        from mpi4py import MPI

        layout = cls(comm, ps_rank, shards, numel)
        if shards == 1:
            layout.comms[0] = comm
            return layout
        group = comm.Get_group()
        for s, server in enumerate(layout.servers):
            sub = group.Incl([server, *layout.workers])
            new = comm.Create(sub)
            sub.Free()
            layout.comms[s] = None if new == MPI.COMM_NULL else new
        group.Free()
        return layout

    def slice(self, t: torch.Tensor, s: int) -> torch.Tensor:
        if self.K == 1:
            return t
        lo, hi = self.bounds[s]
        return t[lo:hi]

    def free(self) -> None:
        if self.K > 1:
            for c in self.comms:
                if c is not None:
                    c.Free()
        self.comms = []


def worker_pieces(layout: ShardLayout, g: torch.Tensor, numel: int) -> list[torch.Tensor]:
    """The K slices a worker pushes (docs/design/ps.md#sharded-server: non-finite or wrong-length
    gradients are sent so that every shard rejects them)."""
    if layout.K == 1:
        return [g]
    if g.numel() != numel:
        return [torch.zeros(0)] * layout.K
    if not bool(torch.isfinite(g).all()):
        g = torch.full((numel,), float("nan"))
    return [layout.slice(g, s) for s in range(layout.K)]


def wait_ends(transports, request_stop=None) -> bool:
    """Worker, after its last push, with K transports: wait for every server's end message (the
    first time ``request_stop()`` is true a ``KIND_STOP`` goes to every server not yet ended);
    returns True if any server stops the job."""
    from mpi4py import MPI

    from .wire import _TAG_END, KIND_STOP

    ends = [torch.zeros(1, dtype=torch.float64) for _ in transports]
    reqs = [t.comm.Irecv([e.numpy(), MPI.DOUBLE], source=t.ps_rank, tag=_TAG_END)
            for t, e in zip(transports, ends)]
    done = [False] * len(reqs)
    t0, pause, asked = time.perf_counter(), 2e-5, False
    while not all(done):
        for i, r in enumerate(reqs):
            done[i] = done[i] or r.Test()
        if all(done):
            break
        if not asked and request_stop is not None and request_stop():
            for t, d in zip(transports, done):
                if not d:
                    t.push(torch.zeros(0), kind=KIND_STOP)
            asked = True
        time.sleep(pause)
        pause = min(1e-3, pause * 2)
    transports[0].wait_time += time.perf_counter() - t0
    return any(bool(e[0]) for e in ends)


class EpochExchange:
    """Server side, K > 1: the shards' θ at each epoch crossing (docs/design/ps.md#sharded-server),
    as the server loop's ``on_epoch(epoch, record)``. Server 0 takes every other shard's slice into
    the model (``opt``: the ParameterServer; its ``load_theta()`` gives its own slice), then calls
    ``on_epoch``; server s > 0 sends its slice instead and calls nothing. :meth:`end` is server
    s > 0's empty end message, :meth:`finish` the close of the exchange."""

    def __init__(self, opt, on_epoch):
        self.opt, self.layout, self.on_epoch = opt, opt.layout, on_epoch
        self.pending: list = []         # server s > 0: (request, buffer) of its sends in flight
        self.ended = False              # server s > 0: its end message is sent

    def __call__(self, epoch: int, record: dict) -> None:
        from mpi4py import MPI

        from .wire import wait

        opt, layout = self.opt, self.layout
        if layout.shard == 0:
            opt.load_theta()
            for s in range(1, layout.K):
                piece = layout.slice(opt.flat.params, s)
                host = torch.empty(piece.numel())
                status = MPI.Status()
                wait(layout.comm.Irecv([host.numpy(), MPI.FLOAT], source=layout.servers[s],
                                       tag=_TAG_EPOCH), status)
                if status.Get_count(MPI.FLOAT) != piece.numel():     # its end: no such crossing
                    raise ShardError(f"{opt.algorithm} --ps-ranks {layout.K}: shard {s}'s server "
                                     f"(rank {layout.servers[s]}) ended without crossing epoch "
                                     f"{epoch}, which shard 0 crossed: the shards disagree on "
                                     "the pushes they took")
                piece.copy_(host)
            if self.on_epoch is not None:
                self.on_epoch(epoch, record)
            return
        self.pending[:] = [(req, buf) for req, buf in self.pending if not req.Test()]
        buf = opt.rule.theta.detach().cpu().clone()
        self.pending.append((layout.comm.Isend([buf.numpy(), MPI.FLOAT], dest=layout.servers[0],
                                               tag=_TAG_EPOCH), buf))

    def end(self) -> None:
        """Server s > 0, its last epoch crossed: the empty end message to server 0 (sent before
        the end of the run's handshake with the workers, which server 0 may be waiting on)."""
        from mpi4py import MPI

        if self.layout.shard > 0 and not self.ended:
            self.ended = True
            self.pending.append((self.layout.comm.Isend(
                [torch.zeros(0).numpy(), MPI.FLOAT], dest=self.layout.servers[0],
                tag=_TAG_EPOCH), None))

    def finish(self, *, collective: bool = True) -> None:
        """At close (before the transports close): server s > 0 completes its epoch sends and its
        end message; server 0 takes every end message and raises :class:`ShardError` if a slice
        comes first (that shard crossed an epoch server 0 did not). ``collective=False`` (a rank
        died): only the sends in flight."""
        from mpi4py import MPI

        from .wire import wait

        L = self.layout
        if collective:
            self.end()                      # if serve() did not get to it
        for req, _ in self.pending:
            wait(req)
        if not collective or L.shard > 0:
            return
        for s in range(1, L.K):
            status = MPI.Status()
            wait(L.comm.Irecv([torch.empty(L.bounds[s][1] - L.bounds[s][0]).numpy(), MPI.FLOAT],
                              source=L.servers[s], tag=_TAG_EPOCH), status)
            if status.Get_count(MPI.FLOAT):
                raise ShardError(f"{self.opt.algorithm} --ps-ranks {L.K}: shard {s}'s server "
                                 f"(rank {L.servers[s]}) crossed an epoch that shard 0 did not: "
                                 "the shards disagree on the pushes they took")


def shard_snapshot(opt, manager, snapshot: dict, *, epoch: int, step: int, header: dict):
    """Server: write this shard's checkpoint (docs/design/ps.md#sharded-server); returns its path.
    With K = 1 this is ``manager.save`` of ``snapshot`` unchanged."""
    from ..checkpoint import CheckpointManager, checkpoint_name

    L = opt.layout
    if L.K > 1:
        snapshot = {**snapshot, "ps_ranks": L.K, "shard": L.shard,
                    "bounds": [list(b) for b in L.bounds],
                    "shard_file": checkpoint_name(epoch, step)}
        if L.shard > 0:
            manager = CheckpointManager(manager.directory / f"shard-{L.shard}", keep=manager.keep)
    return manager.save(snapshot, epoch=epoch, step=step, **header)


def check_bounds(L, state: dict) -> None:
    """One line when a shard checkpoint's ``state`` was cut at other bounds than layout ``L``."""
    from ..errors import CheckpointError

    if state.get("bounds") != [list(b) for b in L.bounds]:
        raise CheckpointError(f"checkpoint shards {state.get('bounds')} do not match this model's "
                              f"{[list(b) for b in L.bounds]}")


def load_shard_state(opt, directory, state: dict, header: dict) -> dict:
    """Server: the state to resume this shard from. ``state`` is shard 0's checkpoint (rank
    0 reads it, every rank receives it); server s > 0 reads its own file beside it
    (``shard-<s>/``, same name) and checks that it was cut the same way, at the same number of
    pushes. A SIGTERM checkpoint (kind ``signal``, written by each server the moment the signal
    reached it, so at its own push count) is paired with the shard's newest checkpoint of the
    same epoch instead."""
    from pathlib import Path

    from ..checkpoint import load_checkpoint
    from ..errors import CheckpointError

    L = opt.layout
    if L.K == 1 or L.shard == 0:
        return state
    check_bounds(L, state)
    mine_dir = Path(directory) / f"shard-{L.shard}"
    path = mine_dir / str(state.get("shard_file"))
    exact = path.is_file() or state.get("kind") != "signal"
    if not exact:       # each server's SIGTERM checkpoint is at its own push count: same epoch
        tag = str(state.get("shard_file"))[:len("ckpt-e0000")]
        same = sorted(mine_dir.glob(f"{tag}-s*.pt"), reverse=True)
        if not same:
            raise CheckpointError(f"shard {L.shard} has no checkpoint of epoch {tag[6:]} beside "
                                  f"shard 0's SIGTERM checkpoint {state.get('shard_file')} "
                                  f"(in {mine_dir})")
        path = same[0]
    mine = load_checkpoint(path, expect=header)
    n0, n = sum(state["ps"]["positions"]), sum(mine["ps"]["positions"])
    if mine.get("shard") != L.shard or (exact and n != n0) or mine.get("kind") != state.get("kind"):
        raise CheckpointError(f"{path}: shard {L.shard}'s checkpoint does not match shard 0's "
                              f"(shard {mine.get('shard')}, {mine.get('kind')} at {n} pushes vs "
                              f"{state.get('kind')} at {n0})")
    return mine


def align_resume(opt, directory, state: dict, header: dict) -> dict:
    """Every rank, K > 1 (collective over ``opt.comm``): the state this rank resumes from, with the
    worker positions aligned over the shards (docs/design/ps.md#sharded-server): a server gets its
    shard's state (s > 0: its own file) with ``positions`` = the elementwise max over the shards,
    ``stats`` counting the pushes it lost as taken, and ``resume_lost_pushes`` (per shard); a worker
    gets shard 0's state with the aligned positions. With K = 1: ``state`` unchanged."""
    import copy

    L = opt.layout
    if L.K == 1:
        return state
    mine = load_shard_state(opt, directory, state, header) if L.shard >= 0 else state
    per_shard = [None] * L.K
    for shard, positions in opt.comm.allgather((L.shard, mine["ps"]["positions"])):
        if shard >= 0:
            per_shard[shard] = [int(p) for p in positions]
    aligned = [max(col) for col in zip(*per_shard)]
    lost = [sum(a - p for a, p in zip(aligned, pos)) for pos in per_shard]
    out = copy.copy(mine)
    out["ps"] = ps = dict(mine["ps"], positions=aligned)
    out["resume_lost_pushes"] = lost
    if L.shard >= 0:
        own = per_shard[L.shard]
        stats = ps["stats"] = dict(ps["stats"])
        stats["accepted"] = int(stats["accepted"]) + lost[L.shard]
        stats["per_worker"] = [int(c) + a - p for c, a, p in
                               zip(stats["per_worker"], aligned, own)]
        if any(lost) and L.shard == 0:
            log.warning("%s --ps-ranks %d: the shards' checkpoints hold different worker "
                        "positions %s; every worker resumes after its latest push %s, and the "
                        "shards lose %s pushes that they had not applied (module hpcasync.ps."
                        "shards)", opt.algorithm, L.K, per_shard, aligned, lost)
    return out
