"""``hpcasync.elastic``: your own loop survives a dead rank under Open MPI's ULFM.

Horovod's elastic shape (``State``, ``commit``, ``@run``) over hpcasync's front door::

    import hpcasync
    ctx = hpcasync.init("ssgd")
    opt = hpcasync.optimizer("ssgd", model, torch.optim.SGD(model.parameters(), lr=0.05))
    sampler = hpcasync.elastic.ElasticSampler(train, batch_size=64, rank=ctx.rank,
                                              num_replicas=ctx.size, seed=0)
    state = hpcasync.elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0)

    @hpcasync.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            loader = DataLoader(data, batch_size=64, sampler=state.sampler)
            for state.batch, (x, y) in enumerate(loader, start=state.batch):
                opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
                state.sampler.record_batch()
                if state.batch % 10 == 0:
                    state.commit()
            state.epoch += 1             # past the last epoch at the end: a call after a death
            state.batch = 0              # there (every survivor had returned) trains nothing
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)

Started as ``mpirun --with-ft ulfm -n N python loop.py``: when a rank dies every survivor rolls
back to its last ``commit()``, the world is shrunk, the topology, the optimizers and the sampler
are rebuilt on the survivors (``state.rank``/``state.size``/``state.roles`` are the new ones), the
reset callbacks run, rank 0's state is broadcast and ``train(state)`` is called again; the
sampler deals the rest of the epoch from the committed position over the survivors
(:class:`~hpcasync.data.sharding.ElasticSampler`: no sample of the epoch trained twice or lost).
SSGD (PowerSGD included: each rank keeps its own error memory), local SGD, SlowMo and DiLoCo
(the survivors go on from the sync root's replica), OD-SGD and DASO (give DASO the sampler, ``hpcasync.optimizer("daso", ..., epochs=E,
sampler=sampler)``, so that an epoch dealt over fewer ranks is recounted; it keeps its node
groups, and after a death inside a cycling epoch the survivors average their restored states
before the sync). A parameter-server algorithm (its server serves inside your function:
``if state.roles.is_server: opt.serve(); return``, the workers end theirs with ``opt.finish()``):
a dead worker is retired by the server and the others never stop; at the end the survivors take
the final model over the shrunk world (``state.ft.failures`` records the death, ``absorbed``). A
dead server is taken over: the workers roll back to their last commits, the one holding the
newest reply serves from it (``state.roles.is_server`` there) with a fresh rule, and the others
push to it (``ParameterServer.take_over``); its own rest of the data is not trained. With shard
servers (``ps_ranks > 1``) a dead one's place is taken the same way, each shard's slice from its
surviving server or from the newest reply for it. A death while the server was set up (its
constructor's collectives) sets it up again on the survivors at the first sync. With grow-back
(below) a dead worker is replaced: each worker's ``commit()`` goes to the server too; the server
spawns the replacement, stops the workers after their current push (their next ``step()`` raises
:class:`~hpcasync.runtime.elastic.GrowInterrupt`, which ``@run`` handles: nothing rolled back),
the world grows and the replacement goes on from the dead worker's last commit the server took
(the pushes after it are redone). A dead server is taken over and a replacement takes the new
server's former worker place, from that worker's last commit; shard servers (``ps_ranks > 1``)
with grow-back are refused with one line.

**Growing back** (``HPCASYNC_GROW_BACK=1`` in the launcher's environment, e.g. ``mpirun -x
HPCASYNC_GROW_BACK=1``, or ``@hpcasync.elastic.run(grow_back=True, max_ranks=N)``): after the
shrink the survivors spawn replacements running the same command; each takes a dead rank's
number, builds its world inside its ``hpcasync.init`` (the grown one: ``ctx.rank``/``ctx.size``
are the grown world's), and in its ``@run`` function runs the reset callbacks and receives the
survivors' state at the first ``state.sync()``, as the survivors do after their reset; the world
is back to its starting size (or ``max_ranks``). Between ``hpcasync.init`` and ``train(state)`` a
script makes no collective call of its own (a replacement would make it alone).
:func:`is_joiner` tells a replacement (e.g. to skip a testing hook keyed on a dead rank).
Without ULFM a death ends the job (fail-fast, one line); ``state.persist(DIR)`` writes the
commits to disk, and a job started again (``hpcasync launch -- loop.py``) goes on from the
newest. The retry loop, latch, agreement and shrink are :mod:`hpcasync.runtime.elastic`'s, shared
with ``hvd.elastic``. Design: docs/design/elastic.md.
"""
from __future__ import annotations

