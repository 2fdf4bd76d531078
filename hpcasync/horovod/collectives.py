"""Horovod's collectives on torch tensors, over the facade's MPI communicator.

Every collective is one MPI call on a host copy of the tensor (CUDA tensors are copied to the host
and the result back, as hpcasync's comm layer stages them). The ``_async`` forms start a
nonblocking MPI collective and return an integer handle for :func:`synchronize` / :func:`poll`;
the blocking forms are the async ones waited at once. In-place forms (``allreduce_``,
``broadcast_``, ...) write the result into the tensor given; the others return a new tensor and
leave the input alone.

Semantics follow ``horovod.torch`` 0.28.1 (the tests compare each call with real Horovod):

* reductions: ``op`` Average (default), Sum, Min, Max, Product, Adasum (:mod:`.adasum`: Horovod's
  tree over a power-of-two number of ranks); Average is the sum scaled by
  ``postscale_factor / size`` after the reduction, ``prescale_factor`` scales each rank's input
  before it; integer tensors are scaled in float64 and truncated toward zero. float16/bfloat16 are
  summed with hpcasync's 16-bit MPI op (float32 arithmetic, one rounding per addition; MPI has no
  16-bit type), their min/max/product reduced in float32 and rounded once;
* ``allgather`` concatenates along dim 0 (first dimensions may differ); ``alltoall`` sends
  ``splits[i]`` rows to rank i (default: equal parts) and returns ``(output, received_splits)``
  when ``splits`` was given, else the output; ``reducescatter`` gives rank r rows
  ``[r·n/size …]`` of the reduced tensor, the first ``n mod size`` ranks one row more;
* ``grouped_allgather`` / ``grouped_reducescatter`` (and ``_async``): the list agreed once, one
  MPI call per tensor; ``synchronize`` of a grouped handle gives a tuple, as Horovod's;
* ``process_set=`` (:mod:`.process_sets`): the collective runs on the set's communicator;
  ``root_rank`` is a global rank; a rank outside the set gets Horovod's ValueError at once;
* ``allreduce``, ``allgather``, ``broadcast``, ``alltoall`` and ``reducescatter`` (out-of-place)
  are differentiable with Horovod's backward passes, including its convention that the gradient
  of ``allgather`` is the *average* of the incoming gradients over ranks (not their sum), that of
  an averaging ``reducescatter`` the gathered gradient (not divided by size), and that of
  ``broadcast`` the average on the root and zero elsewhere.

Agreement (:mod:`.agree`): before its data moves, every collective checks across ranks that
kind, name, op, dtypes, shapes, root and scale factors agree, and raises Horovod's
``HorovodInternalError`` ("Mismatched ...") on every rank when they do not; ``join()`` has
Horovod's semantics (joined ranks contribute zeros to allreduces). Unnamed collectives run in the
order each rank submits them (MPI's rule). A named collective (``name=``) is matched by its
Horovod name (``allreduce.<name>``, ``grouped_allreduce.<name>_1of<n>``, ``allgather.<name>``, ...)
as Horovod's coordinator matches it: where the other ranks are in other collectives its ``_async``
call returns at once and the collective starts when every rank has submitted that name
(:mod:`.agree`); ``poll`` of it exchanges once with the other ranks (it blocks until each is in a
facade call), ``synchronize`` waits. A second collective with the Horovod name of one not yet
synchronized raises Horovod's ValueError at once, on that rank. ``reducescatter`` with an op other
than Average or Sum raises Horovod's HorovodInternalError at once ("Reducescatter currently only
supports AVERAGE and SUM."), a scalar its ValueError. The ``_async`` forms otherwise return once
every rank has submitted theirs (then the data moves in the background).
"""
from __future__ import annotations

import itertools
import warnings

import torch

from . import agree as _agree
from . import timeline as _timeline
from .agree import Desc, HorovodInternalError
from .basics import _state
from .compression import Compression
from .process_sets import resolve as _resolve

# Horovod's op constants (horovod.common.basics: Average=0, Sum=1, Adasum=2, Min=3, Max=4,
# Product=5)
Average, Sum, Adasum, Min, Max, Product = range(6)
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
             Product: "Product"}
