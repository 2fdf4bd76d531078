"""Grow back in the parameter-server runtime (``--grow-back``, ULFM, ``--ps-ranks 1``): after a
death the run returns to its size with a replacement in the dead rank's place.

The grow is the run's one fault-tolerance object's
(:meth:`hpcasync.runtime.elastic.FaultTolerance.grow`: the places, the first-launch numbers, the
``rank_joined`` record, the topology rebuilt by the :class:`~.takeover.PSWorld`), in the mode
where one rank spawns: the synchronous runtimes spawn replacements from every survivor at once,
but a PS run's workers are asynchronous, so here the **server spawns alone**
(:class:`~hpcasync.runtime.join.Spawned`) and the workers go on pushing while the replacement
starts (its Python, torch and data: seconds). Then:

* **a worker died**: the server asks every worker to stop after its current push (the
  preemption stop's protocol, with the end message saying "grow", ``END_GROW``); every rank
  leaves the run (:class:`Regrow`); the survivors absorb the death (``FaultTolerance.absorb``)
  and, with the joiner, form the world again (:func:`grow`), each
  joiner in a dead worker's place — its rank, its worker index, its data shard — and the run
  goes on from the server's state **in memory** as a resumed checkpoint would
  (``docs/design/ps.md``): the rule with its per-worker state, positions, push statistics, the
  workers' BatchNorm buffers. The joiner starts at the dead worker's position (its pushes that
  the server answered) from θ; SHAT's and ENSEMBLE's survivors keep their local models, the
  joiner's starts from θ (the dead worker's died with it).
* **the server died**: the survivors run the takeover (:mod:`.takeover`: the object's reset,
  a worker serves), then the new server spawns the replacement (:func:`grow`), which joins as a
  worker in the dead server's
  place; every worker resumes at the takeover's share of its budget.

Your own loop grows back a dead worker with the same spawn, stop and grow
(:class:`PSGrowth` given to its ``ParameterServer`` by :class:`hpcasync.elastic.State`;
``ParameterServer.regrow``; the replacement's place is the dead worker's last commit, which each
worker sends the server: docs/design/elastic.md, "A parameter server in your own loop").

A spawn that fails (no free slot) is said in one warning line and the run goes on shrunk, as
without ``--grow-back`` (no further spawn is tried), unless fewer than ``--min-ranks`` ranks are
left, which ends the job with one line. Design and measurements: docs/design/growth.md#the-
parameter-server.

Example (``ps.runtime.run``)::

    growth, core = PSGrowth.from_options(ctx), fault_tolerance(ctx)
    while True:
        try:
            return _run(ctx, takeover, growth)
        except Regrow as stop:
            core.absorb(stop.comm)                  # the survivors
            grow(ctx, core, growth, {"kind": "worker", "state": ...})   # and the joiners
"""
from __future__ import annotations

import logging

import torch

from ..comm.objects import bcast_object
from ..errors import ConfigError, ProcessFailedError
from ..runtime import join
from ..runtime.logs import setup_logging

log = logging.getLogger("hpcasync")

from .wire import END_GROW  # noqa: F401 - the end message that says "leave for a grow-back"


