"""Grow back: after a death, the survivors spawn replacement ranks that join the running job,
so the run returns to full size without a restart (ULFM, Open MPI). The pieces every road shares:
the spawn, the replacement's one entry (:func:`join_world`), the places (:func:`_order`), the
watchdogs; the survivors' side of a synchronous run's grow is
:meth:`hpcasync.runtime.elastic.FaultTolerance.reset` (your own loop, ``hvd.elastic`` and the
CLI's ``ssgd``, ``odsgd``, ``daso`` alike), the parameter server's is :class:`Spawned` +
:func:`connect`.

A reset alone shrinks the world and trains on. With ``--grow-back`` (``--max-ranks N``, default
the starting size; ``HPCASYNC_GROW_BACK`` in your own loop) the survivors then:

1. **spawn** ``N - survivors`` processes running this very command (``MPI_Comm_spawn`` of
   ``sys.executable`` with the interpreter's own arguments, working directory kept) into the
   allocation's free slots (Open MPI: free slots of the job's hosts, or any with
   ``mpirun --oversubscribe``) with :func:`spawn`. The joiner starts like any rank (options, data,
   model checks) and knows it is one (:func:`is_joiner`: ``HPCASYNC_JOINER`` in its environment,
   set through the spawn, and ``OMPI_PARENT_PORT``; :func:`prepare_joiner` drops the
   failure-injection variables, which name the ranks of the first launch);
2. **merge** the intercommunicator (``MPI_Intercomm_merge``) and **order** the merged world
   (``MPI_Comm_split`` by key): when the world returns to the size it had before the death, each
   joiner takes a dead rank's place (its rank, its data shard) and the survivors keep theirs, so
   the run goes on exactly as an undisturbed one would (the same batches on the same ranks, the
   same reduction order); otherwise the survivors keep their order and the joiners come last;
3. **rebuild the topology** on the merged world (:meth:`hpcasync.topology.Topology.build`: nodes
   from shared memory, ``--ranks-per-node`` honoured);
4. the CLI's survivors adopt the recovered position — the epoch's plan kept (same size) or
   re-sharded over the grown world (:class:`~hpcasync.runtime.recovery.EpochCursor`) — and the
   sync root **sends the live state** to the joiners (one broadcast over the grown world):
   model parameters and buffers (BatchNorm), optimizer state and step count, the data cursor
   (epoch, batches done, the epoch's shards), the epoch history, the failure records, the
   divergence guard's reference, torch's RNG state (every rank seeds alike).

Spawn failure (no free slot, a launcher that cannot spawn): every survivor gets the error; the
run goes on shrunk with one warning line (the shrink-only behaviour, as without ``--grow-back``),
unless fewer than ``--min-ranks`` remain, which ends the job with one line
(:class:`~hpcasync.errors.ProcessFailedError`). Open MPI's launcher (prterun 5.0.11) records
the failed spawn and exits with status 213 after every rank finished with 0: the metrics stream
is complete (``summary``), the warning line says so. A joiner that never reaches the merge (it died
while starting) would leave the survivors in ``MPI_Intercomm_merge``: after
``HPCASYNC_JOIN_TIMEOUT`` seconds (default 300) a watchdog ends the job with one line; a death
once the spawn has returned (in the merge) ends it after ``HPCASYNC_JOIN_CONNECT_TIMEOUT``
(default 20 s) at the latest.

Design and measurements: docs/design/growth.md.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Callable

from .. import environ, inject
from ..errors import ConfigError, HpcasyncError
from .logs import setup_logging

log = logging.getLogger("hpcasync")

#: set by Open MPI in a process started by MPI_Comm_spawn (the parent's port)
PARENT_ENV = "OMPI_PARENT_PORT"
#: the mark of a replacement, set in its environment by :func:`spawn` (``PMIX_ENVAR``): ``1``, or
#: ``wait`` when the spawner takes it in later (the PS's :class:`Spawned`); a process spawned by
#: anything else (a user's own MPI program starting hpcasync) is no joiner, and a user's argparse
#: never sees the mark
JOINER_ENV = "HPCASYNC_JOINER"
TIMEOUT_ENV = "HPCASYNC_JOIN_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
#: once the spawn has returned (the joiners are past MPI_Init), the merge or connect takes
#: milliseconds: a death during it (a survivor's, a joiner's) must end the job within 30 s
CONNECT_TIMEOUT_ENV = "HPCASYNC_JOIN_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT_S = 20.0

#: what :func:`join_world` learnt (a replacement): its place, the grown ``world``, ``src`` (the
#: lowest surviving rank, which sends the state), ``pending`` (its front end's first sync to come)
_joined: dict[str, Any] = {}
#: front ends' functions freeing their communicators at exit in a process of a grown job
AT_EXIT: list[Callable[[], None]] = []
_registered: list[bool] = []


#: the key under which a ``state_dict`` keeps what is this rank's own and never the same on
#: every rank (PowerSGD's error memory): :func:`digest` leaves it out
LOCAL_KEY = "rank_local"


class JoinError(HpcasyncError, RuntimeError):
    """A joiner does not hold the survivors' state after the transfer (a bug, never a death)."""


