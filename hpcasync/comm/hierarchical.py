"""Hierarchical allreduce: node reduce-scatter -> across-node allreduce -> node allgather.

With P nodes of L ranks each, x_{p,l} the tensor of local rank l on node p, and chunks C_0 … C_{L-1}
of the index range (the same split on every node):

1. inside node p, local rank l gets  s_{p,l} = Σ_{l'} x_{p,l'}[C_l]          (reduce-scatter)
2. across nodes, within global group l:  t_l = Σ_p s_{p,l}                  (allreduce on topo.glob)
3. inside each node, every rank gathers t_0 … t_{L-1}                       (allgather)

so every rank ends with Σ_{p,l} x_{p,l} (divided by P·L for ``average``), equal to the flat
allreduce up to float rounding. Each local rank carries 1/L of the data across nodes (Horovod's
hierarchical allreduce sends everything through one rank per node instead).

Stage 1 and 3 run through the node's shared-memory window (:class:`~hpcasync.comm.shm.ShmAllreduce`,
stage 2 called on the reduced chunk between its two syncs) when ``algorithm`` is
``"auto"``/``"shm"``, else through ``MPI_Reduce_scatter`` / ``MPI_Allgatherv``. Stage 2 is always
MPI, on a private duplicate of ``topo.glob``. Compression (bf16/fp16) applies to all three stages.

Example::

    topo = Topology.build(ranks_per_node=2)          # 4 ranks -> 2 virtual nodes x 2
    hierarchical_allreduce(topo, flat.grads, average=True)
    h = ihierarchical_allreduce(topo, flat.grads, name="grads", step=7); ...; h.wait()

Messages up to :data:`HIER_SMALL_BYTES` (64 KiB, on the CPU, not cut into pieces) skip the
reduce-scatter: the whole buffer is allreduced in the node, then across nodes by every local rank,
which saves a synchronisation where latency, not bytes, is the cost.

Requires every node to have the same number of ranks (``topo.require_uniform``).

Every node takes the same node-local path: with ``"auto"`` each node's communicator decides alone
(:mod:`~hpcasync.comm.tune` measures per communicator), and one node on the window while another
is on MPI would cut stage 2 into different chunks (MPICH: "Message truncated"). So the first message
of each size class also agrees across nodes (logical AND over ``topo.glob``: the window only if
every node chose it); the agreement is cached like the decision itself.
"""
from __future__ import annotations

import torch

from .allreduce import flat_view, piece_elems, staged_steps
from .engine import pick_engine
from .cache import comm_cache, private_dup
from .compress import decode, encode, wire_dtype
from .handle import Allgatherv, Allreduce, Handle, ReduceScatter, run_blocking
from .ops import HALF_DTYPES, mpi_buffer, sum_op
from .shm import partition
from .tune import size_class

HIER_SMALL_BYTES = 64 << 10     # up to this size: whole-buffer allreduce in the node, then across


def _mpi_steps(local, glob, flat, *, wire, divisor, piece):
    """Reduce-scatter / allreduce / allgatherv with MPI collectives on private communicators."""
    w = encode(flat, wire_dtype=wire, divisor=divisor)
    n, r = local.Get_size(), local.Get_rank()
    op = sum_op(wire)

    def reduce(host: torch.Tensor):
        total = host.numel()
        step = piece or total
        for start in range(0, total, step):
            part = host[start: start + step]
            bounds = partition(part.numel(), n)
            counts = [hi - lo for lo, hi in bounds]
            displs = [lo for lo, _ in bounds]
            mine = torch.empty(counts[r], dtype=wire)
            whole = mpi_buffer(part)
            yield (ReduceScatter(local, whole, mpi_buffer(mine), counts, op),)
            yield (Allreduce(glob, mpi_buffer(mine), op),)
            yield (Allgatherv(local, mpi_buffer(mine), [whole[0], (counts, displs), whole[1]]),)

    yield from staged_steps(w, reduce)
    decode(w, flat, divisor=divisor)


