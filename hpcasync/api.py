"""The front door: every algorithm in a user's own loop, through ``import hpcasync``.

Example::

    import hpcasync, torch, torch.nn.functional as F

    ctx = hpcasync.init("ssgd")                    # MPI, roles, device, threads, fail-fast errors
    model = Net().to(ctx.device)
    opt = hpcasync.optimizer("ssgd", model, torch.optim.SGD(model.parameters(), lr=0.05))
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)       # it is a torch Optimizer
    for epoch in range(epochs):
        for x, y in loader:                        # shard with ctx.shard_index / ctx.num_shards
            opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
        sched.step()
        hpcasync.save_checkpoint("ckpt", model, opt, epoch=epoch)

Design: docs/design/front-door.md#front-door (which object each algorithm gives, passing a
``torch.optim.SGD`` to an algorithm that owns its update, fail-fast errors).
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import registry
from .environ import check as check_environ, seconds
from .errors import ConfigError
from .rules import MOMENTUM_RULES

log = logging.getLogger("hpcasync")

#: live views of :mod:`hpcasync.registry` (a registered algorithm shows in them)
SYNC_ALGORITHMS = registry.LiveNames(registry.sync_names)
PS_ALGORITHMS = registry.LiveNames(registry.ps_names)       # the parameter-server rules


def algorithms() -> tuple[str, ...]:
    """The algorithm names: the 14 of :mod:`hpcasync.registry` (plus any registered)."""
    return registry.names()




@dataclass(frozen=True)
class Roles:
    """What this rank is in the job (:func:`init`)."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    node: int
    num_nodes: int
    device: str                 # "cpu" or "cuda:<local rank>"
    algorithm: str | None
    ps_rank: int
    is_server: bool             # this rank serves a parameter-server algorithm
    worker_index: int | None    # PS algorithms: 0..num_workers-1 on workers, None on the server
    num_workers: int            # ranks that train
    topology: Any               # hpcasync.topology.Topology (communicators)
    #: an mpi4py communicator of the ranks that train (the world for the synchronous algorithms;
    #: the workers of a PS algorithm, None on its servers): metrics averaged over the workers
    #: while the server is inside ``serve()`` (a world allreduce would wait for it forever)
    workers_comm: Any = None

    @property
    def is_worker(self) -> bool:
        return not self.is_server

    @property
    def shard_index(self) -> int:
        """The data shard this rank trains (e.g. ``DistributedSampler(rank=...)``)."""
        return self.rank if self.worker_index is None else self.worker_index

    @property
    def num_shards(self) -> int:
        return self.num_workers

    @property
    def is_root(self) -> bool:
        """The rank that should print and write files: rank 0, or the server of a PS job."""
        return self.rank == (self.ps_rank if self.algorithm in PS_ALGORITHMS else 0)


#: the options of the first :func:`init` of this process (an elastic grow-back repeats them)
INIT_OPTIONS: dict[str, Any] = {}