def add_arguments(group) -> None:
    """``--grow-back``, ``--max-ranks``, ``--min-ranks`` (a runtime's argument group)."""
    group.add_argument("--grow-back", action="store_true", default=False,
                       help="under ULFM: after a death, spawn replacement ranks that join the "
                            "running job (up to --max-ranks; the parameter server's algorithms: "
                            "into the dead ranks' places, --ps-ranks 1); without it the run goes "
                            "on with the survivors")
    group.add_argument("--max-ranks", type=int, default=None,
                       help="with --grow-back: grow back to this many ranks (default: the "
                            "starting size)")
    group.add_argument("--min-ranks", type=int, default=None,
                       help="under ULFM: fewer ranks than this (after a death and any "
                            "grow-back) end the job with one line (default 1)")


def validate(cfg) -> None:
    o = cfg.options
    for name in ("max_ranks", "min_ranks"):
        v = o.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
    lo, hi = o.get("min_ranks"), o.get("max_ranks")
    if lo is not None and hi is not None and lo > hi:
        raise ConfigError(f"--min-ranks {lo} is above --max-ranks {hi}")
    if hi is not None and not o.get("grow_back"):
        raise ConfigError("--max-ranks bounds --grow-back: give --grow-back too")
    if o.get("grow_back") and cfg.backend == "horovod":
        raise ConfigError("--grow-back needs --backend mpi (the Horovod backend has no ULFM "
                          "recovery)")


def is_joiner() -> bool:
    """This process was started by a grow-back's :func:`spawn` (Open MPI; no MPI call): the one
    test, for the CLI, ``hpcasync.init`` and ``hvd.init`` alike."""
    return "world" in _joined or (os.environ.get(JOINER_ENV) in ("1", "wait")
                                  and PARENT_ENV in os.environ)


def prepare_joiner() -> None:
    """First thing in a joiner: drop the failure-injection variables, which name ranks of the
    first launch (a joiner inherits the launcher's environment and takes a dead rank's number)."""
    if is_joiner():
        inject.forget_first_launch()


def joined() -> dict | None:
    """What :func:`join_world` learnt (None in a rank of the first launch)."""
    return _joined or None


def spawn(comm, n: int, *, later: bool = False):
    """``MPI_Comm_spawn`` over ``comm`` (root 0) of ``n`` copies of this very command (the
    interpreter's own arguments, this working directory), each marked a joiner (``later``: the
    spawner takes them in later, :class:`Spawned`). Returns ``(intercommunicator, "")``, or
    ``(None, MPI's error string)`` where the spawn failed (on this rank)."""
    from mpi4py import MPI

    info = MPI.Info.Create()
    info.Set("wdir", os.getcwd())
    info.Set("PMIX_ENVAR", f"{JOINER_ENV}={'wait' if later else '1'}")  # Open MPI 5's key
    try:
        return comm.Spawn(sys.executable, args=list(sys.orig_argv[1:]), maxprocs=n, info=info,
                          root=0), ""
    except MPI.Exception as exc:
        return None, exc.Get_error_string()
    finally:
        info.Free()