import functools
import logging
import time

import torch

from . import api
from .data.sharding import ElasticSampler
from .errors import ConfigError, ProcessFailedError, ranks_in
from .runtime.ft import PSFailed
from .runtime import elastic as _core
from .runtime.elastic import HostsUpdatedInterrupt

log = logging.getLogger("hpcasync")

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "State", "is_joiner", "run"]

is_joiner = _core.is_joiner

_RESERVED = ("rank", "size", "roles", "ft")


class _FrontDoor(_core.Membership):
    """The front door's world: the default topology (:func:`hpcasync.init`'s), the
    ``hpcasync.optimizer`` objects and the samplers of one :class:`State`."""

    def __init__(self, state: "State", algorithm: str | None):
        from .topology import default_topology

        self.state, self.algorithm = state, algorithm
        # a parameter server's worker place fixes its data shard: grow back into the dead places
        self.refill_only = algorithm in api.PS_ALGORITHMS
        self._set_up = True         # (check_reset: every survivor's optimizer was set up)
        self.grown = False          # a PS world just grown: the next sync gives the replacements
                                    # their places (State.sync)
        self._pending = None        # a takeover whose set-up waits for the reset's grow-back
        self.topo = default_topology()          # collective if init() built none
        try:
            self.roles = api.roles_on(self.topo, algorithm)
        except Exception as exc:                # noqa: BLE001 - ULFM: a rank died at start-up
            if not _core.defer_startup_failure(exc, [self.topo.world]):
                raise
            self.roles = api.roles_on(self.topo, algorithm, split=False)   # (reset rebuilds it)
        self._own_world = False                 # the world is a shrunk one of ours: freed later

    @property
    def comm(self):
        return self.topo.world

    def comms(self) -> list:
        out = [self.topo.world, self.topo.local, self.topo.glob]
        ps = [self.ps] if self.ps is not None else []
        for opt in self.state._optimizers() + ps:
            comm = getattr(opt, "comm", None)
            out += [comm, getattr(getattr(opt, "reducer", None), "comm", None)]
            if hasattr(comm, "group_comms"):          # DASO's global groups
                out += list(comm.group_comms())
            layout = getattr(opt, "layout", None)     # a parameter server's per-shard ones
            out += list(getattr(layout, "comms", ()))
        return [c for c in out if c is not None]

    def rebuild(self, new) -> None:
        if self.ps is not None:
            return self._take_over(new)
        self._reinit(new)
        for opt in self.state._optimizers():
            self.move(opt, after_death=True)
        for sampler in self.state._samplers():
            sampler.set_world(self.topo.rank, self.topo.size)

    def absorb(self, new) -> None:
        """A parameter server's worker died and was retired (:meth:`FaultTolerance.absorb`): the
        front door onto the survivors; every worker keeps its data shard (the dead one's rest
        is not trained, as in the CLI without ``--grow-back``)."""
        self._reinit(new)

    def _reinit(self, new, ps_rank: int | None = None) -> None:
        """The front door re-initialised on ``new``, the survivors (collective over them); a
        parameter server's workers' communicator is freed here (``reinit_on_survivors``
        releases the topology's own)."""
        if self.roles.workers_comm not in (None, self.topo.world):
            api._free(self.roles.workers_comm)
        self.roles = api.reinit_on_survivors(new, free_old=self._own_world,
                                             algorithm=self.algorithm, ps_rank=ps_rank)
        self.topo, self._own_world = self.roles.topology, True

    @property
    def several_ps(self) -> bool:
        """The state holds more than one parameter-server optimizer."""
        return sum(getattr(h.value, "algorithm", None) in api.PS_ALGORITHMS
                   for h in self.state._handlers.values()) > 1

    @property
    def grows_at_reset(self) -> bool:
        """A parameter server's reset grows back after a death while it was set up (every
        worker's place is then its initial one) and after a server's death (the replacement
        takes the new server's worker place: :meth:`_take_over`, :meth:`regrow`)."""
        return self.ps is None or not self._set_up or self._pending is not None

    @property
    def ps_rank(self) -> int | None:
        return self.topo.ps_rank if self.ps is not None else None

    @property
    def ps(self):
        """The state's parameter-server optimizer (None: a synchronous algorithm's state)."""
        return next((h.value for h in self.state._handlers.values()
                     if isinstance(h.value, torch.optim.Optimizer)
                     and getattr(h.value, "algorithm", None) in api.PS_ALGORITHMS), None)

    def check_reset(self) -> None:
        """A parameter server's world is reset only when a server died while serving, or a rank
        while it was set up: a worker takes over (:meth:`_take_over`). A death after the final
        model was handed out ends the job with one line, said by the lowest survivor (the others
        wait for its ``MPI_Abort``). Collective over the survivors."""
        opt = self.ps
        if opt is None:
            return
        several = self.several_ps
        from mpi4py import MPI

        survivors = self.comm.Shrink()
        dead = sorted(set(range(self.size())) - set(ranks_in(survivors.Get_group(), self.comm)))
        first = survivors.Get_rank() == 0
        self._set_up = survivors.allreduce(opt.attached, op=MPI.LAND)   # (set up everywhere)
        survivors.Free()
        servers = [r for r in dead if r in self.topo.servers]
        if (servers or not self._set_up) and not opt.closed and not several:
            mine = self.topo.servers
            self._held = opt.holding(mine.index(self.rank()) if self.rank() in mine else -1,
                                     self.topo.ps_ranks)       # (once: an attempt may redo it)
            return
        if not first:
            time.sleep(10)
        what = (f"the parameter server (rank {servers[0]}) of several parameter-server "
                "optimizers in one State died (one is taken over)" if servers and several else
                f"the parameter server (rank {servers[0]}) died after serving"
                if servers else
                f"rank(s) {', '.join(map(str, dead))} died after the final model was handed out")
        raise PSFailed(f"{what}: ending the {self.algorithm} job; restart from a checkpoint")

    def _take_over(self, new) -> None:
        """A parameter server died: the surviving server of the lowest shard serves, else the
        survivor holding the newest reply, from its θ (``ps_ranks > 1``: each shard's slice from
        its surviving server, else from the worker with the newest reply for it); the others go
        on pushing to it from their restored commits, a worker in a dead shard server's place
        serving its shard (:meth:`ParameterServer.take_over`; the CLI's election:
        :func:`~hpcasync.ps.takeover.exchange`). A rank died while it was set up (it is not
        :attr:`~ParameterServer.attached`): set up again on the survivors, the server where it
        was if it survived. Collective over ``new``."""
        from .ps.takeover import exchange

        opt, held, K = self.ps, self._held, self.topo.ps_ranks
        # (each survivor's committed BatchNorm state to the new server: State.restore came first)
        every, server, sources, theta, survivors = exchange(
            new, held, K, lambda t, s: opt.layout.slice(t, s), set_up=self._set_up)
        self._reinit(new, ps_rank=server)
        # each worker's committed pushes (the votes'): where the new server's clock starts it
        positions = [(r, e[1]) for r, e in enumerate(every) if r not in self.topo.servers]
        self._pending = {"held": held, "theta": theta, "every": every, "survivors": survivors,
                         "positions": positions}
        if not (self._set_up and self.state.ft.grow_back):    # (ps_ranks 1: _check_growth)
            self._set_up_taken_over()       # (else after the grow: regrow, or settle)
        version = every[server][0] if sources is None else min(v for _, v in sources)
        self._new_server = (server, version, not self._set_up, sources and [
            (r, v, "server" if every[r][2] >= 0 else "reply") for r, v in sources], positions)

    def _set_up_taken_over(self, positions: list | None = None,
                           survivors: list | None = None) -> None:
        """The takeover's set-up (:meth:`ParameterServer.take_over`) over the current world:
        the elected server serves, each worker's clock at its pushes (``positions``, default
        the votes'), its BatchNorm state from the survivors' (``survivors``, default the
        takeover's, in the current world's rank order). Collective."""
        p, self._pending = self._pending, None
        if positions is None:
            positions = [pushes for _, pushes in p["positions"]]
        self.ps.take_over(self.topo.world, self.topo.ps_rank, p["held"],
                          ps_ranks=self.topo.ps_ranks, theta=p["theta"], positions=positions,
                          survivors=p["survivors"] if survivors is None else survivors)

    def settle(self, grew: dict | None) -> None:
        super().settle(grew)
        if self._pending is not None:       # the grow-back after a takeover spawned nothing
            self._set_up_taken_over()

    def shrunk(self, record: dict) -> None:
        if self.ps is None or record.get("absorbed"):
            return super().shrunk(record)
        server, version, kept, sources, positions = self._new_server
        survivors = record["survivors"]
        record.update(server=survivors[server], server_version=version, set_up_again=kept)
        if not kept:
            record["worker_positions"] = [[survivors[r], p] for r, p in positions]
        if sources and not kept:        # ps_ranks > 1: where each shard's slice came from
            record["shard_sources"] = [{"rank": survivors[r], "version": v, "from": where}
                                       for r, v, where in sources]
        if self.rank() == server and kept:
            log.warning("rank(s) %s died while the parameter server was set up; set up again on "
                        "%d ranks", ", ".join(map(str, record["dead_ranks"])), record["world_size"])
        elif self.rank() == server:
            log.warning("rank(s) %s died, a parameter server among them; rank %d serves from "
                        "θ of version %d, %d worker(s) go on from their last commits%s",
                        ", ".join(map(str, record["dead_ranks"])), record["server"], version,
                        self.roles.num_workers, " (a replacement takes rank %d's worker place)"
                        % record["server"] if self._pending is not None else "")

    def _regrow_taken_over(self, to_grown: list[int]) -> None:
        """After a server's death, with grow-back: the takeover's set-up over the grown world
        (the replacement's constructor makes the same collectives), each replacement in the new
        server's former worker place: at its committed pushes, from its last commit (its plain
        values, its samplers' position and shard, its LR schedulers), which the new server holds
        itself (:meth:`State._place`) and gives at the first sync."""
        votes = {to_grown[r]: e[1] for r, e in enumerate(self._pending["every"])}
        server = self.topo.ps_rank
        workers = [g for g in range(self.topo.size) if g != server]
        held = self._pending["survivors"]       # (the new server's: the replacement has none)
        survivors = None if held is None else [None] * self.topo.size
        for r, h in enumerate(held or ()):
            survivors[to_grown[r]] = h
        self._set_up_taken_over([votes.get(g, votes[server]) for g in workers], survivors)
        if self.topo.rank == server:
            self.ps._grown_places = {w: {"commit": self.state._place(), "steps": votes[server]}
                                     for w, g in enumerate(workers) if g not in votes}
        self.grown = True

    def move(self, opt, *, after_death: bool) -> None:
        """``opt`` onto the current topology. DASO (``set_topology``) keeps its node groups;
        after a death inside a cycling epoch, where the nodes have drifted apart, the survivors
        average their restored states when they all hold the same commit (collective; else
        the sync takes the most advanced one's, the root's), so that the sync drops no node's
        progress; after a grow the sync from a survivor brings the replacements up. The others
        reduce over the new world (``set_comm``)."""
        if hasattr(opt, "set_topology"):
            same = self.commits is not None and len(set(self.commits)) == 1
            opt.set_topology(self.topo, average=after_death and same and not opt.replicas_equal)
        else:
            opt.set_comm(self.topo.world)

    def regrow(self, grown) -> None:
        """What a replacement's ``hpcasync.init`` (the first call's options) does over
        ``grown``, then the optimizers and samplers onto it (local, as a replacement's
        :class:`State` does). A parameter server: set up again as a replacement's constructor
        does (:meth:`ParameterServer.regrow`), the server at the spawner's place; every worker
        keeps its data shard."""
        from .runtime.ft import translate
        from .topology import default_topology

        ps, before = self.ps, self.topo.world
        to_grown = ([translate(r, before, grown) for r in range(before.Get_size())]
                    if ps is not None else [])
        server = {"ps_rank": to_grown[self.topo.ps_rank]} if ps is not None else {}
        api.mark_replaced(self.topo)
        api.release(self.roles, free_world=self._own_world)       # local
        options = {**api.INIT_OPTIONS, **server}
        api.init(self.algorithm, comm=grown, threads=torch.get_num_threads(), **options)
        self.topo, self._own_world = default_topology(), True
        if ps is not None and self._pending is not None:    # after a takeover: its set-up here
            self._regrow_taken_over(to_grown)
        elif ps is not None:            # (a replacement's constructor comes before its State)
            ps.regrow(self.topo.world, self.topo.ps_rank)
            self.grown = True
        self.roles = api.roles_on(self.topo, self.algorithm)
        for opt in self.state._optimizers():
            self.move(opt, after_death=False)
        for sampler in self.state._samplers():
            if ps is None:
                sampler.set_world(self.topo.rank, self.topo.size)