def init(algorithm: str | None = None, *, ranks_per_node: int | None = None,
         device: str = "auto", ps_rank: int = 0, threads: int | None = None,
         seed: int | None = None, fail_fast: bool = True, verbose: bool = False,
         ps_ranks: int = 1, comm=None) -> Roles:
    """Start MPI (if needed) and say what this rank is.

    Args:
        algorithm: the algorithm you will run (decides the PS roles; None: every rank trains).
        ranks_per_node: group the ranks of each machine into virtual nodes (DASO on one box).
        device: ``"auto"`` (local rank r -> ``cuda:r`` when CUDA is there, else CPU), ``"cpu"``,
            ``"cuda"``. Move your model to ``ctx.device`` before building the optimizer.
        ps_rank: the server's rank for PS algorithms (0).
        ps_ranks: K server ranks (``ps_rank`` and the K - 1 after it), each serving a shard of θ;
            ``is_server`` is true on all K (``ParameterServer`` takes K from here by default).
        threads: torch threads per rank (default: the cores of this process / ranks per node).
        seed: seed Python, numpy and torch identically on every rank.
        fail_fast: install the exception hook that ends the job on any rank's error
            (docs/design/front-door.md#front-door).
        comm: the intracommunicator the job runs on (default ``COMM_WORLD``); only its ranks call
            ``init``, and ranks, sizes and roles count inside it. In a replacement spawned by an
            elastic grow-back (:mod:`hpcasync.elastic`) the default is the grown world.
    """
    from .topology import Topology, set_default_topology

    if algorithm is not None and algorithm not in algorithms():
        raise ConfigError(f"unknown algorithm {algorithm!r} (choose from {', '.join(algorithms())})")
    if algorithm is not None and algorithm not in PS_ALGORITHMS and (ps_rank, ps_ranks) != (0, 1):
        raise ConfigError(f"ps_rank= and ps_ranks= place a parameter server; {algorithm} has none "
                          "(leave them out)")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ConfigError(f"threads must be an integer >= 1 (None: the cores of this process / "
                          f"ranks per node), got {threads!r}")
    check_environ()                 # a bad value: one line now, not inside a later wait
    if not INIT_OPTIONS:            # the first call's: an elastic grow-back repeats it
        INIT_OPTIONS.update(ranks_per_node=ranks_per_node, device=device, ps_rank=ps_rank,
                            fail_fast=fail_fast, ps_ranks=ps_ranks)
    if comm is None:
        from .runtime import join

        if join.is_joiner():        # a replacement spawned by a grow-back
            comm = join.join_world()
            ps_rank = join.joined().get("ps_rank", ps_rank)     # (a PS: where the server is)
    if fail_fast:
        install_fail_fast()
    from .supervisor import announce

    announce()                  # under `hpcasync launch`: this rank's pid, for its lines
    topo = Topology.build(comm, ranks_per_node=ranks_per_node, device=device, ps_rank=ps_rank)
    set_default_topology(topo)
    if fail_fast and topo.size > 1:
        _register_exit_agreement(topo.world)
    ps = algorithm in PS_ALGORITHMS
    if ps and topo.size < 2:
        raise ConfigError(f"{algorithm} needs a parameter server and at least one worker: start 2 "
                          "or more ranks (mpiexec -n 2 ...)")
    if ps:
        from .ps.shards import check_shards

        check_shards(ps_ranks, topo.size)
    topo = dataclasses.replace(topo, ps_ranks=ps_ranks if ps else 1)   # ParameterServer's default
    set_default_topology(topo)
    report = ps_rank if ps else 0
    logging.basicConfig(level=(logging.DEBUG if verbose else logging.INFO) if topo.rank == report
                        else logging.WARNING, stream=sys.stderr,
                        format=f"[%(asctime)s r{topo.rank}] %(message)s", datefmt="%H:%M:%S")
    if topo.rank == report:
        from .environ import say_unknown

        say_unknown()               # a misspelt HPCASYNC_* variable (read by nothing)
    if threads is None:
        threads = max(1, len(os.sched_getaffinity(0)) // topo.local_size)
    torch.set_num_threads(threads)
    if seed is not None:
        from .runtime.context import seed_everything

        seed_everything(seed)
    return roles_on(topo, algorithm)


def _workers_comm(world, serves: bool):
    """Collective over ``world``: a communicator of the training ranks (None on a server)."""
    from mpi4py import MPI

    comm = world.Split(MPI.UNDEFINED if serves else 0, world.Get_rank())
    return None if comm == MPI.COMM_NULL else comm


def average_metric(value, roles: Roles):
    """The mean of ``value`` (a number or tensor) over the ranks that train: an allreduce on
    ``roles.workers_comm``, so a PS job's workers average their metrics (e.g. each one's share of
    the test set) while the server serves. Collective over the workers; the server has no
    metric of its own to give (ConfigError there)."""
    comm = roles.workers_comm
    if _replaced(roles.topology):
        raise ConfigError(f"hpcasync.average_metric: these roles are of the world of "
                          f"{roles.size} ranks before a reset (hpcasync.init's ctx, which holds "
                          "the dead rank); inside @hpcasync.elastic.run pass state.roles")
    if comm is None:
        raise ConfigError(f"rank {roles.rank} is a parameter server: it does not train, so it "
                          "takes no part in average_metric (call it on the workers: "
                          "ctx.is_worker), or average over ctx.topology.world after finish()")
    _all_arrive(comm, "hpcasync.average_metric")      # (`if rank == 0: print(average_...)`)
    n = comm.Get_size()
    if torch.is_tensor(value):
        flat = value.detach().to("cpu", torch.float64).clone()
        from mpi4py import MPI

        comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
        return (flat / n).to(value.dtype).to(value.device)
    return comm.allreduce(float(value)) / n


def install_fail_fast() -> None:
    """Make an uncaught exception on any rank end the whole job: its message (one line for an
    hpcasync error, else the traceback) on stderr, then ``MPI_Abort``."""
    from .errors import fail_fast

    previous = sys.excepthook
    if getattr(previous, "_hpcasync", False):
        return

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            fail_fast(exc, code=130)
        fail_fast(exc)

    hook._hpcasync = True
    sys.excepthook = hook


#: seconds a rank waits at interpreter exit for the others (HPCASYNC_EXIT_TIMEOUT)
EXIT_TIMEOUT_S = 30.0


#: the exit agreements :func:`init` registered, by ``id`` of the topology's world: (hook, comm)
_EXIT_HOOKS: dict[int, tuple] = {}


def _register_exit_agreement(world) -> None:
    limit = seconds("HPCASYNC_EXIT_TIMEOUT", EXIT_TIMEOUT_S)     # (a bad value: said at init)
    comm = world.Dup()
    hook = functools.partial(_agree_at_exit, comm, limit)
    atexit.register(hook)
    _EXIT_HOOKS[id(world)] = (hook, comm)


def release(roles: Roles, *, free_world: bool) -> None:
    """Undo what :func:`init` built for ``roles``: its exit agreement and the communicators of
    its topology (node-local, global, the workers'; the world itself when ``free_world``: a
    communicator ``init(comm=...)`` was given a duplicate of). Local, no communication
    (``MPI_Comm_free``), so it also serves after a death, on communicators that hold dead ranks
    (``hvd.shutdown`` after ``hvd.init(comm=...)``, an elastic reset). The default topology is
    forgotten when it is this one."""
    from . import topology as _topology

    topo = roles.topology
    hook = _EXIT_HOOKS.pop(id(topo.world), None)
    if hook is not None:
        atexit.unregister(hook[0])
        _free(hook[1])
    if roles.workers_comm is not None and roles.workers_comm is not topo.world:
        _free(roles.workers_comm)
    topo.free()
    if free_world:
        _free(topo.world)
    _topology.forget_default_topology(topo)


def reinit_on_survivors(world, *, free_old: bool, algorithm: str | None = None,
                        ps_rank: int | None = None) -> Roles:
    """The front door re-initialised on ``world``, the survivors of the current topology's
    world after a death (``MPI_Comm_shrink``; collective over ``world``): the old topology's
    exit agreement and communicators are released locally (:func:`release`; its world too when
    ``free_old``), the survivors' topology (:meth:`~hpcasync.topology.Topology.shrunk`: each
    survivor stays on its node) becomes the default and gets the exit agreement if the old one
    had it; ``ps_rank``: the server's rank in ``world`` (default: the old one's, where it
    survived). Returns the survivors' :class:`Roles` (:func:`roles_on`).
    Used by :mod:`hpcasync.elastic`."""
    from .topology import default_topology, set_default_topology

    old = default_topology()
    mark_replaced(old)
    had_exit_agreement = id(old.world) in _EXIT_HOOKS
    topo = old.shrunk(world)
    if ps_rank is not None:                 # a parameter server's takeover: the new server
        topo = dataclasses.replace(topo, ps_rank=ps_rank)
    release(_sync_roles(old, algorithm), free_world=free_old)
    set_default_topology(topo)
    if had_exit_agreement and topo.size > 1:
        _register_exit_agreement(topo.world)
    return roles_on(topo, algorithm)


#: the topologies a reset or a grow replaced (id -> weak reference): roles of theirs are stale
_REPLACED: dict = {}


def mark_replaced(topo) -> None:
    """``topo`` is the world before a reset or a grow: :func:`average_metric` refuses its roles."""
    import weakref

    _REPLACED[id(topo)] = weakref.ref(topo)


def _replaced(topo) -> bool:
    ref = _REPLACED.get(id(topo)) if topo is not None else None
    return ref is not None and ref() is topo


def roles_on(topo, algorithm: str | None, *, split: bool = True) -> Roles:
    """This rank's :class:`Roles` on ``topo`` for ``algorithm``: a parameter-server algorithm's
    server and worker numbers from ``topo.servers``, with a communicator of its workers (a
    ``Split``: collective over ``topo.world``; ``split=False``: None); every rank trains
    otherwise (no communication)."""
    if algorithm not in PS_ALGORITHMS:
        return _sync_roles(topo, algorithm)
    servers = topo.servers
    workers = [r for r in range(topo.size) if r not in servers]
    serves = topo.rank in servers
    return dataclasses.replace(
        _sync_roles(topo, algorithm), is_server=serves,
        worker_index=None if serves else workers.index(topo.rank), num_workers=len(workers),
        workers_comm=_workers_comm(topo.world, serves) if split else None)


def _sync_roles(topo, algorithm: str | None) -> Roles:
    return Roles(rank=topo.rank, size=topo.size, local_rank=topo.local_rank,
                 local_size=topo.local_size, node=topo.node, num_nodes=topo.num_nodes,
                 device=topo.device, algorithm=algorithm, ps_rank=topo.ps_rank, is_server=False,
                 worker_index=topo.rank, num_workers=topo.size, topology=topo,
                 workers_comm=topo.world)


def _free(comm) -> None:
    try:
        comm.Free()
    except Exception:  # noqa: BLE001 - already freed, or MPI finalised
        pass


def _poll(done, limit: float) -> bool:
    """Call ``done()`` with growing pauses between calls (0.1 ms up to 10 ms) until it returns
    True (then True) or ``limit`` seconds have passed (then False): a wait on nonblocking MPI
    requests that can end, where a blocking one would wait forever."""
    import time

    t0, pause = time.monotonic(), 1e-4
    while not done():
        if time.monotonic() - t0 > limit:
            return False
        time.sleep(pause)
        pause = min(0.01, pause * 2)
    return True


def _agree_at_exit(comm, limit: float) -> None:
    """At interpreter exit (after the algorithms' own exit hooks): every rank joins a nonblocking
    barrier. A rank that waits longer than ``HPCASYNC_EXIT_TIMEOUT`` seconds (30) ends the job
    saying why: another rank is still inside a collective, most often because the ranks took
    different numbers of steps (uneven data shards), which would otherwise hang forever."""
    from .errors import HpcasyncError, fail_fast

    if not _poll(comm.Ibarrier().Test, limit):
        fail_fast(HpcasyncError(
            f"rank {comm.Get_rank()} ended its script but other ranks have not after "
            f"{limit:g} s: they are most likely waiting in a collective that this rank no "
            "longer joins. Give every rank the same number of steps (e.g. drop_last=True, or "
            "the same number of batches per shard); HPCASYNC_EXIT_TIMEOUT sets this wait"))
    comm.Free()


#: seconds rank 0 waits for every rank's call of a collective entry point such as
#: :func:`save_checkpoint` (HPCASYNC_ARRIVAL_TIMEOUT)
ARRIVAL_TIMEOUT_S = 60.0
_ARRIVAL_TAG = 7371


def _all_arrive(comm, what: str) -> None:
    """Before the collectives of ``what`` (called on every rank: ``save_checkpoint``,
    ``average_metric``, ``load_checkpoint(..., comm=)``): each rank tells rank 0 it is there (a
    message with a tag of its own, apart from the collectives' traffic) and waits for rank 0's
    answer. A call made on rank 0 alone (torch's habit ``if rank == 0: save``) would
    otherwise wait forever in a collective the others never join while they wait in the next
    step's: rank 0 ends the job in one line once ``HPCASYNC_ARRIVAL_TIMEOUT`` seconds (60) pass
    without every rank's call; a rank whose call rank 0 does not answer in that time (rank 0
    never called, or answers nobody since another rank did not) ends it too."""
    from .errors import HpcasyncError

    me, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return
    limit = seconds("HPCASYNC_ARRIVAL_TIMEOUT", ARRIVAL_TIMEOUT_S)
    if me != 0:
        comm.send(None, dest=0, tag=_ARRIVAL_TAG)
        answer = comm.irecv(source=0, tag=_ARRIVAL_TAG)
        # (longer than rank 0's wait: where rank 0 called, its line, naming who did not, is first)
        if not _poll(lambda: answer.test()[0], limit + 5):
            answer.Cancel()
            answer.Wait()
            raise HpcasyncError(
                f"{what} is called on every rank, and rank 0 did not answer rank {me}'s call "
                f"within {limit + 5:g} s (rank 0 did not call it, or not all the others did: a "
                "call under `if rank != 0`?); HPCASYNC_ARRIVAL_TIMEOUT sets this wait")
        return
    reqs = {r: comm.irecv(source=r, tag=_ARRIVAL_TAG) for r in range(1, size)}

    def arrived() -> bool:
        for r in [r for r, q in reqs.items() if q.test()[0]]:
            del reqs[r]
        return not reqs

    if not _poll(arrived, limit):
        for q in reqs.values():             # (the job ends; a caller that goes on posts anew)
            q.Cancel()
            q.Wait()
        raise HpcasyncError(
            f"{what} is called on every rank, and rank(s) {', '.join(map(str, reqs))} did not "
            f"call it within {limit:g} s of rank 0's call (a call under `if rank == 0`? every "
            "rank must call it); HPCASYNC_ARRIVAL_TIMEOUT sets this wait")
    for r in range(1, size):
        comm.send(None, dest=r, tag=_ARRIVAL_TAG)


# -- one optimizer-shaped object per algorithm ------------------------------------------------------

def optimizer(algorithm: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
              **hyper: Any):
    """The optimizer-shaped object of ``algorithm`` over ``model`` (docs/design/front-door.md).

    It is a ``torch.optim.Optimizer``: LR schedulers, ``state_dict``/``load_state_dict`` and
    ``zero_grad`` work on it. Collective: call it on every rank. Initial parameters are made equal
    on every rank (rank 0's; the server's for PS algorithms).
    """
    if algorithm not in algorithms():
        raise ConfigError(f"unknown algorithm {algorithm!r} (choose from {', '.join(algorithms())})")
    family = registry.get(algorithm).family            # the package that runs it
    if family in ("daso", "odsgd", "ps"):               # the run's length, by the names you pass
        from .config import _positive

        for name in ("epochs", "steps_per_epoch"):
            if hyper.get(name) is not None:
                _positive(f"{algorithm}: {name}", hyper[name])
    if registry.get(algorithm).user_optimizer:          # ssgd, daso
        if optimizer is None:
            raise ConfigError(f"{algorithm} runs your torch optimizer: "
                              f"hpcasync.optimizer({algorithm!r}, model, torch.optim.SGD(...))")
        return _sync_optimizer(algorithm, family, model, optimizer, hyper)
    hyper = _share_torch_optimizer(algorithm, optimizer, hyper)
    if "lr" not in hyper:
        raise ConfigError(f"{algorithm} needs a learning rate: pass lr=... (or a torch.optim.SGD)")
    if family == "odsgd":
        from .odsgd.optimizer import ODSGD

        _check_keywords(algorithm, ODSGD, hyper)
        return ODSGD(model, **hyper)
    from .ps.optimizer import ParameterServer

    return ParameterServer(model, algorithm, **hyper)


def _sync_optimizer(algorithm, family, model, opt, hyper):
    broadcast = hyper.pop("broadcast", True)
    if family == "ssgd":
        from .ssgd import optimizer_class

        cls = optimizer_class(algorithm)
        _check_keywords(algorithm, cls, hyper)
        result = cls(opt, model, **hyper)
    else:
        from .daso.optimizer import DASO

        missing = [k for k in ("epochs", "steps_per_epoch") if k not in hyper]
        if "sampler" in hyper and missing == ["steps_per_epoch"]:
            missing = []                # an ElasticSampler counts each epoch's batches
        if missing:
            raise ConfigError(f"daso schedules its phases by epoch: pass "
                              f"{' and '.join(f'{k}=...' for k in missing)} (steps_per_epoch: "
                              "batches per rank and epoch, e.g. len(loader); or sampler=your "
                              "hpcasync.elastic.ElasticSampler)")
        hyper["total_epochs"] = hyper.pop("epochs")
        if "steps_per_epoch" in hyper:
            hyper["batches_per_epoch"] = hyper.pop("steps_per_epoch")
        _check_keywords(algorithm, DASO, hyper, names={"total_epochs": "epochs",
                                                       "batches_per_epoch": "steps_per_epoch"})
        result = DASO(opt, model, **hyper)
    if broadcast:
        try:
            result.broadcast_parameters(root=0)
        except Exception as exc:     # noqa: BLE001 - ULFM: a rank died before the loop began
            from .runtime.elastic import defer_startup_failure

            if not defer_startup_failure(exc, [result.comm]):
                raise
    return result


def _check_keywords(algorithm: str, cls, hyper: dict, names: dict | None = None) -> None:
    """A keyword ``cls`` does not take is a one-line error naming the ones it does (``names``:
    a constructor's keyword -> the name users pass)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    known = [(names or {}).get(n, n) for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    bad = sorted(set(hyper) - set(params))
    if bad:
        raise ConfigError(f"{algorithm} takes no {', '.join(bad)} (its keywords: "
                          f"{', '.join(known)})")


#: the keys of a torch SGD's param groups that an algorithm owning its update reads at each step
_SHARED_KEYS = {"odsgd": ("lr", "momentum", "weight_decay"), "ps": ("lr", "weight_decay")}


def _share_torch_optimizer(algorithm: str, opt, hyper: dict[str, Any]) -> dict[str, Any]:
    """The keywords of an algorithm that owns its update (odsgd, the PS rules) given a torch SGD:
    it shares the SGD's param groups (``optimizer=``; one truth for lr, weight decay and, where
    it is the algorithm's, momentum: a scheduler or a hand-written warm-up on either object is
    honoured), group 0's values as the defaults. A keyword given beside the SGD (``lr=0.1``)
    is written into the groups that hold group 0's value, so both objects say the same."""
    if opt is None:
        return dict(hyper)
    found = _from_torch_optimizer(algorithm, opt)
    keys = _SHARED_KEYS["odsgd" if registry.get(algorithm).family == "odsgd" else "ps"]
    if algorithm in MOMENTUM_RULES:
        keys += ("momentum",)
    first = dict(opt.param_groups[0])
    for key in keys:
        if key in hyper and hyper[key] != first[key]:
            for g in opt.param_groups:
                if g[key] == first[key]:
                    g[key] = hyper[key]
            log.info("%s: %s=%g given beside the SGD is written into its param groups",
                     algorithm, key, hyper[key])
            found[key] = hyper[key]
    return {**found, **hyper, "optimizer": opt}