def join_world():
    """The one entry of a replacement (the CLI's driver, ``hpcasync.init`` and ``hvd.init`` call
    it first): merge with the survivors that spawned it, take the place they give (the message
    ``{"keys", "survivor_keys", "src", ...}`` of :func:`_order`), and return the grown world
    (the same object on a second call). Two ways in: spawned by every survivor (the merge is
    the grown world), or by one rank alone while the others went on (:class:`Spawned`: the
    merge holds that rank and this group; :func:`connect` bridges it to the survivors later)."""
    if "world" in _joined:
        return _joined["world"]
    from ..topology import init_mpi

    inject.forget_first_launch()
    later = os.environ.pop(JOINER_ENV, "1") == "wait"
    MPI = init_mpi()
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise ConfigError(f"{JOINER_ENV} is set but this process has no parent: not started by "
                          "hpcasync's grow-back")
    with _Watchdog("grow-back (this replacement's merge with the survivors)"):
        merged = parent.Merge(high=True)
    with _Watchdog("grow-back (waiting for the survivors to take this replacement in)",
                   connect=not later):      # (the server first stops its workers: ps.growth)
        msg = merged.bcast(None, root=0)
    with _Watchdog("grow-back (this replacement's merge with the survivors)"):
        if msg.get("bridge"):       # spawned by one rank: join the survivors through it
            grown = _bridge_joiner(merged, msg)
            merged.Free()
            merged = grown
            msg = merged.bcast(None, root=0)
        me = merged.Get_rank() - len(msg["survivor_keys"])
        world = merged.Split(0, key=msg["keys"][me])
    merged.Free()
    parent.Free()
    _joined.update(msg, world=world, src=msg.get("src", min(msg["survivor_keys"])), pending=True)
    register_release()
    log.warning("grow-back: joined as rank %d of %d", world.Get_rank(), world.Get_size())
    return world


def register_release() -> None:
    """Once per process of a grown job: run :data:`AT_EXIT` at exit, before ``MPI_Finalize``
    (registered before the exit agreement of the grown world's ``init``, so it runs after it):
    Open MPI 5 can hang in finalize with dynamic communicators left (docs/design/growth.md)."""
    if not _registered:
        _registered.append(True)
        import atexit

        atexit.register(_release_at_exit)


def _release_at_exit() -> None:
    for fn in AT_EXIT:
        try:
            fn()
        except Exception as exc:        # noqa: BLE001 - freeing at exit: never fatal
            log.debug("grow-back: freeing at exit failed: %s", exc)