class State(_core.TorchState):
    """What your loop needs back after a death: ``model``, ``optimizer`` (an
    ``hpcasync.optimizer``; a plain torch optimizer is saved too), ``sampler`` (an
    :class:`ElasticSampler`) and plain values as keywords (``epoch=0, batch=0``); models,
    optimizers, LR schedulers, samplers and GradScalers under any other keyword are tracked
    alike.

    ``commit()`` copies it in memory (no communication), ``restore()`` brings the last commit
    back, ``sync()`` broadcasts rank 0's; ``register_reset_callbacks([...])`` run after a
    reset. ``state.rank``, ``state.size`` and ``state.roles`` (:class:`hpcasync.Roles`) are this
    rank's in the current world (the ``ctx`` of :func:`hpcasync.init` is the world at the start).
    Collective: construct it on every rank, after ``hpcasync.init`` and the optimizer. An
    optimizer's model left out, or a torch sampler or data loader given, is a one-line error."""

    def __init__(self, model=None, optimizer=None, sampler=None, **extra):
        bad = [k for k in _RESERVED if k in extra]
        if bad:
            raise ConfigError(f"hpcasync.elastic.State: {', '.join(bad)} is the current world's "
                              "(a property): name your value otherwise")
        values = {"model": model, "optimizer": optimizer, "sampler": sampler, **extra}
        algos = sorted({getattr(v, "algorithm", None) for v in values.values()
                        if isinstance(v, torch.optim.Optimizer)} - {None})
        membership = _FrontDoor(self, algos[0] if algos else None)
        ft = _core.FaultTolerance(membership)
        object.__setattr__(self, "ft", ft)
        object.__setattr__(self, "_membership", membership)
        self._check_growth()
        for opt in values.values():     # a PS worker's death: retired, absorbed at the close
            if ft.ulfm and getattr(opt, "algorithm", None) in api.PS_ALGORITHMS:
                opt.on_survivors = ft.absorb
        super().__init__(**values)
        self._set_ps_growth()
        if _core.is_joiner():   # a replacement: its optimizers onto the grown world (built on
            for opt in self._optimizers():  # its own launch's: local), as the survivors' regrow
                membership.move(opt, after_death=False)
            membership.grown = membership.ps is not None    # its place comes at the first sync

    def _set_ps_growth(self) -> None:
        """Under grow-back, a parameter server's optimizer spawns a replacement for a dead
        worker (``ParameterServer.growth``), and each worker's commit goes to the server too."""
        from .ps.growth import PSGrowth

        ps = self._membership.ps
        if ps is None or not self.ft.ulfm:
            return
        if self._membership.several_ps and self.ft.grow_back:
            raise ConfigError("grow-back with several parameter-server optimizers in one State is "
                              "not built (one spawn and one stop per server); leave "
                              "HPCASYNC_GROW_BACK / grow_back out")
        ps.growth = PSGrowth(True, self.ft.min_ranks) if self.ft.grow_back else None

    def _check_growth(self) -> None:
        m = self._membership
        if (self.ft.ulfm and self.ft.grow_back and m.algorithm in api.PS_ALGORITHMS
                and m.topo.ps_ranks > 1):
            raise ConfigError(f"grow-back of {m.algorithm} with shard servers (ps_ranks > 1) is "
                              "not built: a dead shard server is taken over by a worker (leave "
                              "HPCASYNC_GROW_BACK / grow_back out, or use ps_ranks=1)")

    def commit(self) -> None:
        """Save the state (in memory); a parameter server's worker under grow-back also sends
        its committed plain values and samplers (not the model) to the server, which gives them
        to its replacement if it dies; with :meth:`persist`, every ``every``-th commit is also
        written to disk."""
        self._check_scaler()
        super().commit()
        ps = self._membership.ps
        if ps is not None and ps.growth is not None and ps.attached and not ps.is_server:
            ps.checkpoints.send_commit(self._place())

    def _check_scaler(self) -> None:
        """Under grow-back, a ``GradScaler`` that drives an optimizer of the state (it stepped it)
        must be in the state: a replacement's own scaler starts from its initial scale, its
        scaled gradients then weigh more or less than the others' in the average, and the
        replicas part (measured: exit 0, the replacement's parameters and scale unlike the
        survivors'). A one-line error at the commit."""
        if not self.ft.grow_back or any(isinstance(h.value, torch.amp.GradScaler)
                                        for h in self._handlers.values()):
            return
        stepped = [k for k, h in self._handlers.items() if getattr(h.value, "amp_stepped", False)]
        if stepped:
            raise ConfigError(f"hpcasync.elastic.State: a GradScaler steps the optimizer "
                              f"{stepped[0]!r} and is not in the state; under grow-back a "
                              "replacement would start from its own scale and the replicas part: "
                              "pass it too (State(..., scaler=scaler))")

    def persist(self, directory, *, every: int = 1, keep: int = 3) -> bool:
        """Restarts without ULFM (:meth:`hpcasync.runtime.elastic.TorchState.persist`: rank 0
        writes every ``every``-th commit to ``directory``, the newest is loaded now). A parameter
        server's worker asks the server for the checkpoint of its commit instead
        (``hpcasync.save_checkpoint``'s way, its committed values and samplers in its part); the
        server writes θ, the rule and every worker's part once all have asked for that commit or
        finished, and a restart gives each worker its place; shard servers each write their own
        file of a commit, and a restart takes the newest commit every server wrote."""
        return super().persist(directory, every=every, keep=keep)

    def _newest_commit(self, disk):
        ps = self._membership.ps
        if ps is None or not ps.attached or ps.layout.K == 1:
            return super()._newest_commit(disk)
        from .ps.loop_checkpoint import read_sharded

        return read_sharded(ps, disk.directory, self._disk_header())

    def _write_commit(self, disk) -> None:
        ps = self._membership.ps
        if ps is None:
            return super()._write_commit(disk)
        if ps.attached and not ps.is_server and not ps.finished:    # the server writes
            ps.checkpoints.request(disk.directory, epoch=0, step=self._commit_count,
                                   keep=disk.keep, extra={"state": self._place()},
                                   header=self._disk_header())

    def _load_commit(self, path, header: dict, blob) -> bool:
        """The commit (this rank's own, else rank 0's: :meth:`persist`); where rank 0's was
        loaded, DASO inside a cycling epoch then drops the global messages that were in flight,
        as after a reset (they were rank 0's node's: their receives are skipped;
        ``set_topology``, collective). A parameter server's: θ, the rule
        and the server's clock on the server, each worker its part and its committed place (its
        shard is this job's)."""
        m, ps = self._membership, self._membership.ps
        if ps is None:
            super()._load_commit(path, header, blob)
            for opt in self._optimizers():      # (each rank's own commit: nothing to drop)
                if hasattr(opt, "set_topology") and not opt.replicas_equal and not header.get(
                        "own"):
                    opt.set_topology(m.topo, average=False)
            return True
        ps.flat.module.load_state_dict(blob["model"])
        place = ps.checkpoints.restore(blob).get("state")
        if place is not None:       # (saves the state, as a replacement's place does)
            self._take_place({**place, "shards": {}}, ps.steps)
        else:                       # the server, or a worker that had asked for no commit
            self.save()
        self._commit_count = int(blob["step"])
        if m.roles.is_server:
            log.info("elastic: resuming from %s (commit %d)", path, blob["step"])
        return True

    def _disk_header(self) -> dict:
        return {**super()._disk_header(), "algorithm": self._membership.algorithm or "torch"}

    def _place(self) -> dict:
        """What places a PS worker in your loop: the plain values, the samplers' and LR
        schedulers' committed states and the samplers' shards (every other handler starts from
        the server's θ)."""
        return {"values": dict(self._saved_state), "handlers": {
            k: h.saved for k, h in self._handlers.items()
            if isinstance(h.value, (ElasticSampler, torch.optim.lr_scheduler.LRScheduler))},
            "shards": {k: (h.value.rank, h.value.num_replicas) for k, h in self._handlers.items()
                       if isinstance(h.value, ElasticSampler)}}

    def _take_place(self, place: dict, steps: int) -> None:
        """A replacement: the dead worker's last commit the server took (:meth:`_place`)."""
        m = self._membership
        for k, saved in place["handlers"].items():
            self._handlers[k].value.load_state_dict(saved)
        self._saved_state = dict(place["values"])
        self._set_attrs()
        m.ps.steps = steps
        for k, h in self._handlers.items():     # the place's shard (a taken-over server's)
            if isinstance(h.value, ElasticSampler):
                h.value.set_world(*place.get("shards", {}).get(k, (m.roles.shard_index,
                                                           m.roles.num_shards)))
        self.save()

    def restore(self) -> None:
        """The last commit back; a serving parameter server (a shard server that survived
        another's death) keeps what it served: its rule holds every push it answered, and the
        takeover starts from it."""
        ps = self._membership.ps
        if ps is not None and ps.attached and ps.is_server and not ps.closed:
            return _core.ObjectState.restore(self)          # the plain values only
        super().restore()

    # -- the core's hooks ------------------------------------------------------------------------
    def default_bcast_object(self, obj):
        return self._membership.bcast_object(obj)

    def default_rank(self) -> int:
        return self._membership.rank()

    def _size(self) -> int:
        return self._membership.size()

    def _allgather(self, obj) -> list:
        return self._membership.comm.allgather(obj)

    def handler_for(self, value):
        m = self._membership
        if isinstance(value, torch.nn.Module):
            return _core.ModelHandler(value, m.sync_model)
        if isinstance(value, torch.optim.Optimizer):
            return _core.Handler(value, m.sync_optimizer)
        if isinstance(value, ElasticSampler):
            return _core.Handler(value, self._sync_sampler)    # restore keeps rank and size
        if isinstance(value, torch.optim.lr_scheduler.LRScheduler) or (
                isinstance(value, torch.amp.GradScaler) and value.is_enabled()):
            return _core.Handler(value, lambda v: v.load_state_dict(   # (a scaler's scale: alike
                m.bcast_object(v.state_dict() if m.is_root() else None)))   # on every rank)
        return None

    def sync(self) -> None:
        """Rank 0's state (after a reset, the sync root's) on every rank; a parameter server's
        state is each rank's own (the optimizer started every rank from the server's θ; after a
        takeover each worker goes on from its own commit): nothing is sent, unless a rank died
        while it was set up (the reset sets it up again on the survivors)."""
        m = self._membership
        ps = m.ps
        if ps is None:
            super().sync()
        elif m.grown:                   # grown back: the server gives each replacement its place
            m.grown, self.ft.check_pending = False, False       # (each rank's state is its own)
            places = m.comm.bcast(ps.grown_places() if m.roles.is_server else None,
                                  root=m.topo.ps_rank)
            mine = places.get(m.roles.worker_index)     # (a survivor holds no dead place)
            if mine is not None:
                self._take_place(mine["commit"], mine["steps"])
        elif not ps.attached:
            raise ProcessFailedError(f"a rank died while the {ps.algorithm} parameter server was "
                                     "set up")

    def _sync_sampler(self, sampler: ElasticSampler) -> None:
        m = self._membership
        sampler.load_state_dict(m.bcast_object(sampler.state_dict() if m.is_root() else None))
        sampler.set_world(m.roles.shard_index, m.roles.num_shards)

    def _optimizers(self) -> list:
        return [h.value for h in self._handlers.values()
                if isinstance(h.value, torch.optim.Optimizer)
                and (hasattr(h.value, "set_comm") or hasattr(h.value, "set_topology"))]

    def _samplers(self) -> list:
        return [h.value for h in self._handlers.values() if isinstance(h.value, ElasticSampler)]

    # -- the current world -----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._membership.rank()

    @property
    def size(self) -> int:
        return self._membership.size()

    @property
    def roles(self) -> api.Roles:
        return self._membership.roles