def _from_torch_optimizer(algorithm: str, opt) -> dict[str, Any]:
    """lr, weight decay and (where momentum is the algorithm's) momentum of a torch SGD's group 0
    (the defaults of an algorithm that shares the SGD's groups), after checking that the SGD asks
    for nothing the algorithm would do differently."""
    if type(opt) is not torch.optim.SGD:
        raise ConfigError(f"{algorithm} runs its own update: pass lr=... and its hyperparameters, "
                          f"or a torch.optim.SGD to take them from (got {type(opt).__name__})")
    if registry.get(algorithm).family == "odsgd":   # every group's lr, momentum, weight decay
        from .odsgd.optimizer import hyper_from_sgd

        return hyper_from_sgd(opt)
    from .optim import refuse_sgd_options

    refuse_sgd_options(opt.param_groups, (("maximize", False),) + (
        (("nesterov", False), ("dampening", 0)) if algorithm in MOMENTUM_RULES else ()),
        f"{algorithm} runs its own update")
    group = opt.param_groups[0]
    out = {"lr": group["lr"], "weight_decay": group["weight_decay"]}
    if algorithm in MOMENTUM_RULES:
        moms = sorted({g["momentum"] for g in opt.param_groups})
        if len(moms) > 1:
            raise ConfigError(f"{algorithm} has one momentum for all param groups; the SGD's "
                              f"groups have {moms}")
        out["momentum"] = group["momentum"]
    elif group["momentum"]:
        log.info("%s: the SGD's momentum %g is not used (the server's shared momentum of %s is "
                 "the hyperparameter momentum=..., default 0)", algorithm, group["momentum"],
                 algorithm)
    return out