def _timeout(connect: bool = False) -> float:
    name, default = ((CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_S) if connect
                     else (TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    return environ.seconds(name, default)


class _Watchdog:
    """End the job with one line when a join does not complete in time. ``connect``: a step
    after the spawn returned — a merge, a connect, the order's broadcast —, which a death (of a
    survivor or a joiner) would otherwise leave waiting for good: ``HPCASYNC_JOIN_CONNECT_TIMEOUT``
    (default 20 s); else a wait that includes a joiner's start-up (``HPCASYNC_JOIN_TIMEOUT``,
    default 300 s)."""

    def __init__(self, what: str, *, connect: bool = True):
        self.limit = _timeout(connect)
        self.env = CONNECT_TIMEOUT_ENV if connect else TIMEOUT_ENV
        self.timer = threading.Timer(self.limit, self._fire, args=(what,))
        self.timer.daemon = True

    def _fire(self, what: str) -> None:
        sys.stderr.write(f"hpcasync: error: {what} did not complete in {self.limit:g} s "
                         f"({self.env}); ending the job\n")
        sys.stderr.flush()
        os._exit(1)

    def __enter__(self):
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.cancel()


def _order(size_before: int, kept: list[int], survivors: int,
           joiners: int) -> tuple[list, list, bool]:
    """Split keys ``(survivors', joiners', same)``: the dead ranks' places when the world returns
    to its size before the death (``same``), else the survivors first, in order."""
    if survivors + joiners == size_before and len(kept) == survivors:
        return list(kept), sorted(set(range(size_before)) - set(kept)), True
    return list(range(survivors)), list(range(survivors, survivors + joiners)), False


def _topology(world, cfg, ps_rank: int = 0):
    from ..topology import Topology

    return Topology.build(world, ranks_per_node=cfg.ranks_per_node, device=cfg.device,
                          ps_rank=ps_rank)


# -- replacements spawned by one rank while the others go on (the parameter server) ----------------

class Spawned:
    """Replacements spawned by one rank alone (``MPI_Comm_spawn`` over ``MPI_COMM_SELF``) while
    the other ranks go on working; they join the survivors' world later, in one collective
    (:func:`connect`). The parameter server's grow-back (:mod:`hpcasync.ps.growth`): its workers
    are asynchronous, so a spawn by every survivor would first stop them all for the joiner's
    whole start-up (seconds); here they train on while it starts, and a spawn that fails is known
    before anything was stopped.

    Attributes: ``groups`` (per spawn: the merged communicator of this rank (rank 0) and the
    group, its size, the seconds the spawn took), ``count`` (processes spawned so far)."""

    def __init__(self):
        self.groups: list[tuple[Any, int, float]] = []

    @property
    def count(self) -> int:
        return sum(n for _, n, _ in self.groups)

    def spawn(self, n: int) -> str | None:
        """Spawn ``n`` copies of this command (the joiner flag added) and merge with them; the
        MPI error string if the spawn failed (nothing spawned), else None."""
        from mpi4py import MPI

        t0 = time.perf_counter()
        inter, error = spawn(MPI.COMM_SELF, n, later=True)
        if inter is None:
            return error
        with _Watchdog(f"grow-back (waiting for {n} spawned rank(s) to start)"):
            merged = inter.Merge(high=False)
        inter.Free()
        self.groups.append((merged, n, time.perf_counter() - t0))
        return None

    def take(self) -> list[tuple[Any, int, float]]:
        """The groups spawned so far, handed to :func:`connect` (forgotten here)."""
        groups, self.groups = self.groups, []
        return groups


def connect(world, spawner: int, groups: list | None, msg: dict):
    """Collective over the survivors ``world`` and every process of ``groups`` (significant on
    rank ``spawner`` of ``world`` only: :meth:`Spawned.take`): merge the groups into the world
    one by one — each group gets a port of its own through its merged communicator with the
    spawner, connects (``MPI_Comm_connect``) while the world accepts (``MPI_Comm_accept``), and
    the two merge (``MPI_Intercomm_merge``) —, then order it as ``msg`` says (the place message
    ``{"keys", "survivor_keys", ...}`` of :func:`_order`, rank 0 of ``world``'s; every joiner
    gets it) and split. Returns the grown world
    (:meth:`~hpcasync.runtime.elastic.FaultTolerance.grow`).

    (Not ``MPI_Intercomm_create`` through the spawner: with Open MPI 5.0.11 a rank of the world
    and a joiner that never met hang in their first message; connect/accept wires every pair.
    Design: docs/design/growth.md#the-parameter-server, "Why connect/accept".)"""
    from mpi4py import MPI

    me = world.Get_rank()
    sizes = world.bcast([n for _, n, _ in groups] if me == spawner else None, root=spawner)
    ports = [MPI.Open_port() for _ in sizes] if me == spawner else [""] * len(sizes)
    if me == spawner:               # tell each group where it stands (it waits in a bcast)
        for i, (sj, _, _) in enumerate(groups):
            sj.bcast({"bridge": True, "port": ports[i], "index": i, "groups": len(sizes),
                      "leader": spawner}, root=0)
    grown = world
    with _Watchdog(f"grow-back (merging {sum(sizes)} spawned rank(s))"):
        for i in range(len(sizes)):
            inter = grown.Accept(ports[i], root=spawner)
            merged = inter.Merge(high=False)
            inter.Free()
            if grown is not world:
                grown.Free()
            grown = merged
    if me == spawner:
        for sj, _, _ in groups:
            sj.Free()
        for port in ports:
            MPI.Close_port(port)
    msg = grown.bcast(msg if me == 0 else None, root=0)
    new = grown.Split(0, key=msg["survivor_keys"][me])
    if grown is not world:
        grown.Free()
    return new


def _bridge_joiner(sj, msg: dict):
    """The joiner's side of :func:`connect`: connect its group to the survivors' world through
    its port, merge, then take part in the merges of the groups spawned after it. Returns the
    merged world (before the split)."""
    from mpi4py import MPI

    index, n, leader = msg["index"], msg["groups"], msg["leader"]
    try:
        inter = MPI.COMM_WORLD.Connect(msg["port"], root=0)
    except MPI.Exception as exc:    # (a survivor died before its accept)
        raise JoinError(f"grow-back: this replacement could not connect to the survivors "
                        f"({exc.Get_error_string()}): one of them died during the grow") from None
    grown = inter.Merge(high=True)
    inter.Free()
    for _ in range(index + 1, n):
        inter = grown.Accept("", root=leader)
        merged = inter.Merge(high=False)
        inter.Free()
        grown.Free()
        grown = merged
    return grown


def receive(ctx) -> dict:
    """The replacement's side of step 4: the live state from the sync root (the broadcast of
    :meth:`~.recovery.SyncWorld.settle`). Collective over the grown world."""
    from ..comm.objects import bcast_object

    blob = bcast_object(ctx.topo.world, None, _joined["src"])
    log.warning("grow-back: rank %d took the live state at %s", ctx.topo.rank,
                tuple(blob["record"]["position"]))
    return blob


def live_state(ctx, cur, ft, snapshot: dict) -> dict:
    """What a replacement gets from a survivor of a synchronous run (:class:`~.recovery.SyncWorld`'s
    ``payload``): ``snapshot`` (the runtime's model and optimizer state, as in its checkpoints),
    the data cursor ``cur`` (:class:`~hpcasync.runtime.recovery.EpochCursor`, after the adopt:
    the epoch's shards included), the epoch history, step count, divergence reference, torch's RNG
    state and the failure and join records of ``ft`` (the :class:`~.elastic.FaultTolerance`)."""
    import torch

    plan = cur.plan
    return {"state": snapshot,
            "cursor": {"epoch": cur.epoch, "done": cur.done, "started": cur.started,
                       "loss_sum": cur.loss_sum, "loss_n": cur.loss_n,
                       "shards": None if plan is None else plan.shards, "moved": cur.moved},
            "history": list(ctx.history), "steps": ctx.steps,
            "divergence": ctx.divergence.state_dict(), "rng": torch.get_rng_state(),
            "failures": ft.failures, "joins": ft.joins,
            "clocks": (ctx.t0, ctx.metrics.t0)}   # the run's start: records' times agree


def digest(x) -> str:
    """SHA-256 of ``x``: tensors as their bytes (any dtype: bfloat16 has no numpy type), dicts
    by sorted key (a rank's own part, under :data:`LOCAL_KEY`, left out), lists and tuples in
    order, other leaves by ``repr``. A list of tensors hashes as their bytes back to back."""
    import hashlib

    import torch

    h = hashlib.sha256()

    def walk(x):
        if isinstance(x, torch.Tensor):
            h.update(x.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=repr):
                if k != LOCAL_KEY:
                    h.update(repr(k).encode())
                    walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(x)
    return h.hexdigest()


def agree(world, mine, ref: int) -> None:
    """After a state transfer to a replacement (the CLI's live state, your own loop's first
    sync), every rank of the grown world compares ``mine`` (a :func:`digest`, or the CLI's
    ``(position, steps, digest)``) with rank ``ref``'s (one allgather): a replacement that got or
    loaded less than the survivors hold ends the job with one line on every rank instead of
    training on something else (or waiting in a collective the others never call)."""
    every = world.allgather(mine)
    bad = [r for r, x in enumerate(every) if x != every[ref]]
    if bad:
        got, want = every[bad[0]], every[ref]
        detail = "" if isinstance(want, str) else (
            f": position and steps {got[:-1]} against {want[:-1]}, state "
            f"{'equal' if got[-1] == want[-1] else 'different'}")
        raise JoinError(f"grow-back: rank(s) {', '.join(map(str, bad))} of the grown world do "
                        f"not hold the state of rank {ref} (a survivor) after the join{detail}")


def take_live_state(blob: dict, ctx, cur, ft, check: Callable[[], Any]) -> None:
    """The replacement's side of :func:`live_state` (the runtime loads ``blob["state"]``
    itself, as a resumed checkpoint), then :func:`agree` on ``check()``."""
    import torch

    from ..data import EpochShards

    c = blob["cursor"]
    cur.epoch, cur.done, cur.started = c["epoch"], c["done"], c["started"]
    cur.loss_sum, cur.loss_n = c["loss_sum"], c["loss_n"]
    cur.plan, cur.moved = None, c["moved"]
    if c["shards"] is not None:
        cur.plan = EpochShards.__new__(EpochShards)
        cur.plan.shards = c["shards"]
    ctx.history[:] = blob["history"]
    ctx.steps = blob["steps"]
    ctx.t0, ctx.metrics.t0 = blob["clocks"]
    ctx.divergence.load_state_dict(blob["divergence"])
    torch.set_rng_state(blob["rng"])
    ft.failures, ft.joins = list(blob["failures"]), list(blob["joins"])
    if ft.failures and ft.failures[-1].get("next_step_s") is None:
        ft._pending_next_step = ft.failures[-1]      # timed by the first step, as elsewhere
    if ctx.topo.rank == 0:              # the writer of the metrics stream and the log is rank 0
        ctx.metrics.reopen_append()
        setup_logging(0, report_rank=0)
    agree(ctx.topo.world, check(), _joined["src"])


def release(topo) -> None:
    """At the end of a run that grew (either side): free the world's communicators, collectively
    over the final world (after ``topo.free()``). ``MPI_Finalize`` disconnects every dynamic
    communicator (one spanning spawned jobs) still allocated, a handshake with each member; a
    survivor whose older communicators hold dead ranks leaves that handshake early, and a joiner
    then waits in ``MPI_Finalize`` for good (Open MPI 5.0.11). Freeing the final world is enough
    (figures: docs/design/growth.md, "Feasibility and a finalize hang")."""
    if not _joined:
        return
    for comm in (topo.world,):
        try:
            comm.Free()
        except Exception:   # noqa: BLE001 - already freed
            pass