def run(func=None, *, grow_back: bool | None = None, max_ranks: int | None = None):
    """The decorator: ``func(state, ...)`` is called after ``state.sync()``; when a rank dies
    (ULFM) every survivor restores the last commit, the world is shrunk and rebuilt, the reset
    callbacks run and ``func`` is called again, until it returns on every survivor. Without ULFM
    errors propagate (a death ends the job with one line).

    ``@run(grow_back=True, max_ranks=N)``: after the shrink, spawn replacements up to N ranks
    (default ``HPCASYNC_GROW_BACK`` / ``HPCASYNC_MAX_RANKS``; N defaults to the starting size);
    module doc."""
    if func is None:
        return functools.partial(run, grow_back=grow_back, max_ranks=max_ranks)

    def tolerance(state):
        if not isinstance(state, State):
            raise ConfigError(f"hpcasync.elastic.run: the first argument must be an "
                              f"hpcasync.elastic.State, got {type(state).__name__}")
        if grow_back is not None or max_ranks is not None:
            state.ft.set_growth(grow_back, max_ranks)
            state._check_growth()
            state._set_ps_growth()
        return state.ft
    return _core.elastic_run(tolerance)(func)


def _release_at_exit() -> None:
    """In a process of a grown job, at exit (after the exit agreement): free the front door's
    communicators, which span the replacements' job, before ``MPI_Finalize``."""
    from . import topology

    topo = topology._DEFAULT
    if topo is not None:
        api.release(api._sync_roles(topo, None), free_world=True)


_core._RELEASE.append(_release_at_exit)