_HALF = (torch.float16, torch.bfloat16)
#: op -> the function that runs that reduction instead of an MPI op (``Adasum``: :mod:`.adasum`
#: registers itself; the package imports it)
OWN_OPS: dict = {}


# -- handles --------------------------------------------------------------------------------------

class _Work:
    """A collective in flight: MPI requests, then ``finish()`` makes the result (``post`` of it,
    when set: the single-tensor forms take the list's only item). ``parked``: the
    :class:`.agree.Pending` of a named collective not started yet (its requests come when it
    starts)."""

    __slots__ = ("name", "requests", "finish", "result", "done", "keep", "post", "parked")

    def __init__(self, name, requests, finish, keep=(), parked=None):
        self.name, self.requests, self.finish = name, requests, finish
        self.result, self.done = None, False
        self.keep = keep            # the buffers MPI reads/writes until the requests complete
        self.post, self.parked = None, parked

    def started(self, wait: bool = True) -> bool:
        """True once the collective's MPI calls are posted: a parked one waits for the other
        ranks (``wait`` False: one exchange, as ``poll``); raises the error it got meanwhile."""
        if self.parked is None:
            return True
        if not _agree.settle(self.parked, not wait):
            return False
        inner = self.parked.result
        self.requests, self.finish, self.keep = inner.requests, inner.finish, inner.keep
        self.parked = None
        return True

    @_timeline.completes
    def complete(self):
        from mpi4py import MPI

        if not self.done:
            self.started()
            MPI.Request.Waitall(self.requests)
            result = self.finish()
            self.result = result if self.post is None else self.post(result)
            self.done, self.requests, self.keep = True, [], ()
        return self.result


_works: dict[int, _Work] = {}
_ids = itertools.count(1)
_names: set = set()             # keys of the collectives not yet synchronized (Horovod refuses a
                                # second collective of the same name while one is in flight)


def _key(name, process_set=None, prefix: str = "allreduce", count: int | None = None):
    """The key of a named collective: Horovod's tensor name (``<prefix>.<name>``; a grouped call of
    ``count`` tensors: its first tensor's, ``grouped_<prefix>.<name>_1of<count>``), within its
    process set; None for an unnamed one."""
    if name is None:
        return None
    op = f"{prefix}.{name}" if count is None else f"grouped_{prefix}.{name}_1of{count}"
    sid = getattr(process_set, "process_set_id", 0)
    return op if not sid else (sid, op)


def _fresh(key) -> None:
    """Horovod's check (local, before any exchange): one collective in flight per key."""
    if key is not None and key in _names:
        raise ValueError("Requested to allreduce, allgather, or broadcast a tensor with the same "
                         "name as another tensor that is currently being processed.  If you want "
                         "to request another tensor, use a different tensor name.")


def _submit(comm, key, desc: Desc, go) -> _Work:
    """``key`` not in flight here, ``desc`` agreed over ``comm`` (:mod:`.agree`), then ``go()``
    posts the MPI calls and returns the work; a named collective the other ranks have not reached
    is parked (its work starts later, in an exchange where every rank has its key)."""
    _fresh(key)
    got = _agree.agree(comm, desc, key=key, go=go, park=True)
    if got is True:
        return go()
    return _Work(key, [], None, parked=got)


def _allreduce_desc(name, op, tensors, prescale, postscale) -> Desc:
    return Desc("ALLREDUCE", name, op, [(_dt(t), tuple(t.shape)) for t in tensors], None,
                (float(prescale), float(postscale)), _dev(tensors[0]) if tensors else "cpu")


def _agree_allreduce(comm, key, name, op, tensors, prescale, postscale) -> None:
    """Horovod's checks before an Adasum allreduce: ``key`` (:func:`_key`) not in flight here,
    then name, op, dtypes, shapes, scale factors and device agreed over ``comm`` (not parked:
    Adasum's exchange runs at once)."""
    _fresh(key)
    _agree.agree(comm, _allreduce_desc(name, op, tensors, prescale, postscale))


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _dev(t: torch.Tensor) -> str:
    return t.device.type if isinstance(t, torch.Tensor) else "cpu"


