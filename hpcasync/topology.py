"""Who is where: world, node-local and global communicators, virtual nodes, device, PS rank.

Built once, outside every algorithm, and passed in (style anchor 8).

* ``local``: the ranks of one node. A physical node is found with ``MPI_COMM_TYPE_SHARED``; with
  ``ranks_per_node=K`` (``--ranks-per-node`` / ``HPCASYNC_RANKS_PER_NODE``) the ranks of each physical
  node are regrouped into *virtual nodes* of K consecutive ranks, so the whole hierarchy runs and is
  tested on one machine.
* ``glob``: for local index j, the ranks with local index j on every node (the middle stage of the
  hierarchical allreduce, which needs equal nodes); a node with fewer ranks is absent from the
  higher indices' communicators.
* :meth:`Topology.global_groups`: DASO's global groups, which also hold on uneven nodes (after a
  death): group j is, on every node p, its rank with local index ``j mod L_p`` (:func:`regroup`).
* ``device``: local rank r uses ``cuda:r`` when CUDA is available and ``device`` is ``auto``/``cuda``,
  else the CPU (the single-node multi-GPU mode is ``mpirun -n <gpus> hpcasync train ...``).
* ``ps_rank``: the world rank that serves the asynchronous algorithms (it does no training compute).

Example::

    topo = Topology.build(ranks_per_node=2)      # 4 ranks -> 2 virtual nodes x 2 ranks
    topo.local.Allreduce(...)                    # inside the node
    topo.glob.Allreduce(...)                     # across nodes, same local index
"""
from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass

from .errors import TopologyError
from .slurm import SlurmEnv

log = logging.getLogger(__name__)

RANKS_PER_NODE_ENV = "HPCASYNC_RANKS_PER_NODE"


def init_mpi():
    """Initialise MPI if nobody has (the CLI defers it until options are validated); return MPI.
    Tunes glibc's allocator first (:mod:`hpcasync.runtime.malloc`; ``HPCASYNC_MALLOC=default``).
    Fault tolerance asked for under MPICH is a ConfigError here, before MPI starts (ULFM is
    Open-MPI-only: :func:`hpcasync.runtime.ft.check_ft_request`)."""
    from .runtime import startup
    from .runtime.ft import check_ft_request
    from .runtime.malloc import tune_malloc

    tune_malloc()
    single_host_open_mpi_defaults()
    ulfm_open_mpi_defaults()
    # A user's loop (hpcasync.init, hvd.init) under ULFM: a rank dead before MPI is up ends the
    # job with one line instead of leaving the others in MPI_Init (the CLI started it already).
    startup.watch()
    startup.entering_mpi()
    from mpi4py import MPI

    check_ft_request()

    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        atexit.register(_finalize)
    startup.done()
    return MPI


def single_host_open_mpi_defaults() -> None:
    """Before MPI_Init: when Open MPI's launcher says every rank is on this host, skip the UCX
    one-sided component. Without UCX-capable hardware it fails its query and prints an error line
    at every window creation; on one host the shared-memory components serve the RMA windows. A user
    setting of OMPI_MCA_osc always wins; multi-host jobs are left alone."""
    env = os.environ
    local, world = env.get("OMPI_COMM_WORLD_LOCAL_SIZE"), env.get("OMPI_COMM_WORLD_SIZE")
    if local is not None and local == world and "OMPI_MCA_osc" not in env:
        env["OMPI_MCA_osc"] = "^ucx"


def ulfm_open_mpi_defaults() -> None:
    """Before MPI_Init, under ULFM (``mpirun --with-ft ulfm`` sets ``OMPI_MCA_mpi_ft_enable=1``):
    skip the PMIx fence at the start of MPI_Finalize (``async_mpi_finalize``). After a process
    has died, that job-wide fence now and then never completes (Open MPI 5.0.11: the survivors
    hang in MPI_Finalize); ULFM's MPI_Finalize first shrinks COMM_WORLD and runs a barrier over the
    survivors, which already waits for all of them and flushes their messages. A user setting
    of OMPI_MCA_async_mpi_finalize wins."""
    from .launch import ft_requested

    if ft_requested():
        os.environ.setdefault("OMPI_MCA_async_mpi_finalize", "1")
        # mpi4py's object reductions on the communicator itself (a death at the final gathers
        # hung the job otherwise); only before mpi4py.MPI is imported (MPI4PY_RC_FAST_REDUCE=
        # false does it for a harness that imports it first)
        from . import _ulfm_object_reductions

        _ulfm_object_reductions(warn=True)


def _finalize() -> None:
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


