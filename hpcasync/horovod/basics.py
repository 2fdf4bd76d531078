"""``hvd.init()`` and the questions a script asks about its place in the job.

The facade's world is an ``MPI_Comm`` of its own (a duplicate of ``COMM_WORLD``, so the script's
collectives never interleave with the toolkit's), its *local* communicator the ranks of this node
(``MPI_Comm_split_type`` shared memory, or the virtual nodes of ``ranks_per_node``) and its *cross*
communicator the ranks with this local rank on every node — Horovod's three numbers, the same
communicators hpcasync's topology builds for DASO.

With a parameter-server algorithm named at ``init(algorithm=...)`` the server rank(s) leave the
script here: they serve (see :mod:`.server`) and exit when the workers are done; ``size()``,
``rank()`` and every collective then count the workers only, so a Horovod script shards its data
over the ranks that train without a change.
"""
from __future__ import annotations

import atexit
import logging

import torch

from ..errors import ConfigError
from . import state as _st
from . import timeline as _timeline
from .process_sets import (ProcessSet, add_process_set, global_process_set,  # noqa: F401
                           remove_process_set)

log = logging.getLogger("hpcasync")


_State = _st.State


def _state() -> _State:
    return _st.current()


#: the options of the first :func:`init` of this process (``hvd.elastic``'s grow-back repeats them)
INIT_OPTIONS: dict = {}