@_timeline.submits
def _handle(work: _Work) -> int:
    h = next(_ids)
    if work.name is not None:
        _names.add(work.name)
    _works[h] = work
    return h


def poll(handle: int) -> bool:
    """True when the collective of ``handle`` has completed (``synchronize`` will not block); a
    parked one (the module doc) first exchanges once with the other ranks."""
    from mpi4py import MPI

    work = _works.get(handle)
    if work is None:
        raise ValueError(f"poll: unknown handle {handle!r}")
    try:
        if not work.started(wait=False):
            return False
    except Exception:               # noqa: BLE001 - it failed: synchronize raises the error
        return True
    return work.done or MPI.Request.Testall(work.requests)


def synchronize(handle: int):
    """Wait for the collective of ``handle``; returns its output (a tensor, or a tuple)."""
    work = _works.pop(handle, None)
    if work is None:
        raise ValueError(f"synchronize: unknown handle {handle!r} (already synchronized?)")
    _names.discard(work.name)
    return work.complete()


# -- helpers ----------------------------------------------------------------------------------------

def _comm(process_set, kind: str = "Allreduce"):
    """This rank's communicator of ``process_set`` (None: the global set); a rank outside the set
    gets Horovod's ValueError naming ``kind``."""
    return _resolve(process_set, kind)[0]


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``tensor`` (the buffer MPI reduces in place)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:                # Horovod's error; sparse tensors: sparse_allreduce_async
        raise ValueError(f"Tensor type {tensor.type()} is not supported.")
    return tensor.detach().to("cpu", copy=True).contiguous()


def _buf(t: torch.Tensor):
    """mpi4py buffer spec of CPU tensor ``t`` (16-bit floats as 2-byte integers)."""
    from mpi4py import MPI

    if t.dtype in _HALF:
        return [t.view(torch.int16).numpy(), MPI.INT16_T]
    if t.dtype == torch.bool:
        return [t.view(torch.uint8).numpy(), MPI.C_BOOL]
    return t.numpy()


def _mpi_op(op: int, dtype: torch.dtype):
    from mpi4py import MPI

    if op in (Average, Sum):
        if dtype in _HALF:
            from ..comm.ops import sum_op

            return sum_op(dtype)
        return MPI.SUM
    return {Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}[op]


def _scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``factor · t`` in place (integers in float64, truncated toward zero, as Horovod)."""
    if factor == 1.0:
        return t
    if t.dtype.is_floating_point:
        if t.dtype in _HALF:
            return t.copy_(t.float() * factor)
        return t.mul_(factor)
    return t.copy_((t.double() * factor).to(t.dtype))


def _check_op(op, average, default=Average):
    if average is not None:
        if op is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of "
                             "them.")
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning)
        op = Average if average else Sum
    op = default if op is None else op
    if op not in _OP_NAMES:
        raise ValueError(f"unknown reduction op {op!r}")
    return op


def _deliver(result: torch.Tensor, like: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The result on ``like``'s device: written into ``out`` (in-place forms) or a new tensor."""
    if out is not None:
        with torch.no_grad():
            out.copy_(result)
        return out
    return result.to(like.device) if like.device.type != "cpu" else result


# -- allreduce ---------------------------------------------------------------------------------------