# -- checkpoints, metrics, divergence: the CLI's own code, one call each -----------------------------

def save_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, optimizer, *,
                    epoch: int, step: int = 0, keep: int = 3, **extra: Any) -> Path | None:
    """Write an atomic, checksummed checkpoint of ``model`` and ``optimizer`` (plus ``extra``) to
    ``directory`` (the CLI's format; the newest ``keep`` are kept). Call it on every rank.

    Synchronous algorithms: rank 0 writes, then every rank waits for the file; what each rank
    holds of its own (local SGD, SlowMo and DiLoCo: the optimizer's state, and between two
    averages the replica; PowerSGD: the error memory) is gathered into it, and
    :func:`load_checkpoint` gives each rank its own back (a job of the same size). A
    parameter-server algorithm (:mod:`hpcasync.ps.loop_checkpoint`): a worker's call (at
    the end of its epoch, as a synchronous loop would) asks the server for the checkpoint
    ``(epoch, step)`` and trains on at once; the server, inside ``serve()``, writes one file when
    every worker has asked for that label or finished: θ, the rule's state, the server's clock
    (push counts and epoch: the warm-up continues), the workers' buffers and every worker's
    position and own state (shat, shat-root, ensemble: its model). The server's own call
    (``serve(on_epoch=...)`` or after ``serve()``) writes its state alone, unless that label is
    already complete. Returns the path on a rank that wrote (None on a PS worker). Shard servers
    (``ps_ranks`` K > 1): a worker asks every server, and each writes its slice of θ and its
    rule's state once every worker asked for that label (shard 0's file in ``directory``, with
    every worker's part; shard s's in ``directory/shard-s``), as the CLI does.
    """
    from .checkpoint import PER_RANK, CheckpointManager, gather_own

    algorithm = getattr(optimizer, "algorithm", type(optimizer).__name__)
    topo = getattr(optimizer, "topo", None)             # DASO: its comm is DASO's own layer
    comm = topo.world if topo is not None else getattr(optimizer, "comm", None)
    ps = algorithm in PS_ALGORITHMS
    header = {"algorithm": algorithm, "model": type(model).__name__}
    if ps:
        if optimizer.is_server:
            return optimizer.checkpoints.save(directory, epoch=epoch, step=step, keep=keep,
                                              extra=extra, header=header)
        if not optimizer.closed:                        # after finish(): the server's call writes
            optimizer.checkpoints.request(directory, epoch=epoch, step=step, keep=keep,
                                          extra=extra, header=header)
        return None
    local = getattr(optimizer, "local_state_dict", None)      # each rank's own part, if any
    if not getattr(optimizer, "replicas_equal", True) and local is None:   # every rank alike
        raise ConfigError(f"hpcasync.save_checkpoint of {algorithm} inside a cycling epoch: the "
                          "replicas differ there and a checkpoint holds rank 0's state; save "
                          "after opt.epoch_end(...) (a commit of hpcasync.elastic.State keeps "
                          "each rank's own state at any step)")
    if comm is not None:
        _all_arrive(comm, "hpcasync.save_checkpoint")
    parts = None if local is None or comm is None else gather_own(comm, local)
    writer = comm is None or comm.Get_rank() == 0
    path = None
    if writer:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "epoch": epoch, "step": step, "extra": extra}
        if parts is not None:
            state[PER_RANK] = parts             # local SGD's replicas, PowerSGD's error memory
        path = CheckpointManager(directory, keep=keep).save(state, epoch=epoch, step=step,
                                                            **header)
    if comm is not None:
        comm.Barrier()
    return path