def init(comm=None, process_sets=None, *, algorithm: str | None = None,
         ranks_per_node: int | None = None, ps_rank: int = 0, ps_ranks: int = 1) -> None:
    """Start MPI and the facade (collective; a second call does nothing).

    Args (Horovod's): ``comm`` — ``None`` (``COMM_WORLD``), an mpi4py intracommunicator (the facade
    runs on a duplicate of it), or a list of ``COMM_WORLD`` ranks (a communicator of them is
    created; as in Horovod only those ranks call ``init``); ``process_sets`` — a list of
    :class:`ProcessSet` to register (ids 1, 2, ...), or ``"dynamic"`` to allow
    ``add_process_set`` / ``remove_process_set`` later (so does ``HOROVOD_DYNAMIC_PROCESS_SETS=1``);
    see :mod:`.process_sets`.

    hpcasync's keywords:
        algorithm: the algorithm ``DistributedOptimizer`` will run by default. A parameter-server
            algorithm (asgd, smega2, ...) must be named here, the one extra line of a Horovod
            script: the server rank(s) ``ps_rank`` .. ``ps_rank + ps_ranks - 1`` serve and exit
            inside this call; on the workers ``size()``/``rank()`` count the workers.
        ranks_per_node: group the ranks of a machine into virtual nodes (``local_*``/``cross_*``
            and DASO's node groups follow them).
    """
    if _st.STATE is not None:
        return
    if not INIT_OPTIONS:            # the first call's: an elastic grow-back repeats them
        INIT_OPTIONS.update(algorithm=algorithm, ranks_per_node=ranks_per_node, ps_rank=ps_rank,
                            ps_ranks=ps_ranks)
    if comm is None:
        from ..runtime import join

        if join.is_joiner():        # a replacement spawned by hvd.elastic's grow-back: the
            comm = join.join_world()    # grown world, as the survivors' init(comm=grown)
    from . import process_sets as _ps

    process_sets = _ps.check(process_sets, comm_given=comm is not None)
    import hpcasync
    from ..api import PS_ALGORITHMS
    from ..topology import init_mpi

    MPI = init_mpi()
    base = _base_comm(MPI, comm)
    roles = hpcasync.init(algorithm, ranks_per_node=ranks_per_node, ps_rank=ps_rank,
                          ps_ranks=ps_ranks, threads=torch.get_num_threads(), comm=base)
    world = roles.topology.world
    if algorithm in PS_ALGORITHMS:
        mine = world.Split(MPI.UNDEFINED if roles.is_server else 0, roles.rank)
        if roles.is_server:
            from .server import serve_and_exit

            serve_and_exit(roles)           # never returns
        comm = mine
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        if ranks_per_node is not None:
            grouped = local.Split(local.Get_rank() // ranks_per_node, comm.Get_rank())
            local.Free()
            local = grouped
        cross = comm.Split(local.Get_rank(), comm.Get_rank())
        first = min(r for r in range(roles.size) if r not in roles.topology.servers)
        if roles.rank == first:
            atexit.register(_no_optimizer_at_exit)
    else:
        topo = roles.topology
        comm, local, cross = world.Dup(), topo.local.Dup(), topo.glob.Dup()
    sizes = comm.allgather(local.Get_size())
    _st.STATE = _State(comm=comm, local=local, cross=cross, roles=roles, algorithm=algorithm,
                    homogeneous=len(set(sizes)) == 1, owns_world=base is not None)
    _ps.setup(_st.STATE, process_sets)
    _timeline.start_from_env(rank=rank())    # HOROVOD_TIMELINE=path: rank 0 records


def _base_comm(MPI, comm):
    """``init``'s ``comm=`` as a communicator of its own (None: COMM_WORLD)."""
    if comm is None or comm is MPI.COMM_WORLD:
        return None
    if isinstance(comm, MPI.Comm):
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise ValueError(f"hvd.init(comm=...) needs an MPI intracommunicator, got {comm!r}")
        return comm.Dup()
    ranks = list(comm)
    world = MPI.COMM_WORLD
    if (not ranks or any(not isinstance(r, int) or not 0 <= r < world.Get_size() for r in ranks)
            or len(set(ranks)) != len(ranks)):
        raise ValueError(f"hvd.init(comm=[...]) needs distinct ranks of COMM_WORLD (0..."
                         f"{world.Get_size() - 1}), got {ranks!r}")
    if world.Get_rank() not in ranks:
        raise ValueError(f"hvd.init(comm={ranks!r}) called on rank {world.Get_rank()}, which is "
                         "not in the list (only the listed ranks call init)")
    group = world.Get_group().Incl(ranks)
    try:
        return world.Create_group(group, tag=_CREATE_TAG)
    finally:
        group.Free()


_CREATE_TAG = 0x4856          # "HV": MPI_Comm_create_group's tag for init(comm=[ranks])


def _no_optimizer_at_exit() -> None:
    """The first worker, at exit: if no DistributedOptimizer was built, release the server(s)."""
    if _st.STATE is not None and not _st.STATE.spec_sent:
        from .server import send_spec

        send_spec(_st.STATE.roles, None)


def shutdown() -> None:
    """Free the facade's communicators (MPI itself is finalized at exit); after
    ``init(comm=...)`` also the topology built on that communicator and its exit agreement, so
    that init/shutdown cycles leave nothing behind."""
    if _st.STATE is None:
        return
    from . import process_sets as _ps

    st = _st.STATE
    _ps.teardown(st)
    for c in (st.local, st.cross):
        c.Free()
    if st.algorithm is None or st.comm is not st.roles.topology.world:
        st.comm.Free()
    if st.owns_world:
        from .. import api

        api.release(st.roles, free_world=True)
    _st.STATE = None


def is_initialized() -> bool:
    return _st.STATE is not None


def size() -> int:
    """Ranks that train (every rank; the workers with a parameter-server algorithm)."""
    return _state().comm.Get_size()


def rank() -> int:
    return _state().comm.Get_rank()


def local_size() -> int:
    return _state().local.Get_size()


def local_rank() -> int:
    return _state().local.Get_rank()


def cross_size() -> int:
    return _state().cross.Get_size()


def cross_rank() -> int:
    return _state().cross.Get_rank()


def is_homogeneous() -> bool:
    """True when every node has the same number of ranks."""
    return _state().homogeneous


def mpi_threads_supported() -> bool:
    from mpi4py import MPI

    _state()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    """False: no NCCL; CUDA tensors travel through host memory (hpcasync's comm layer)."""
    return False


def cuda_built() -> bool:
    """True: collectives take CUDA tensors (staged through host memory)."""
    return True


def rocm_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def start_timeline(file_path, mark_cycles: bool = False) -> None:
    """Record Horovod's timeline to ``file_path`` (on rank 0; :mod:`.timeline`)."""
    _timeline.start(file_path, mark_cycles, rank=rank())


def stop_timeline() -> None:
    """Stop recording the timeline and close its file."""
    _state()
    _timeline.stop()


def check_process_set(process_set) -> None:
    """For the parts that run on the global set only: any other set is NotImplementedError."""
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("hpcasync.horovod supports only hvd.global_process_set here")


def require_algorithm(algorithm: str | None) -> str | None:
    """The algorithm a DistributedOptimizer runs: its own keyword, else init's."""
    from ..api import PS_ALGORITHMS, algorithms

    st = _state()
    if algorithm is None:
        return st.algorithm
    if algorithm not in algorithms():
        raise ConfigError(f"unknown algorithm {algorithm!r} (choose from "
                          f"{', '.join(algorithms())})")
    if algorithm in PS_ALGORITHMS and st.algorithm != algorithm:
        raise ConfigError(f"{algorithm} runs a parameter server: name it at "
                          f"hvd.init(algorithm={algorithm!r}) so the server rank leaves the "
                          "script there (init was given "
                          f"{st.algorithm!r})")
    if st.algorithm in PS_ALGORITHMS and algorithm != st.algorithm:
        raise ConfigError(f"hvd.init(algorithm={st.algorithm!r}) set aside a server rank; "
                          f"DistributedOptimizer(algorithm={algorithm!r}) cannot run without one")
    return algorithm