class Regrow(Exception):
    """Raised on every survivor once the server stopped every worker for a grow-back, after the
    old world was shrunk: ``comm`` the survivors, ``state`` the server's state (on the server;
    None elsewhere), ``local`` a SHAT/ENSEMBLE worker's own model."""

    def __init__(self, comm, state: dict | None, local=None):
        super().__init__("grow-back")
        self.comm, self.state, self.local = comm, state, local


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
    """A parameter server's grow-back (module doc): the server spawns the replacements alone
    while its workers train. One per run in the CLI (every rank holds one:
    :meth:`from_options`); in your own loop :class:`hpcasync.elastic.State` gives the
    optimizer one under grow-back (``ParameterServer.growth``).

    Attributes: ``enabled``; ``spawned`` (the server's replacements not yet in the world),
    ``failed_spawn`` (the error of a spawn that failed: no other is tried), ``state`` (the
    CLI server's state at a grow-back's stop); ``metrics`` (where ``grow_failed`` is written,
    or None)."""

    def __init__(self, enabled: bool, min_ranks: int = 1, metrics=None):
        self.enabled, self.min_ranks, self.metrics = bool(enabled), min_ranks or 1, metrics
        self.spawned = join.Spawned()
        self.failed_spawn: str | None = None
        self.state: dict | None = None
        self.wanted = False        # a worker died before its end: spawn at the loop's top

    @classmethod
    def from_options(cls, ctx) -> "PSGrowth":
        """The CLI run's: ``--grow-back`` (under ULFM), ``--min-ranks``."""
        from ..runtime import ft

        o = ctx.cfg.options
        return cls(bool(o.get("grow_back")) and ft.ulfm_enabled(), o.get("min_ranks") or 1,
                   ctx.metrics)

    # -- the server, while serving -------------------------------------------------------------
    def wire(self, hooks: dict, server, transport, world_size: int, before=None) -> None:
        """Server: ``hooks`` (``PSServer``'s ``on_failure`` and ``stop_requested``) wrapped so
        that a worker found dead before its end has its replacement spawned at the loop's top,
        between two pushes with no header receive posted (withdrawn first; one that had matched
        a header keeps it), while the others train; then every worker is stopped after its
        current push (``PSServer.begin_grow``: the end message says ``END_GROW``), also for a
        death only the server's last wait saw (``PSServer.grow_back``: the workers that finished
        still wait for their end message). ``server``: a function giving the loop's
        ``PSServer``; ``before``: called first at each top."""
        told, stop = hooks.get("on_failure"), hooks.get("stop_requested")

        def on_failure(record: dict) -> None:
            if told is not None:
                told(record)
            if not record["finished"]:
                self.wanted = True

        def stop_requested() -> bool:
            if before is not None:
                before()
            if self.wanted:
                self.wanted = False
                transport.withdraw_headers()
                dead = len(server().failed)
                if self.replace(dead, world_size - dead):
                    server().begin_grow()
            return stop is not None and stop()
        hooks.update(on_failure=on_failure, stop_requested=stop_requested,
                     grow_back=self.enabled)

    def replace(self, dead: int, alive: int) -> bool:
        """On the server, when a worker was found dead (``dead`` ranks dead in this run and not
        yet replaced, ``alive`` ranks left): spawn the replacements now; True: stop the workers
        for the grow. A failed spawn turns grow-back off for the rest of the run (one warning
        line) or, below ``min_ranks``, ends the job."""
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
        if self.metrics is not None:
            self.metrics.write("grow_failed", error=error, world_size=alive)
        return self.spawned.count > 0

    def _check_min(self, alive: int, why: str) -> None:
        if alive < self.min_ranks:
            raise ProcessFailedError(f"a rank died; {alive} left and spawning a replacement "
                                     f"failed ({why}): fewer than --min-ranks {self.min_ranks}",
                                     [])

    def top_up(self, places: int, alive: int) -> list:
        """On the server, once the survivors meet to grow (``places`` emptied, ``alive`` ranks
        left): spawn what it has not yet for the emptied places (some deaths are seen only at
        the shrink), if grow-back is still on; returns the groups for
        :meth:`~hpcasync.runtime.elastic.FaultTolerance.grow` (taken: forgotten here)."""
        if self.enabled and self.failed_spawn is None and places > self.spawned.count:
            self.replace(places, alive)
        return self.spawned.take()


def grow(ctx, core, growth: PSGrowth, payload: dict, position=None) -> dict | None:
    """With ``--grow-back``, after a takeover (``core``'s reset) or a worker's death (its
    absorption): the server spawns what it has not spawned yet and the survivors take the
    replacements in, each in a dead rank's place (``core.grow``, the server's groups); then the
    server's ``payload`` goes to every rank of the grown world (:func:`receive` on a
    replacement). Collective over the survivors; returns the payload, None if nobody joined
    (grow-back off, or its spawn failed: below ``--min-ranks`` the job ends with one line)."""
    if not growth.enabled:
        return None
    topo = ctx.topo
    server = topo.ps_rank
    groups = (growth.top_up(core.size_before - topo.size, topo.size)
              if topo.rank == server else None)
    if core.grow(core.failures[-1], spawner=server, groups=groups, position=position) is None:
        if topo.rank == server:
            growth._check_min(topo.size, growth.failed_spawn or "nothing spawned")
        return None
    topo = ctx.topo
    blob = bcast_object(topo.world, {**payload, "joins": core.joins,
                                     "clocks": (ctx.t0, ctx.metrics.t0)}
                        if topo.rank == topo.ps_rank else None, topo.ps_rank)
    core.joins = list(blob["joins"])        # the server's records (its positions)
    if topo.rank == topo.ps_rank:
        rec = core.joins[-1]
        ctx.metrics.write("rank_joined", **rec)
        log.warning("grow-back: %d rank(s) joined as rank(s) %s; %d ranks again (%.3f s)",
                    len(rec["joined"]), ", ".join(map(str, rec["ranks"])), topo.size,
                    rec["join_s"])
    return blob


def receive(ctx, core) -> dict:
    """A replacement's side of :func:`grow` (after ``hpcasync.init``'s join): the server's
    payload, its join records and the run's clocks."""
    topo = ctx.topo
    blob = bcast_object(topo.world, None, topo.ps_rank)
    core.joins = list(blob["joins"])
    ctx.t0, ctx.metrics.t0 = blob["clocks"]
    setup_logging(topo.rank, report_rank=topo.ps_rank)
    log.warning("grow-back: joined as rank %d of %d (%s)", topo.rank, topo.size, blob["kind"])
    return blob


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