def load_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, optimizer=None, *,
                    comm=None) -> dict | None:
    """Restore the newest intact checkpoint of ``directory`` (or the file ``directory``) into
    ``model`` and ``optimizer``; returns the position to continue from, ``{"epoch", "step",
    **extra}``, or None when there is none (said in the log of the root rank, naming the
    directory). A torn or foreign file is skipped with a warning; one of another algorithm or
    model is an error. Not collective by default: every rank reads the file, as ``torch.load``
    would. ``comm`` (an MPI communicator, every rank of it calling): its rank 0 reads the file
    and broadcasts what it found, so that a large model is read once, not once a rank (Horovod's
    load-on-rank-0-and-broadcast); an error is then the same line on every rank.

    A parameter-server algorithm (call it on every rank before ``serve()`` and the loop): the
    server takes θ, the rule's state and (when it serves) its clock; each worker its own position
    (returned: the labels it asked the checkpoint for; ``finished: True`` if it had finished),
    its BatchNorm buffers, its optimizer's param groups and (shat, shat-root, ensemble) its own
    model, which it trains from after the server's first reply. Shard servers (K > 1,
    collective over the optimizer's communicator): the newest label that every server wrote,
    each server from its own file (θ's slice, its rule), every worker from shard 0's."""
    from .checkpoint import PER_RANK, CheckpointManager, own_part, read_once
    from .comm.objects import bcast_object
    from .checkpoint import load_checkpoint as load_file

    algorithm = getattr(optimizer, "algorithm", None)
    ps = algorithm in PS_ALGORITHMS
    expect = {"model": type(model).__name__, **({"algorithm": algorithm} if algorithm else {})}
    p = Path(directory)

    def read() -> dict | None:
        if p.is_file():
            return load_file(p, expect=expect)
        found = CheckpointManager(p).load_latest(expect=expect) if p.is_dir() else None
        return None if found is None else found[2]

    if ps and getattr(getattr(optimizer, "layout", None), "K", 1) > 1:   # each shard its file
        from .ps.loop_checkpoint import read_sharded

        found = read_sharded(optimizer, p, expect)
        state = None if found is None else found[2]
    else:
        if comm is not None:
            _all_arrive(comm, "hpcasync.load_checkpoint(..., comm=)")
        state = read() if comm is None else read_once(
            read, root=comm.Get_rank() == 0, bcast=lambda obj: bcast_object(comm, obj, 0),
            what="hpcasync.load_checkpoint")
    if state is None:
        if _is_root(optimizer, ps):
            log.warning("hpcasync.load_checkpoint: no checkpoint in %s%s: starting from "
                        "the beginning", p, "" if p.is_dir() else " (no such directory)")
        return None
    model.load_state_dict(state["model"])
    if optimizer is None:
        return {"epoch": state["epoch"], "step": state["step"], **state.get("extra", {})}
    if ps:
        return optimizer.checkpoints.restore(state)
    optimizer.load_state_dict(state["optimizer"])
    if hasattr(optimizer, "load_local_state_dict"):     # this rank's own part, if written
        group = getattr(optimizer, "comm", None)
        rank, size = (0, 1) if group is None else (group.Get_rank(), group.Get_size())
        optimizer.load_local_state_dict(own_part(state.get(PER_RANK), rank, size,
                                                 "hpcasync.load_checkpoint"))
    return {"epoch": state["epoch"], "step": state["step"], **state.get("extra", {})}