def _start_allreduce(tensors, outs, op, prescale, postscale, name, process_set, check=True,
                     grouped=False):
    comm = _comm(process_set, "Allreduce")
    key = _key(name, process_set, "allreduce", len(tensors) if grouped else None)
    if op in OWN_OPS:                 # hvd.Adasum: its own exchange (.adasum)
        return OWN_OPS[op](comm, tensors, outs, prescale, postscale, name, process_set, check,
                           key=key)
    n = comm.Get_size()

    def go():
        from mpi4py import MPI

        bufs, reqs, casts = [], [], []
        for t in tensors:
            b = _scale(_host(t), prescale)
            cast = b.dtype in _HALF and op not in (Average, Sum)
            work = b.float() if cast else b
            bufs.append((b, work))
            casts.append(cast)
            bufs.append(_buf(work))
            reqs.append(comm.Iallreduce(MPI.IN_PLACE, bufs[-1], op=_mpi_op(op, work.dtype)))

        def finish():
            results = []
            for (b, work), cast, t, out in zip(bufs[0::2], casts, tensors, outs):
                if cast:
                    b.copy_(work)
                _scale(b, postscale / n if op == Average else postscale)
                results.append(_deliver(b, t, out))
            return results
        return _Work(key, reqs, finish)
    if not check:                     # a joined rank's zeros: the active ranks agreed already
        return go()
    return _submit(comm, key, _allreduce_desc(name, op, tensors, prescale, postscale), go)


def _first(work: _Work) -> _Work:
    """The single-tensor forms: the result is the list's only item."""
    work.post = lambda results: results[0]
    return work


def _tuple(work: _Work) -> _Work:
    """The grouped forms: ``synchronize`` gives a tuple, as Horovod's."""
    work.post = tuple
    return work


def _allreduce_one(tensor, out, average, name, op, prescale, postscale, process_set) -> int:
    return _handle(_first(_start_allreduce([tensor], [out], _check_op(op, average), prescale,
                                           postscale, name, process_set)))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None) -> int:
    return _allreduce_one(tensor, None, average, name, op, prescale_factor, postscale_factor,
                          process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None) -> int:
    return _allreduce_one(tensor, tensor, average, name, op, prescale_factor, postscale_factor,
                          process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, name, process_set):
        ctx.args = (op, prescale, postscale, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, prescale, postscale,
                                           process_set))

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        g = synchronize(allreduce_async(grad.contiguous(), None, None, op, prescale, postscale,
                                        process_set))
        return g, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """Reduce ``tensor`` over every rank and return the result (differentiable)."""
    op = _check_op(op, average)
    wire, ctx = compression.compress(tensor)
    out = _AllreduceFn.apply(wire, op, prescale_factor, postscale_factor, name, process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None) -> int:
    op = _check_op(op, average)
    tensors = list(tensors)
    return _handle(_start_allreduce(tensors, [None] * len(tensors), op, prescale_factor,
                                    postscale_factor, name, process_set, grouped=True))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None) -> int:
    op = _check_op(op, average)
    tensors = list(tensors)
    return _handle(_start_allreduce(tensors, tensors, op, prescale_factor, postscale_factor,
                                    name, process_set, grouped=True))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """:func:`allreduce` of each tensor of the list; returns the list of results."""
    wires, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    outs = [allreduce(w, average, name, Compression.none, op, prescale_factor, postscale_factor,
                      process_set) for w in wires]
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=None):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def _serve_allreduce(desc: Desc) -> None:
    """A joined rank's part in the active ranks' allreduce: zeros (Horovod's rule)."""
    zeros = [torch.zeros(shape, dtype=getattr(torch, dt)) for dt, shape in desc.specs]
    pre, post = desc.factors
    _start_allreduce(zeros, [None] * len(zeros), desc.op, pre, post, desc.name, None,
                     check=False).complete()


_agree.SERVE["ALLREDUCE"] = _serve_allreduce


# -- allgather ----------------------------------------------------------------------------------------