@dataclass(frozen=True)
class Topology:
    world: "object"          # mpi4py.MPI.Intracomm
    local: "object"          # ranks of this (virtual) node
    glob: "object"           # ranks with this local index on every node
    rank: int
    size: int
    local_rank: int
    local_size: int
    node: int
    num_nodes: int
    uniform: bool            # every node has local_size ranks (needed by hierarchical schemes)
    virtual_nodes: bool
    device: str              # torch device string, "cpu" or "cuda:r"
    ps_rank: int
    ps_ranks: int = 1        # parameter-server ranks (shard servers): ps_rank and those after it
    node_sizes: tuple = ()   # ranks of every node, by node number (() where not known)

    @property
    def max_local_size(self) -> int:
        """The largest node's rank count (``local_size`` on uniform nodes): DASO's number of
        global groups."""
        return max(self.node_sizes) if self.node_sizes else self.local_size

    @property
    def is_ps(self) -> bool:
        return self.rank == self.ps_rank

    @property
    def servers(self) -> list[int]:
        """World ranks of the parameter server(s): ``ps_rank`` and the ``ps_ranks - 1`` after it
        (modulo the world size)."""
        return server_ranks(self.ps_rank, self.ps_ranks, self.size)

    @property
    def workers(self) -> list[int]:
        """World ranks that train in a parameter-server job (every rank but the PS)."""
        return [r for r in range(self.size) if r != self.ps_rank]

    @classmethod
    def build(cls, comm=None, *, ranks_per_node: int | None = None, device: str = "auto",
              ps_rank: int = 0) -> "Topology":
        MPI = init_mpi()
        world = MPI.COMM_WORLD if comm is None else comm
        if comm is None:          # a sub-communicator of one rank is no launch mistake
            SlurmEnv.from_environ().check_world(world.Get_size())
        rank, size = world.Get_rank(), world.Get_size()
        if ranks_per_node is None and os.environ.get(RANKS_PER_NODE_ENV):
            raw = os.environ[RANKS_PER_NODE_ENV]
            if not raw.isdigit():
                raise TopologyError(f"{RANKS_PER_NODE_ENV}={raw!r} is not a positive integer")
            ranks_per_node = int(raw)
        if not 0 <= ps_rank < size:
            raise TopologyError(f"ps rank {ps_rank} does not exist in a world of {size} ranks")

        physical = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        if ranks_per_node is not None:
            if ranks_per_node < 1:
                raise TopologyError(f"ranks per node must be >= 1, got {ranks_per_node}")
            psize = physical.Get_size()
            bad = world.allreduce(psize % ranks_per_node != 0, op=MPI.LOR)
            if bad:
                physical.Free()
                raise TopologyError(
                    f"{size} ranks ({psize} on this machine) cannot be grouped into virtual nodes of "
                    f"{ranks_per_node} ranks: the ranks of each machine must be a multiple of "
                    f"--ranks-per-node")
            prank = physical.Get_rank()
            # colour: first world rank of the physical node, then the block index inside it
            leader = physical.bcast(rank, root=0)
            local = physical.Split(color=leader * size + prank // ranks_per_node, key=rank)
            physical.Free()
        else:
            local = physical
        local_rank, local_size = local.Get_rank(), local.Get_size()

        # Number the nodes by their lowest world rank, identically on every rank.
        leaders = world.allgather(rank if local_rank == 0 else -1)
        node_leaders = sorted(r for r in leaders if r >= 0)
        my_leader = local.bcast(rank, root=0)
        node = node_leaders.index(my_leader)
        nodes, _ = regroup(world.allgather(node))
        node_sizes = tuple(len(n) for n in nodes)
        glob = world.Split(color=local_rank, key=rank)
        return cls(world=world, local=local, glob=glob, rank=rank, size=size,
                   local_rank=local_rank, local_size=local_size, node=node,
                   num_nodes=len(node_leaders), uniform=len(set(node_sizes)) == 1,
                   virtual_nodes=ranks_per_node is not None,
                   device=pick_device(device, local_rank), ps_rank=ps_rank,
                   node_sizes=node_sizes)

    def shrunk(self, world) -> "Topology":
        """The topology of ``world``, the survivors of this topology's world after a death
        (``MPI_Comm_shrink``; collective over it): every survivor stays on its (virtual) node with
        the survivors of that node (:func:`regroup`), nodes that lost every rank are gone, nodes
        are renumbered in order. A node that lost some ranks keeps the others together — 3 nodes
        of 2 minus one rank are nodes of 2, 1 and 2, not 5 nodes of 1 — and makes the topology
        non-uniform (``uniform`` False: the hierarchical allreduce refuses it; DASO runs on uneven
        nodes, see :meth:`global_groups`). The world rank of the parameter server is kept where it
        survived (else 0)."""
        from .runtime.ft import translate

        rank, size = world.Get_rank(), world.Get_size()
        nodes, _ = regroup(world.allgather(self.node))
        node = next(i for i, ranks in enumerate(nodes) if rank in ranks)
        local = world.Split(color=node, key=rank)
        glob = world.Split(color=local.Get_rank(), key=rank)
        node_sizes = tuple(len(n) for n in nodes)
        ps = translate(self.ps_rank, self.world, world) if self.ps_rank < self.size else -1
        return Topology(world=world, local=local, glob=glob, rank=rank, size=size,
                        local_rank=local.Get_rank(), local_size=local.Get_size(),
                        node=node, num_nodes=len(nodes), uniform=len(set(node_sizes)) == 1,
                        virtual_nodes=self.virtual_nodes, device=self.device,
                        ps_rank=max(ps, 0), ps_ranks=self.ps_ranks, node_sizes=node_sizes)

    def global_groups(self) -> dict:
        """DASO's global groups this rank belongs to, ``{j: communicator}`` for j < the largest
        node's size (:func:`regroup`): group j holds, on every node, the rank with local index
        ``j mod L_p`` — every node takes part in every group. On uniform nodes that is ``glob``
        (returned, no new communicator: ``{local_rank: glob}``); on uneven nodes a rank of a
        smaller node is in several groups and one new communicator per group is made here (the
        caller's). Collective over ``world``."""
        if self.uniform:
            return {self.local_rank: self.glob}
        from mpi4py import MPI

        _, groups = regroup(self.world.allgather(self.node))
        out = {}
        for j, members in enumerate(groups):
            member = self.rank in members
            comm = self.world.Split(color=0 if member else MPI.UNDEFINED, key=self.rank)
            if member:
                out[j] = comm
        return out

    def require_uniform(self, what: str) -> None:
        """Raise unless every node has the same number of ranks (``what`` names the caller)."""
        if not self.uniform:
            raise TopologyError(f"{what} needs the same number of ranks on every node; "
                                f"use --ranks-per-node to group them evenly")

    def describe(self) -> str:
        kind = "virtual" if self.virtual_nodes else "physical"
        of = (str(self.local_size) if self.uniform or not self.node_sizes
              else "+".join(map(str, self.node_sizes)))
        return (f"{self.size} ranks on {self.num_nodes} {kind} node(s) of {of}, "
                f"device {self.device}, ps rank {self.ps_rank}")

    def free(self) -> None:
        for comm in (self.local, self.glob):
            try:
                comm.Free()
            except Exception:  # pragma: no cover - already freed or MPI finalised
                pass


def regroup(node_of) -> tuple[list[list[int]], list[list[int]]]:
    """Nodes and DASO global groups from the node of every rank (pure; no MPI).

    ``node_of[r]`` is the node (any hashable id) of rank r — after a death, each survivor's node
    in the old topology. Returns ``(nodes, groups)``: ``nodes`` the ranks of each node, nodes
    ordered by their lowest rank, ranks ascending (so every survivor stays with the survivors of
    its node, whatever their number); ``groups[j]`` for j < L = the largest node's size: on every
    node p (in node order) its rank with local index ``j mod L_p``. On uniform nodes group j is
    local index j on every node (DASO's groups); on uneven ones every node is still in every
    group — a node of one rank sends that rank in all of them — so each global merge averages
    over all P nodes, as DASO's formula (2B·x + S)/(2B + P) takes.

    Example: ``regroup([0, 0, 1, 2, 2])`` (3 nodes of 2, rank 3 dead) →
    ``([[0, 1], [2], [3, 4]], [[0, 2, 3], [1, 2, 4]])``.
    """
    by_node: dict = {}
    for rank, node in enumerate(node_of):
        by_node.setdefault(node, []).append(rank)
    nodes = sorted(by_node.values(), key=lambda ranks: ranks[0])
    width = max((len(n) for n in nodes), default=0)
    groups = [[n[j % len(n)] for n in nodes] for j in range(width)]
    return nodes, groups


def server_ranks(ps_rank: int, ps_ranks: int, size: int) -> list[int]:
    """The world ranks of ``ps_ranks`` parameter-server ranks starting at ``ps_rank``."""
    return [(ps_rank + s) % size for s in range(ps_ranks)]


_DEFAULT: Topology | None = None


def default_topology(**kwargs) -> Topology:
    """The job's topology for code that is given none: the one ``hpcasync.init`` built (or
    :func:`set_default_topology` set), else one built now on ``COMM_WORLD`` with ``kwargs``
    (collective: call it on every rank)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Topology.build(**kwargs)
    return _DEFAULT


def set_default_topology(topo: Topology | None) -> None:
    global _DEFAULT
    _DEFAULT = topo


def forget_default_topology(topo: Topology) -> None:
    """No default topology any more if it is ``topo`` (whose communicators are being freed)."""
    global _DEFAULT
    if _DEFAULT is topo:
        _DEFAULT = None


def pick_device(choice: str, local_rank: int) -> str:
    """Map a ``--device`` choice and a local rank to a torch device string."""
    if choice not in ("auto", "cpu", "cuda"):
        raise TopologyError(f"--device must be auto, cpu or cuda, got {choice!r}")
    if choice == "cpu":
        return "cpu"
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        if choice == "cuda":
            raise TopologyError("--device cuda was asked for, but no CUDA device is visible")
        return "cpu"
    if local_rank >= count:
        if choice == "cuda":
            raise TopologyError(f"local rank {local_rank} has no GPU: this node has {count}; "
                                f"start at most {count} ranks per node")
        log.warning("local rank %d shares a GPU: only %d visible", local_rank, count)
    return f"cuda:{local_rank % count}"