def _is_root(optimizer, ps: bool) -> bool:
    """The rank that reports: the (first) server of a PS optimizer, else rank 0 of the job."""
    if ps:
        return bool(optimizer.is_server) and optimizer.layout.shard <= 0
    from mpi4py import MPI

    return not MPI.Is_initialized() or MPI.COMM_WORLD.Get_rank() == 0


def open_metrics(path: str | os.PathLike | None, *, roles: Roles | None = None,
                 tensorboard: str | os.PathLike | None = None):
    """The JSONL metrics stream of the CLI (``MetricsWriter``): written by the root rank alone
    (rank 0, or the server of a PS job), to ``PATH.partial`` and renamed when closed. Use
    ``m.write("epoch", epoch=e, test_accuracy=acc, ...)`` and ``m.close()`` (or ``with``).
    ``tensorboard=DIR``: the same writer also writes each record's numbers as TensorBoard scalars
    (tag ``<event>/<field>``; see ``hpcasync.metrics``); without the ``tensorboard`` package every
    rank raises ConfigError here."""
    from .metrics import MetricsWriter, require_tensorboard
    from .topology import default_topology

    if tensorboard is not None:
        require_tensorboard("tensorboard=")     # before the collective below, on every rank
    if roles is not None:
        enabled = roles.is_root
    else:
        topo = default_topology()
        enabled = topo.rank == 0
    return MetricsWriter(path, enabled=enabled, tensorboard=tensorboard)
