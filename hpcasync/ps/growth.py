"""Grow back in the parameter-server runtime (``--grow-back``, ULFM, ``--ps-ranks 1``): after a
death the run returns to its size with a replacement in the dead rank's place.

The synchronous runtimes spawn replacements from every survivor at once
(:meth:`hpcasync.runtime.elastic.FaultTolerance.reset`). A PS run's workers are asynchronous, so
here the **server spawns alone** (:class:`~hpcasync.runtime.join.Spawned`) and the workers go on pushing
while the replacement starts (its Python, torch and data: seconds). Then:

* **a worker died**: the server asks every worker to stop after its current push (the
  preemption stop's protocol, with the end message saying "grow", ``END_GROW``); every rank
  leaves the run (:class:`Regrow`); the survivors and the joiner form the world again, each
  joiner in a dead worker's place — its rank, its worker index, its data shard — and the run
  goes on from the server's state **in memory** as a resumed checkpoint would
  (``docs/design/ps.md``): the rule with its per-worker state, positions, push statistics, the
  workers' BatchNorm buffers. The joiner starts at the dead worker's position (its pushes that
  the server answered) from θ; SHAT's and ENSEMBLE's survivors keep their local models, the
  joiner's starts from θ (the dead worker's died with it).
* **the server died**: the survivors run the takeover (:mod:`.takeover`: a worker serves),
  then the new server spawns the replacement, which joins as a worker in the dead server's
  place; every worker resumes at the takeover's share of its budget.

A spawn that fails (no free slot) is said in one warning line and the run goes on shrunk, as
without ``--grow-back`` (no further spawn is tried), unless fewer than ``--min-ranks`` ranks are
left, which ends the job with one line. Design and measurements: docs/design/growth.md#the-
parameter-server.

Example (``ps.runtime.run``)::

    growth = PSGrowth(ctx)
    while True:
        try:
            return _run(ctx, takeover, growth)
        except Regrow as stop:
            growth.regrow(ctx, stop)       # collective over survivors and joiners
"""
from __future__ import annotations

import logging
import time

import torch

from .. import inject
from ..errors import ConfigError, ProcessFailedError
from ..runtime import join
from ..runtime.logs import setup_logging

log = logging.getLogger("hpcasync")

from .wire import END_GROW  # noqa: F401 - the end message that says "leave for a grow-back"


class Regrow(Exception):
    """Raised on every survivor once the server stopped every worker for a grow-back, after the
    old world was shrunk: ``comm`` the survivors, ``lost`` their dead ranks (old numbering),
    ``state`` the server's state (on the server; None elsewhere), ``local`` a SHAT/ENSEMBLE
    worker's own model."""

    def __init__(self, comm, lost: list[int], root: int, state: dict | None, local=None):
        super().__init__("grow-back")
        self.comm, self.lost, self.root, self.state, self.local = comm, list(lost), root, state, local


def validate(cfg) -> None:
    """``--grow-back`` with a PS algorithm: one server rank only."""
    o = cfg.options
    if o.get("min_ranks") and not o.get("grow_back"):
        raise ConfigError(f"--min-ranks applies to {cfg.algorithm} with --grow-back only (without "
                          "it the parameter server's run goes on with any number of workers)")
    if o.get("grow_back") and o.get("ps_ranks", 1) != 1:
        raise ConfigError("--grow-back with --ps-ranks K > 1 is not built: a dead shard server "
                          "is replaced by a worker (takeover), not grown back; use --ps-ranks 1")
    if o.get("max_ranks"):
        raise ConfigError(f"--max-ranks does not apply to {cfg.algorithm}: the parameter server "
                          "grows back into the dead ranks' places only (each worker's place "
                          "fixes its data shard and position); leave it out")


