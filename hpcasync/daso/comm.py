"""DASO's communication: node-local gradient averages, global sends in flight, node broadcasts,
blocking global averages, and an emulated slow inter-node link. Built on :mod:`hpcasync.comm`.

* node-local: ``allreduce(topo.local, grads, average=True)`` (the shared-memory window), or
  Horovod initialised on ``topo.local`` (``local_backend="horovod"``);
* global send: global group j copies its parameters and float buffers into a fresh snapshot and
  starts ``iallreduce(..., compress=cast, chunk_elems=DASO_CHUNK_ELEMS, algorithm="mpi")``; the
  record of the message is an :class:`InFlight`; :meth:`DasoComm.complete` waits for it and
  returns the sum S;
* node broadcast: ``broadcast(topo.local, state, root=j mod L_p)``;
* blocking global average (all ranks): ``hierarchical_allreduce(topo, t, average=True)`` — node
  reduce-scatter, across-node allreduce, node allgather — in float32.

Uneven nodes (after a death, :meth:`~hpcasync.topology.Topology.shrunk`: 3 nodes of 2 minus one
rank are nodes of 2, 1, 2). Global group j is, on every node p of L_p ranks, its local rank
``j mod L_p`` (:meth:`~hpcasync.topology.Topology.global_groups`; on equal nodes that is local
rank j, ``topo.glob``), for j < L = the largest node's size: every node is in every group, so S
always holds one copy per node and the merge's P is the number of nodes, as on equal nodes; a
rank of a smaller node is in several groups (and sends for each). The blocking average stays an
average over all ranks (sum / world size, each rank weighing 1, a node weighing its rank count):
the node sums (``allreduce(topo.local)``), the sum of the node sums over the node leaders (local
rank 0, group 0), divided by the world size there and broadcast inside each node — identical on
every rank. (The hierarchical allreduce cuts the node reduce-scatter into L_p pieces and needs
equal nodes.)

The cast (``"bf16"`` default, ``"fp16"``, or None) applies only on the wire of the nonblocking
global sends (whose sum is merged with weight P/(2B+P) anyway). Blocking averages — warm-up and
cool-down gradients, the epoch-end average of parameters, buffers and momentum, BatchNorm buffers —
stay float32, as in Heat: a blocking epoch is then exactly SSGD, and the model is never rounded to
16 bits as a whole.

Emulated link (``link_delay_us_per_mb`` = d, off by default): every global collective costs
d µs per 10^6 bytes of its message as the node puts it on the link once (its wire size: numel ×
2 bytes in bf16/fp16, × 4 in float32), as if each node had one link. A blocking collective sleeps
that long after it completes; a nonblocking send is ready d·bytes after it started, so
:meth:`DasoComm.complete` sleeps only for what is left when it is called (the overlap DASO buys).
Each message is assumed to have the link to itself.

Example::

    dc = DasoComm(topo, cast="bf16")
    dc.local_average(flat.grads)
    msg = dc.start(pack_state(flat.params, flat.buffers), group=0, batch=4, due=5)
    # msg is None on the ranks outside group 0
    ...
    total = dc.complete(msg)                              # S, this rank's stale copy included
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from ..comm import DASO_CHUNK_ELEMS, Handle, allreduce, hierarchical_allreduce, iallreduce
from ..comm.broadcast import broadcast
from ..comm.compress import COMPRESS
from ..errors import ConfigError

LOCAL_BACKENDS = ("mpi", "horovod")


class LinkDelay:
    """A per-byte delay standing in for a slow inter-node link (see module doc)."""

    __slots__ = ("us_per_mb",)

    def __init__(self, us_per_mb: float = 0.0):
        if not isinstance(us_per_mb, (int, float)) or not 0 <= us_per_mb < float("inf"):
            raise ConfigError(f"link delay must be a finite number >= 0 µs/MB, got {us_per_mb!r}")
        self.us_per_mb = float(us_per_mb)

    def seconds(self, nbytes: int) -> float:
        return self.us_per_mb * 1e-6 * nbytes / 1e6

    def block(self, nbytes: int) -> None:
        """Sleep for a blocking message of ``nbytes``."""
        if self.us_per_mb:
            time.sleep(self.seconds(nbytes))

    def until_ready(self, t_start: float, nbytes: int) -> None:
        """Sleep until a message of ``nbytes`` started at ``t_start`` would have arrived."""
        if self.us_per_mb:
            left = t_start + self.seconds(nbytes) - time.perf_counter()
            if left > 0:
                time.sleep(left)


class InFlight(NamedTuple):
    """One global send in flight (only on the ranks of its group)."""
    group: int              # global group (local index j) that sent it
    handle: Handle          # the nonblocking sum; handle.tensor receives S
    sent_batch: int
    due_batch: int          # the batch that completes and merges it
    t_start: float          # time.perf_counter() at the send
    nbytes: int             # wire bytes of the message


class Received:
    """A global send completed before its due batch (loaded from a state dict): ``wait()``
    returns its sum S, as :class:`~hpcasync.comm.handle.Handle` does once done."""

    done = True

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def test(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        return self.tensor


def wire_itemsize(cast: str | None) -> int:
    return 4 if COMPRESS[cast] is None else 2


class DasoComm:
    """DASO's collectives over a :class:`~hpcasync.topology.Topology`, with time and byte counters.

    Args:
        topo: a :class:`~hpcasync.topology.Topology`, nodes even or not (module doc);
            P = ``topo.num_nodes``, L = ``topo.max_local_size`` global groups.
        cast: wire format of the nonblocking global sends: ``"bf16"`` (default), ``"fp16"`` or
            None/"none" (blocking averages are always float32).
        chunk_elems: largest piece of a global send (default :data:`DASO_CHUNK_ELEMS`, 10 M).
        local_backend: ``"mpi"`` (own allreduce, default) or ``"horovod"``.
        link_delay_us_per_mb: emulated inter-node link delay (default 0: off).

    Counters (seconds / bytes on this rank): ``global_wait_s`` (completing sends, emulated delay
    included), ``blocking_global_s`` (blocking global averages), ``local_s`` (node-local averages
    and broadcasts), ``global_bytes`` (wire bytes this rank put on global communicators),
    ``local_bytes`` (bytes this rank handed to node-local averages, and broadcasts it rooted),
    ``sends``.
    """

    def __init__(self, topo, *, cast: str | None = "bf16", chunk_elems: int = DASO_CHUNK_ELEMS,
                 local_backend: str = "mpi", link_delay_us_per_mb: float = 0.0):
        if cast not in COMPRESS:
            raise ConfigError(f"DASO cast must be none, bf16 or fp16; got {cast!r}")
        if not isinstance(chunk_elems, int) or chunk_elems < 1:
            raise ConfigError(f"DASO chunk_elems must be an integer >= 1, got {chunk_elems!r}")
        if local_backend not in LOCAL_BACKENDS:
            raise ConfigError(f"DASO local backend must be mpi or horovod, got {local_backend!r}")
        self.topo = topo
        self.cast = None if cast == "none" else cast
        self.chunk_elems = chunk_elems
        self.delay = LinkDelay(link_delay_us_per_mb)
        self.local_backend = local_backend
        self._hvd = _horovod_on(topo.local) if local_backend == "horovod" else None
        # this rank's global groups {j: communicator} (collective over the world)
        self.groups = topo.global_groups()
        self.reset_counters()

    def member(self, group: int) -> bool:
        """True when this rank is in global group ``group`` (sends and merges for it)."""
        return group in self.groups

    def root_of(self, group: int) -> int:
        """The local rank of this node that is in global group ``group`` (``group mod L_p``)."""
        return group % self.topo.local_size

    def group_comms(self) -> tuple:
        """The communicators of this rank's global groups (to revoke after a death)."""
        return tuple(self.groups.values())

    def reset_counters(self) -> None:
        self.global_wait_s = self.blocking_global_s = self.local_s = 0.0
        self.global_bytes = self.local_bytes = self.sends = 0

    def counters(self) -> dict:
        return {"global_wait_s": self.global_wait_s, "blocking_global_s": self.blocking_global_s,
                "local_s": self.local_s, "global_bytes": self.global_bytes,
                "local_bytes": self.local_bytes, "sends": self.sends}

    # -- node-local ---------------------------------------------------------------------------
    def local_average(self, grads: torch.Tensor) -> None:
        """Average ``grads`` over the node, in place."""
        if self.topo.local_size == 1:
            return
        t0 = time.perf_counter()
        if self._hvd is not None:
            self._hvd.allreduce_(grads, op=self._hvd.Average, name="daso.local.grads")
        else:
            allreduce(self.topo.local, grads, average=True)
        self.local_s += time.perf_counter() - t0
        self.local_bytes += grads.numel() * grads.element_size()

    def node_broadcast(self, state: torch.Tensor, root: int) -> None:
        """Overwrite ``state`` on every rank of the node with local rank ``root``'s."""
        if self.topo.local_size == 1:
            return
        t0 = time.perf_counter()
        broadcast(self.topo.local, state, root=root)
        self.local_s += time.perf_counter() - t0
        if self.topo.local_rank == root:
            self.local_bytes += state.numel() * state.element_size()

    # -- global -------------------------------------------------------------------------------
    def global_average(self, tensor: torch.Tensor) -> None:
        """Blocking float32 average of ``tensor`` over all ranks (node by node), in place."""
        if not tensor.numel():
            return
        t0 = time.perf_counter()
        topo = self.topo
        nbytes = tensor.numel() * wire_itemsize(None)
        if topo.uniform:
            hierarchical_allreduce(topo, tensor, average=True)
            share = nbytes // topo.local_size
        else:
            self._uneven_average(tensor)
            share = nbytes if topo.local_rank == 0 else 0
        if topo.num_nodes > 1:
            self.delay.block(nbytes)
            self.global_bytes += share
        self.blocking_global_s += time.perf_counter() - t0

    def _uneven_average(self, tensor: torch.Tensor) -> None:
        """Average over all ranks on uneven nodes: node sum, sum over the node leaders (group 0),
        / world size, node broadcast from the leader (module doc)."""
        topo = self.topo
        if topo.local_size > 1:
            allreduce(topo.local, tensor)
        if topo.local_rank == 0:
            if topo.num_nodes > 1:
                allreduce(self.groups[0], tensor, algorithm="mpi")
            tensor.div_(topo.size)
        if topo.local_size > 1:
            broadcast(topo.local, tensor, root=0)

    def start(self, snapshot: torch.Tensor, *, group: int, batch: int, due: int
              ) -> InFlight | None:
        """Group ``group`` starts summing ``snapshot`` (a tensor of its own, which receives S and
        must not be touched until :meth:`complete`); returns None on ranks outside the group."""
        comm = self.groups.get(group)
        if comm is None:
            return None
        nbytes = snapshot.numel() * wire_itemsize(self.cast)
        t_start = time.perf_counter()
        handle = iallreduce(comm, snapshot, compress=self.cast,
                            chunk_elems=self.chunk_elems, algorithm="mpi",
                            name=f"daso.global.g{group}", step=batch)
        if self.topo.num_nodes > 1:
            self.global_bytes += nbytes
        self.sends += 1
        return InFlight(group, handle, batch, due, t_start, nbytes)

    def progress(self, messages) -> None:
        """Let MPI move the messages in flight along (nonblocking ``test``)."""
        for msg in messages:
            msg.handle.test()

    def complete(self, msg: InFlight) -> torch.Tensor:
        """Wait for ``msg`` (and for the emulated link); returns S, the sum over the group."""
        t0 = time.perf_counter()
        total = msg.handle.wait()
        if self.topo.num_nodes > 1:
            self.delay.until_ready(msg.t_start, msg.nbytes)
        self.global_wait_s += time.perf_counter() - t0
        return total


def _horovod_on(local_comm):
    """``horovod.torch`` initialised on the node-local communicator (re-initialised if needed)."""
    try:
        import horovod.torch as hvd
    except ImportError:
        raise ConfigError("DASO --backend horovod: Horovod is not installed; "
                          "run scripts/install-horovod.sh") from None
    if hvd.is_initialized() and (hvd.size() != local_comm.Get_size()
                                 or hvd.rank() != local_comm.Get_rank()):
        hvd.shutdown()
    if not hvd.is_initialized():
        hvd.init(comm=local_comm)
    return hvd


def pack_state(params: torch.Tensor, buffers: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """``[params, buffers]`` as one flat tensor (into ``out`` when given)."""
    n = params.numel()
    if out is None:
        out = torch.empty(n + buffers.numel(), dtype=params.dtype, device=params.device)
    out[:n].copy_(params)
    out[n:].copy_(buffers)
    return out


def unpack_state(state: torch.Tensor, params: torch.Tensor, buffers: torch.Tensor) -> None:
    """Copy a packed state back into ``params`` and ``buffers`` (in place)."""
    n = params.numel()
    params.copy_(state[:n])
    buffers.copy_(state[n:])