def _rows(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() else 1


def _start_allgather(tensors, name, process_set, grouped=False) -> _Work:
    """One agreement for the list, then one Iallgatherv per tensor; finish() gives the list."""
    comm = _comm(process_set, "Allgather")
    key = _key(name, process_set, "allgather", len(tensors) if grouped else None)
    srcs = [_host(t) for t in tensors]
    srcs = [s.reshape(1) if s.dim() == 0 else s for s in srcs]
    desc = Desc("ALLGATHER", name, None, [(_dt(s), s.dim(), tuple(s.shape[1:])) for s in srcs],
                device=_dev(tensors[0]) if tensors else "cpu")

    def go():
        every = comm.allgather([s.shape[0] for s in srcs])
        reqs, outs, keep = [], [], []
        for i, src in enumerate(srcs):
            rows = [e[i] for e in every]
            row = (max(1, src[0].numel()) if src.shape[0]
                   else int(torch.Size(src.shape[1:]).numel()))
            out = torch.empty((sum(rows), *src.shape[1:]), dtype=src.dtype)
            counts = [r * row for r in rows]
            displs = [sum(counts[:i]) for i in range(len(counts))]
            sendbuf, recvbuf = _buf(src), _buf(out)
            if isinstance(recvbuf, list):
                recvbuf = [recvbuf[0], (counts, displs), recvbuf[1]]
            else:
                recvbuf = [recvbuf, (counts, displs)]
            reqs.append(comm.Iallgatherv(sendbuf, recvbuf))
            outs.append(out)
            keep.append((src, sendbuf, recvbuf))
        return _Work(key, reqs, lambda: [_deliver(o, t, None) for o, t in zip(outs, tensors)],
                     keep=keep)
    return _submit(comm, key, desc, go)


def allgather_async(tensor, name=None, process_set=None) -> int:
    return _handle(_first(_start_allgather([tensor], name, process_set)))


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = _rows(tensor), process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        comm = _comm(ctx.process_set, "Allgather")
        reduced = synchronize(allreduce_async(grad.contiguous(), op=Average,   # as Horovod's
                                              process_set=ctx.process_set))
        rows = comm.allgather(ctx.rows)
        start = sum(rows[:comm.Get_rank()])
        return reduced.narrow(0, start, ctx.rows), None, None


def allgather(tensor, name=None, process_set=None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (differentiable)."""
    return _AllgatherFn.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=None) -> int:
    """:func:`allgather` of each tensor of the list, agreed once; ``synchronize`` gives a tuple."""
    return _handle(_tuple(_start_allgather(list(tensors), name, process_set, grouped=True)))


class _GroupedAllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.process_set = [_rows(t) for t in tensors], process_set
        return synchronize(grouped_allgather_async(list(tensors), name, process_set))

    @staticmethod
    def backward(ctx, *grads):
        comm = _comm(ctx.process_set, "Allgather")
        reduced = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], op=Average,
                                                      process_set=ctx.process_set))
        every, me = comm.allgather(ctx.rows), comm.Get_rank()
        starts = [sum(e[i] for e in every[:me]) for i in range(len(ctx.rows))]
        return (None, None, *[g.narrow(0, s, n) for g, s, n in zip(reduced, starts, ctx.rows)])


def grouped_allgather(tensors, name=None, process_set=None):
    """:func:`allgather` of each tensor of the list (one agreement; differentiable); a tuple, as
    Horovod's."""
    return _GroupedAllgatherFn.apply(name, process_set, *tensors)


# -- broadcast ----------------------------------------------------------------------------------------

def _root(process_set, root_rank):
    """``(communicator, root in it, problem)``: ``root_rank`` is a global rank (Horovod's rule)."""
    comm, ps = _resolve(process_set, "Broadcast", root_rank)
    if ps.process_set_id == 0:
        if not 0 <= root_rank < comm.Get_size():
            return comm, 0, f"broadcast: root_rank {root_rank} is not a rank of {comm.Get_size()}"
        return comm, root_rank, None
    if root_rank not in ps.ranks:
        return comm, 0, (f"broadcast received invalid root rank {root_rank} for provided "
                         "process set")
    return comm, ps.ranks.index(root_rank), None


def _start_broadcast(tensor, root_rank, name, process_set, out):
    comm, root, problem = _root(process_set, root_rank)
    key = _key(name, process_set, "broadcast")
    b = _host(tensor)

    def go():
        buf = _buf(b)
        req = comm.Ibcast(buf, root=root)
        return _Work(key, [req], lambda: _deliver(b, tensor, out), keep=(b, buf))
    return _handle(_submit(comm, key, Desc("BROADCAST", name, None, [(_dt(b), tuple(b.shape))],
                                           root_rank, device=_dev(tensor), problem=problem), go))


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> int:
    return _start_broadcast(tensor, root_rank, name, process_set, None)


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> int:
    return _start_broadcast(tensor, root_rank, name, process_set, tensor)


def broadcast_(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = synchronize(allreduce_async(grad.contiguous(), op=Average,
                                              process_set=ctx.process_set))
        if _state().comm.Get_rank() != ctx.root:          # a global rank, as Horovod's
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor (differentiable)."""
    return _BroadcastFn.apply(tensor, root_rank, name, process_set)


# -- alltoall ------------------------------------------------------------------------------------------

def alltoall_async(tensor, splits=None, name=None, process_set=None) -> int:
    comm = _comm(process_set, "Alltoall")
    n = comm.Get_size()
    key = _key(name, process_set, "alltoall")
    src = _host(tensor)
    send, problem = _splits(src, splits, n)

    def spec(t, rows):
        counts = [r * row for r in rows]
        displs = [sum(counts[:i]) for i in range(n)]
        b = _buf(t)
        return [b[0], (counts, displs), b[1]] if isinstance(b, list) else [b, (counts, displs)]

    row = int(torch.Size(src.shape[1:]).numel()) if src.dim() else 1

    def go():
        recv = comm.alltoall(send)
        out = torch.empty((sum(recv), *src.shape[1:]), dtype=src.dtype)
        bufs = (spec(src, send), spec(out, recv))
        req = comm.Ialltoallv(*bufs)
        received = torch.tensor(recv, dtype=torch.int32)
        return _Work(key, [req], lambda: (_deliver(out, tensor, None), received),
                     keep=(src, bufs))
    return _handle(_submit(comm, key, Desc("ALLTOALL", name, None,
                                           [(_dt(src), src.dim(), tuple(src.shape[1:]))],
                                           device=_dev(tensor), problem=problem), go))


def _splits(src: torch.Tensor, splits, n: int):
    """``(rows sent to each rank, problem)``; Horovod's rule: splits are 32-bit integers."""
    if src.dim() == 0:
        return None, "alltoall needs a tensor with at least one dimension"
    if splits is None:
        if src.shape[0] % n:
            return None, (f"alltoall: the first dimension ({src.shape[0]}) is not divisible by "
                          f"the number of ranks ({n}); pass splits")
        return [src.shape[0] // n] * n, None
    if torch.is_tensor(splits):
        ok = splits.dtype == torch.int32
        send = splits.tolist() if ok else None
    else:
        send = list(splits)
        ok = all(isinstance(s, int) and not isinstance(s, bool) for s in send)
    if not ok:
        return None, "alltoall expects splits to contain 32-bit integer elements."
    if len(send) != n or any(s < 0 for s in send) or sum(send) != src.shape[0]:
        return None, (f"alltoall: splits {send} must be {n} non-negative counts adding up to the "
                      f"first dimension {src.shape[0]}")
    return send, None


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, *unused):
        g, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received,
                                          process_set=ctx.process_set))
        return g, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Send ``splits[i]`` rows of ``tensor`` to rank i; returns the rows received, in rank order
    (and, when ``splits`` was given, how many came from each rank)."""
    return _AlltoallFn.apply(tensor, splits, name, process_set)


# -- reducescatter -----------------------------------------------------------------------------------

def _scatter_rows(rows: int, n: int) -> list[int]:
    return [rows // n + (1 if r < rows % n else 0) for r in range(n)]


def reducescatter_async(tensor, name=None, op=Average, process_set=None, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    return _handle(_first(_start_reducescatter([tensor], name, op, process_set, prescale_factor,
                                               postscale_factor)))


#: Horovod's refusal of any other reduction (raised at the call, before anything is sent)
_RS_OPS = "Reducescatter currently only supports AVERAGE and SUM."


def _start_reducescatter(tensors, name, op, process_set, prescale_factor, postscale_factor,
                         grouped=False):
    """One agreement for the list, then one Ireduce_scatter per tensor; finish() gives the
    list."""
    op = _check_op(op, None)
    comm = _comm(process_set, "Reducescatter")
    n = comm.Get_size()
    key = _key(name, process_set, "reducescatter", len(tensors) if grouped else None)
    problem = None
    if any(t.dim() == 0 for t in tensors):
        problem = "Reducescatter does not support scalar inputs"       # Horovod's text
    elif op not in (Average, Sum):
        raise HorovodInternalError(_RS_OPS)

    def go():
        from mpi4py import MPI

        reqs, outs, keep = [], [], []
        for tensor in tensors:
            src = _scale(_host(tensor), prescale_factor)
            rows = _scatter_rows(src.shape[0], n)
            row = int(torch.Size(src.shape[1:]).numel())
            out = torch.empty((rows[comm.Get_rank()], *src.shape[1:]), dtype=src.dtype)
            bufs = (_buf(src), _buf(out))
            if n > 1:
                reqs.append(comm.Ireduce_scatter(*bufs, recvcounts=[r * row for r in rows],
                                                 op=_mpi_op(op, src.dtype)))
            else:
                out.copy_(src)
            outs.append(out)
            keep.append((src, bufs))

        def finish():
            for out in outs:
                _scale(out, postscale_factor / n if op == Average else postscale_factor)
            return [_deliver(o, t, None) for o, t in zip(outs, tensors)]
        return _Work(key, reqs or [MPI.REQUEST_NULL], finish, keep=keep)
    return _submit(comm, key, Desc("REDUCESCATTER", name, op,
                                   [(_dt(t), tuple(t.shape)) for t in tensors], None,
                                   (float(prescale_factor), float(postscale_factor)),
                                   _dev(tensors[0]) if tensors else "cpu", problem), go)


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.op, ctx.process_set, ctx.scale = op, process_set, prescale * postscale
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale,
                                               postscale))

    @staticmethod
    def backward(ctx, grad):
        # Horovod's convention (its allgather backward averages): Sum's gradient is the gathered
        # gradient times size, Average's the gathered gradient itself; times pre- and postscale
        scale = ctx.scale * (_comm(ctx.process_set, "Reducescatter").Get_size()
                             if ctx.op == Sum else 1)
        g = allgather(grad.contiguous() * scale if scale != 1 else grad.contiguous(),
                      process_set=ctx.process_set)
        return g, None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=None,
                  prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:
    """Reduce ``tensor`` over every rank and keep this rank's rows (see the module doc)."""
    wire, ctx = compression.compress(tensor)
    out = _ReducescatterFn.apply(wire, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=None,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    """:func:`reducescatter` of each tensor of the list, agreed once; ``synchronize`` gives a
    tuple."""
    return _handle(_tuple(_start_reducescatter(list(tensors), name, op, process_set,
                                               prescale_factor, postscale_factor, grouped=True)))


class _GroupedReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale, postscale, *tensors):
        ctx.op, ctx.process_set, ctx.scale = op, process_set, prescale * postscale
        return synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set,
                                                       prescale, postscale))

    @staticmethod
    def backward(ctx, *grads):
        # as reducescatter's: the gathered gradients, times size for Sum, times the scales
        scale = ctx.scale * (_comm(ctx.process_set, "Reducescatter").Get_size()
                             if ctx.op == Sum else 1)
        grads = [g.contiguous() * scale if scale != 1 else g.contiguous() for g in grads]
        return (None,) * 5 + tuple(grouped_allgather(grads, process_set=ctx.process_set))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=None, prescale_factor=1.0, postscale_factor=1.0) -> list:
    """:func:`reducescatter` of each tensor of the list (one agreement; differentiable)."""
    wires, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    outs = _GroupedReducescatterFn.apply(name, op, process_set, prescale_factor,
                                         postscale_factor, *wires)
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


# -- barrier, join ------------------------------------------------------------------------------------

def barrier(process_set=None) -> None:
    comm = _comm(process_set, "Barrier")
    _agree.agree(comm, Desc("BARRIER"))
    comm.Barrier()


def join(device=-1) -> int:
    """A rank with no more data calls it; until every rank has, its part in the others'
    allreduces (and DistributedOptimizer steps) is zeros — Horovod's semantics (:mod:`.agree`).
    Returns the last rank to join, on every rank."""
    return _agree.join(_state().comm)