class PSGrowth:
    """The PS runtime's grow-back (module doc). One per run; every rank holds one.

    Attributes: ``enabled``; ``joins`` (one record per grow, the ``rank_joined`` records);
    ``spawned`` (the server's replacements not yet in the world)."""

    def __init__(self, ctx):
        from ..runtime import ft

        o = ctx.cfg.options
        self.enabled = bool(o.get("grow_back")) and ft.ulfm_enabled()
        self.size = ctx.topo.size              # refill the dead ranks' places (validate)
        self.min_ranks = o.get("min_ranks") or 1
        self.spawned = join.Spawned()
        self.failed_spawn: str | None = None
        self.state: dict | None = None          # the server's state at a grow-back's stop
        self.joins: list[dict] = []
        self.next_id = ctx.topo.size

    # -- the server, while serving -------------------------------------------------------------
    def replace(self, ctx, dead: int, alive: int) -> bool:
        """On the server, when a worker was found dead (``dead`` ranks dead in this run and not
        yet replaced, ``alive`` ranks left): spawn the replacements now; True: stop the workers
        for the grow. A failed spawn turns grow-back off for the rest of the run (one warning
        line) or, below ``--min-ranks``, ends the job."""
        if not self.enabled or self.failed_spawn is not None:
            return self.spawned.count > 0
        want = dead - self.spawned.count
        if want <= 0:
            return self.spawned.count > 0
        error = self.spawned.spawn(want)
        if error is None:
            return True
        self.failed_spawn = error
        self._check_min(alive, error)
        log.warning("grow-back: spawning %d replacement(s) failed (%s); going on with %d ranks "
                    "and without grow-back (Open MPI's launcher exits with status 213 at the "
                    "end for the failed spawn)", want, error, alive)
        ctx.metrics.write("grow_failed", error=error, world_size=alive)
        return self.spawned.count > 0

    def _check_min(self, alive: int, why: str) -> None:
        if alive < self.min_ranks:
            raise ProcessFailedError(f"a rank died; {alive} left and spawning a replacement "
                                     f"failed ({why}): fewer than --min-ranks {self.min_ranks}",
                                     [])

    # -- every survivor, after the stop or a takeover --------------------------------------------
    def connect(self, ctx, comm, kept: list[int], size_before: int, server: int,
                position: list) -> tuple[bool, dict | None]:
        """Collective over the survivors ``comm`` (``server`` the spawner's rank in it; ``kept``
        their ranks in the world of ``size_before`` ranks before the death) and the spawned
        joiners: the grown world, each joiner in a dead rank's place; replaces ``ctx.topo``.
        Returns ``(grew, record)`` (``record`` on every survivor). Spawns (server) what the
        server has not spawned yet for the emptied places, if grow-back is still on."""
        me = comm.Get_rank()
        t0 = time.perf_counter()
        early = len(self.spawned.groups)       # spawned while the workers trained (before t0)
        if me == server and self.enabled and self.failed_spawn is None:
            dead = size_before - comm.Get_size()    # (some seen only at the shrink)
            if dead > self.spawned.count:
                self.replace(ctx, dead, comm.Get_size())
        groups = self.spawned.take() if me == server else None
        spawn_s = round(sum(s for _, _, s in groups), 4) if groups else 0.0
        before_s = sum(s for _, _, s in groups[:early]) if groups else 0.0
        n = comm.bcast(sum(g[1] for g in groups) if me == server else None, root=server)
        if n == 0:
            if me == server:
                self._check_min(comm.Get_size(), self.failed_spawn or "grow-back is off")
            return False, None
        places = size_before - comm.Get_size()
        if n != places:     # a worker's place fixes its shard and position: refill every one
            raise join.JoinError(f"grow-back: {n} replacement(s) started for {places} dead "
                                 f"rank(s) (a spawn failed after another had worked); resume "
                                 f"from the last checkpoint")
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n

        def order(joiners: int) -> dict:
            keys, joiner_keys, _ = join._order(size_before, kept, comm.Get_size(), joiners)
            return {"keys": joiner_keys, "survivor_keys": keys, "ps_rank": keys[server],
                    "src": keys[server]}

        inject.point("grow")
        world, msg = join.connect(comm, server, groups, order)
        from .. import topology

        ctx.topo = topology.Topology.build(world, ranks_per_node=ctx.cfg.ranks_per_node,
                                           device=ctx.cfg.device, ps_rank=msg["ps_rank"])
        original = [0] * world.Get_size()
        for k, r in zip(msg["survivor_keys"], ctx.original_ranks):
            original[k] = r
        for k, r in zip(msg["keys"], ids):
            original[k] = r
        ctx.original_ranks = original
        record = {"joined": ids, "ranks": msg["keys"], "world_size": world.Get_size(),
                  "position": position, "spawn_s": spawn_s,
                  "join_s": round(time.perf_counter() - t0 + before_s, 4)}
        self.joins.append(record)
        join._joined.setdefault("grew", True)
        return True, record

    def send(self, ctx, payload: dict) -> dict:
        """After :meth:`connect`: the server's ``payload`` to every rank of the grown world (the
        joiners included); returns it."""
        topo = ctx.topo
        blob = topo.world.bcast({**payload, "original": ctx.original_ranks, "joins": self.joins,
                                 "next_id": self.next_id, "clocks": (ctx.t0, ctx.metrics.t0)}
                                if topo.rank == topo.ps_rank else None, root=topo.ps_rank)
        self.joins = list(blob["joins"])        # the server's records (its positions)
        if topo.rank == topo.ps_rank:
            rec = self.joins[-1]
            ctx.metrics.write("rank_joined", **rec)
            log.warning("grow-back: %d rank(s) joined as rank(s) %s; %d ranks again (%.3f s)",
                        len(rec["joined"]), ", ".join(map(str, rec["ranks"])), topo.size,
                        rec["join_s"])
        return blob

    def receive(self, ctx) -> dict:
        """The joiner's side of :meth:`send` (after ``join.joiner_topology``)."""
        topo = ctx.topo
        blob = topo.world.bcast(None, root=topo.ps_rank)
        ctx.original_ranks = list(blob["original"])
        self.joins, self.next_id = list(blob["joins"]), blob["next_id"]
        ctx.t0, ctx.metrics.t0 = blob["clocks"]
        setup_logging(topo.rank, report_rank=topo.ps_rank)
        log.warning("grow-back: joined as rank %d of %d (%s)", topo.rank, topo.size,
                    blob["kind"])
        return blob

    def summary(self) -> dict:
        return {"rank_joins": self.joins} if self.joins else {}


def worker_view(state: dict) -> dict:
    """What a worker resumes from in a server's state (``ps.runtime._run``): positions, the
    workers' last pushed buffers (a replacement, whose row the dead worker's death cleared, takes
    their mean: the server's average), the sizes checked at a resume."""
    seen = [bool(x) for x in state["seen"]]
    rows = state["buffers"]
    mean = rows[torch.tensor(seen)].mean(0) if any(seen) and rows.numel() else None
    return {"ps": {"positions": list(state["ps"]["positions"])}, "buffers": rows,
            "seen": seen, "mean_buffers": mean,
            "batches_per_worker": state["batches_per_worker"], "ps_ranks": 1, "kind": "grow"}