def _small_steps(topo, engine, glob, flat, *, wire, divisor):
    """Small messages: allreduce the whole buffer in the node, then across nodes (every local
    rank sends all of it: for small messages one sync less matters more than 1/L of the bytes)."""
    w = encode(flat, wire_dtype=wire, divisor=divisor)
    if engine is not None:
        yield from engine.steps(w, wire=wire)
    else:
        yield (Allreduce(private_dup(topo.local), mpi_buffer(w), sum_op(wire)),)
    if topo.num_nodes > 1:
        yield (Allreduce(glob, mpi_buffer(w), sum_op(wire)),)
    decode(w, flat, divisor=divisor)


def _agreed(topo, glob, engine, nbytes: int, wire: torch.dtype, algorithm: str):
    """``engine`` if every node has one for this size class, else None (collective over
    ``glob`` on the first message of a class with ``"auto"``, several nodes)."""
    if algorithm != "auto" or topo.num_nodes == 1:
        return engine
    from mpi4py import MPI

    agreed = comm_cache(glob).setdefault("hier_auto", {})
    key = (size_class(nbytes), wire in HALF_DTYPES)
    if key not in agreed:
        agreed[key] = bool(glob.allreduce(engine is not None, op=MPI.LAND))
    return engine if agreed[key] else None


def hierarchical_steps(topo, tensor: torch.Tensor, *, average: bool = False,
                       compress: str | None = None, algorithm: str = "auto",
                       bucket_bytes: int | None = None, chunk_elems: int | None = None):
    """Step generator behind both hierarchical functions, plus the shm engine it uses (or None)."""
    topo.require_uniform("the hierarchical allreduce")
    flat = flat_view(tensor)
    wire = wire_dtype(flat.dtype, compress)
    divisor = topo.size if average else 1
    piece = piece_elems(wire.itemsize, bucket_bytes, chunk_elems)
    glob = private_dup(topo.glob)
    op = sum_op(wire)
    nbytes = flat.numel() * wire.itemsize
    engine = _agreed(topo, glob, pick_engine(topo.local, nbytes, algorithm, cuda_aware=False,
                                             wire=wire), nbytes, wire, algorithm)
    if nbytes <= HIER_SMALL_BYTES and piece is None and flat.device.type == "cpu":
        return _small_steps(topo, engine, glob, flat, wire=wire, divisor=divisor), engine
    if engine is not None:
        def across(chunk):
            return (Allreduce(glob, mpi_buffer(chunk), op),) if topo.num_nodes > 1 else ()
        return engine.steps(flat, wire=wire, divisor=divisor, piece_elems=piece,
                            between=across), engine
    return _mpi_steps(private_dup(topo.local), glob, flat, wire=wire, divisor=divisor,
                      piece=piece), None


def hierarchical_allreduce(topo, tensor: torch.Tensor, *, average: bool = False,
                           compress: str | None = None, algorithm: str = "auto",
                           bucket_bytes: int | None = None,
                           chunk_elems: int | None = None) -> torch.Tensor:
    """Sum (or average over all ``topo.size`` ranks) ``tensor`` in place, node by node.

    Args:
        topo: a uniform :class:`~hpcasync.topology.Topology` (raises :class:`TopologyError` if not).
        tensor: contiguous tensor, same size and dtype on every rank.
        average: divide by ``topo.size`` (default False).
        compress: None, ``"bf16"`` or ``"fp16"`` (default None).
        algorithm: node-local stages: ``"auto"`` (shm window when possible, default), ``"shm"``,
            ``"mpi"``.
        bucket_bytes / chunk_elems: largest piece per pass (default: whole buffer / window).
    """
    steps, _ = hierarchical_steps(topo, tensor, average=average, compress=compress,
                                  algorithm=algorithm, bucket_bytes=bucket_bytes,
                                  chunk_elems=chunk_elems)
    run_blocking(steps)
    return tensor


def ihierarchical_allreduce(topo, tensor: torch.Tensor, *, average: bool = False,
                            compress: str | None = None, algorithm: str = "auto",
                            bucket_bytes: int | None = None, chunk_elems: int | None = None,
                            name: str = "", step: int | None = None) -> Handle:
    """Nonblocking :func:`hierarchical_allreduce`; returns a :class:`Handle`."""
    steps, engine = hierarchical_steps(topo, tensor, average=average, compress=compress,
                                       algorithm=algorithm, bucket_bytes=bucket_bytes,
                                       chunk_elems=chunk_elems)
    handle = Handle(steps, tensor, name=name, step=step)
    return engine.track(handle) if engine is not None else handle
