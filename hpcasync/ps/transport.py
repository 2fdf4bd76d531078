"""How pushes and replies travel between the parameter server and its workers.

Two transports with one interface (the PS loop and the workers do not know which one they use):

``RMATransport`` (default, ``--ps-transport rma``): MPI one-sided communication.
  * The PS allocates (``MPI.Win.Allocate``; size 0 on the workers) an *in* window with one slot
    per worker, ``[gradient | float buffers]`` (flat float32), and, with ``reply="get"`` (default),
    an *out* window with one reply slot per worker. Worker i only ever touches slot i.
  * Push: worker i ``Lock(ps, SHARED)`` / ``Put`` its gradient into slot i / ``Unlock`` (the data
    is complete at the target when Unlock returns), then sends a small header message (kind,
    version, loss, ...). Notification is two-sided: the header is what the PS waits on.
  * Reply: the PS copies θ into reply slot i and sends a header; the worker ``Get``s the slot.
    With ``reply="put"`` each worker owns a reply window instead and the PS ``Put``s θ into it:
    the copy then costs the PS's time instead of the worker's (``hpcasync bench ps`` compares).
  * Memory model: Open MPI's ``osc/sm`` gives a unified window; the owner of a window holds a
    ``Lock_all`` epoch for its lifetime and calls ``Win.Sync`` between its local accesses and the
    messages that order them against remote ones.

``P2PTransport`` (``--ps-transport p2p``): the two-sided baseline: the header and the gradient are
sent with ``Isend``, the PS ``Recv``s the gradient into a per-worker buffer and answers with
``Isend`` of a per-worker copy of θ.

Preemption (``ps.server``'s stop protocol): a push may carry a stop request; a reply carries a
stop flag (the third reply-header field); ``KIND_STOP`` is a stop request from a worker that has
finished its budget (header only), ``KIND_FINISH`` a worker saying it has no more pushes (header
only: a user's loop ends with ``ParameterServer.finish()``; the CLI's worker flags its last push
instead), ``KIND_DONE`` a worker's last message (header only; ``version`` is its step count), and :meth:`send_end` / :meth:`wait_end` the PS's "no more work" message with
the stop decision (the same on both transports: a small two-sided message).

Nobody spins: every wait is ``Test`` + sleep with exponential backoff (20 µs doubling to 1 ms),
so an idle PS or a worker waiting for its reply leaves the core to the ranks that compute.

Worker failure (``ft``): under ULFM a PS-side call that meets a dead worker raises
:class:`~hpcasync.runtime.ft.WorkerFailed` (its header or gradient never arrives: the push is
dropped; a reply or end message to it fails); the pending ``MPI_ANY_SOURCE`` header receive is kept
and reused. ``idle_hook`` (PS) is called while waiting for a header (the SIGTERM checkpoint);
``before_header`` (worker) after a push's data left and before its header (the kill hook).
``close(collective=False)`` leaves the windows to ``MPI_Finalize`` (a dead rank cannot free them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

# header sent with every push (float64): kind, version, loss, oracle loss, numel, last, stop, lr
# (the worker's current learning rate: NaN when it sends none)
KIND_PUSH, KIND_PEEK, KIND_STOP, KIND_DONE, KIND_FINISH = 1, 2, 3, 4, 5
_PUSH_HEADER = 8
_TAG_PUSH, _TAG_GRAD, _TAG_EXTRA, _TAG_REPLY, _TAG_THETA, _TAG_END = (4101, 4102, 4103, 4104,
                                                                     4105, 4106)


def wait(req, status=None, *, first: float = 2e-5, cap: float = 1e-3, poll=None) -> float:
    """Complete ``req`` without spinning: ``Test``, then sleep 20 µs doubling up to ``cap``
    (``poll()`` is called before each sleep). Returns the seconds spent waiting."""
    t0 = time.perf_counter()
    pause = first
    while not req.Test(status):
        if poll is not None:
            poll()
        time.sleep(pause)
        pause = min(cap, pause * 2)
    return time.perf_counter() - t0


def wait_all(reqs, **kw) -> float:
    return sum(wait(r, **kw) for r in reqs)


@dataclass
class Push:
    """One message received by the PS: what the worker sent (``grad``/``extra`` are views of
    transport memory, valid until the PS replies to that worker)."""
    worker: int
    kind: int
    version: int
    loss: float
    oracle_loss: float
    numel: int
    last: bool
    grad: torch.Tensor
    extra: torch.Tensor
    stop: bool = False            # the worker asks the PS to stop (it received a signal)
    lr: float = float("nan")      # the worker's learning rate (its optimizer's param group)


@dataclass
class ReplyHeader:
    version: int
    accepted: bool
    scalars: tuple[float, ...]
    stop: bool = False            # the PS stops: this was the worker's last step


class _Base:
    """Shared bookkeeping: communicator, PS rank, worker numbering, headers, byte counters."""

    name = "base"

    def __init__(self, comm, ps_rank: int, numel: int, *, extra: int = 0, reply_scalars: int = 0):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.ps_rank = ps_rank
        self.workers = [r for r in range(self.size) if r != ps_rank]
        self.num_workers = len(self.workers)
        self.is_ps = self.rank == ps_rank
        self.worker = -1 if self.is_ps else self.workers.index(self.rank)
        self.numel, self.extra, self.reply_scalars = numel, extra, reply_scalars
        self._head_in = np.zeros(_PUSH_HEADER, np.float64)
        self._head_out = np.zeros(3 + reply_scalars, np.float64)
        self._reply_heads = [np.zeros(3 + reply_scalars, np.float64)
                             for _ in range(self.num_workers)] if self.is_ps else []
        self.bytes_in = 0          # PS: payload bytes received (gradients, buffers)
        self.bytes_out = 0         # PS: payload bytes sent (replies)
        self.wait_time = 0.0       # seconds spent waiting (PS: idle; worker: for replies)
        self._end = np.zeros(1, np.float64)
        self._head_req = None      # PS: the header receive (kept when a failure interrupts it)
        self.idle_hook = None      # PS: called while waiting for a header
        self.before_header = None  # worker: called between a push's data and its header

    def _failed(self, exc: BaseException, *, keep_head: bool = False):
        """PS: the :class:`WorkerFailed` for an MPI error that reports dead ranks (their worker
        indices), or ``exc`` itself for any other error. The caller raises it."""
        from ..runtime.ft import WorkerFailed, failed_ranks, is_pending

        ranks = failed_ranks(self.comm, exc)
        if ranks is None:
            return exc
        if not (keep_head and is_pending(exc)):
            self._head_req = None
        return WorkerFailed([self.workers.index(r) for r in ranks if r in self.workers])

    # -- PS side -------------------------------------------------------------------------------
    def _recv_header(self) -> tuple[int, np.ndarray]:
        status = self.MPI.Status()
        if self._head_req is None:
            self._head_req = self.comm.Irecv([self._head_in, self.MPI.DOUBLE],
                                             source=self.MPI.ANY_SOURCE, tag=_TAG_PUSH)
        try:
            self.wait_time += wait(self._head_req, status, poll=self.idle_hook)
        except self.MPI.Exception as exc:
            raise self._failed(exc, keep_head=True) from None
        self._head_req = None
        src = status.Get_source()
        return self.workers.index(src), self._head_in

    def _make_push(self, w: int, h: np.ndarray, grad: torch.Tensor, extra: torch.Tensor) -> Push:
        numel = int(h[4])            # what the worker claims; the PS rejects numel != self.numel
        return Push(worker=w, kind=int(h[0]), version=int(h[1]), loss=float(h[2]),
                    oracle_loss=float(h[3]), numel=numel, last=bool(h[5]), grad=grad, extra=extra,
                    stop=bool(h[6]), lr=float(h[7]))

    def _reply_header(self, w: int, version: int, accepted: bool, scalars,
                      stop: bool = False) -> np.ndarray:
        head = self._reply_heads[w]
        head[0], head[1], head[2] = version, float(accepted), float(stop)
        if self.reply_scalars:
            head[3:] = np.asarray(tuple(scalars), np.float64)[: self.reply_scalars]
        return head

    def send_end(self, w: int, stop: bool) -> None:
        """PS: tell worker ``w`` there is no more work, and whether the job stops (preemption)."""
        msg = np.array([float(stop)])
        try:
            self.wait_time += wait(self.comm.Isend([msg, self.MPI.DOUBLE], dest=self.workers[w],
                                                   tag=_TAG_END))
        except self.MPI.Exception as exc:
            raise self._failed(exc) from None

    # -- worker side ---------------------------------------------------------------------------
    def _push_header(self, kind: int, version: int, loss: float, oracle_loss: float, last: bool,
                     numel: int, stop: bool = False, lr: float = float("nan")):
        h = self._head_in
        h[:] = (kind, version, loss, oracle_loss, numel, float(last), float(stop), lr)
        return self.comm.Isend([h, self.MPI.DOUBLE], dest=self.ps_rank, tag=_TAG_PUSH)

    def _parse_reply(self) -> ReplyHeader:
        h = self._head_out
        return ReplyHeader(int(h[0]), bool(h[1]), tuple(float(x) for x in h[3:]), bool(h[2]))

    def wait_end(self, request_stop=None) -> bool:
        """Worker, after its last push: wait for the PS's end message; returns its stop flag.
        While waiting, ``request_stop()`` is polled; the first time it is true a ``KIND_STOP``
        message asks the PS to stop the workers still training (sent at most once)."""
        req = self.comm.Irecv([self._end, self.MPI.DOUBLE], source=self.ps_rank, tag=_TAG_END)
        t0, pause, asked = time.perf_counter(), 2e-5, False
        while not req.Test():
            if not asked and request_stop is not None and request_stop():
                self.push(torch.zeros(0), kind=KIND_STOP)
                asked = True
            time.sleep(pause)
            pause = min(1e-3, pause * 2)
        self.wait_time += time.perf_counter() - t0
        return bool(self._end[0])


class RMATransport(_Base):
    """One-sided transport (see the module docstring). Collective construction and ``close``."""

    name = "rma"

    def __init__(self, comm, ps_rank: int, numel: int, *, extra: int = 0, reply_scalars: int = 0,
                 reply: str = "get"):
        super().__init__(comm, ps_rank, numel, extra=extra, reply_scalars=reply_scalars)
        MPI = self.MPI
        if reply not in ("get", "put"):
            raise ValueError(f"reply must be 'get' or 'put', got {reply!r}")
        self.reply_mode = reply
        self.name = "rma" if reply == "get" else "rma-put"
        self.slot = numel + extra
        W = self.num_workers
        self.win_in = MPI.Win.Allocate(W * self.slot * 4 if self.is_ps else 0, 4, comm=comm)
        if reply == "get":
            out_bytes = W * numel * 4 if self.is_ps else 0
        else:
            out_bytes = 0 if self.is_ps else numel * 4
        self.win_out = MPI.Win.Allocate(out_bytes, 4, comm=comm)
        self._in = _window_tensor(self.win_in)
        self._out = _window_tensor(self.win_out)
        # the owner of window memory keeps a shared epoch open on it (for Win.Sync)
        if self.is_ps:
            self.win_in.Lock_all(MPI.MODE_NOCHECK)
            if reply == "get":
                self.win_out.Lock_all(MPI.MODE_NOCHECK)
        elif reply == "put":
            self.win_out.Lock_all(MPI.MODE_NOCHECK)

    # PS side
    def recv_push(self) -> Push:
        w, h = self._recv_header()
        self.win_in.Sync()
        base = w * self.slot
        grad = self._in[base: base + self.numel]
        extra = self._in[base + self.numel: base + self.slot]
        if int(h[0]) == KIND_PUSH:
            self.bytes_in += self.slot * 4
        return self._make_push(w, h, grad, extra)

    def send_reply(self, w: int, params: torch.Tensor, version: int, accepted: bool,
                   scalars=(), stop: bool = False) -> None:
        MPI = self.MPI
        rank = self.workers[w]
        try:
            if self.reply_mode == "get":
                self._out[w * self.numel: (w + 1) * self.numel].copy_(params)
                self.win_out.Sync()
            else:
                self.win_out.Lock(rank, MPI.LOCK_SHARED)
                self.win_out.Put([_np(params), MPI.FLOAT], rank,
                                 target=(0, self.numel, MPI.FLOAT))
                self.win_out.Unlock(rank)
            self.bytes_out += self.numel * 4
            head = self._reply_header(w, version, accepted, scalars, stop)
            self.wait_time += wait(self.comm.Isend([head, MPI.DOUBLE], dest=rank,
                                                   tag=_TAG_REPLY))
        except MPI.Exception as exc:
            raise self._failed(exc) from None

    # worker side
    def push(self, grad: torch.Tensor, extra: torch.Tensor | None = None, *, kind: int = KIND_PUSH,
             version: int = 0, loss: float = float("nan"), oracle_loss: float = float("nan"),
             last: bool = False, stop: bool = False, lr: float = float("nan")) -> None:
        MPI = self.MPI
        if kind == KIND_PUSH:
            base = self.worker * self.slot
            n = min(grad.numel(), self.numel)   # a wrong length is sent in the header, not here
            self.win_in.Lock(self.ps_rank, MPI.LOCK_SHARED)
            self.win_in.Put([_np(grad[:n]), MPI.FLOAT], self.ps_rank, target=(base, n, MPI.FLOAT))
            if self.extra and extra is not None:
                self.win_in.Put([_np(extra), MPI.FLOAT], self.ps_rank,
                                target=(base + self.numel, self.extra, MPI.FLOAT))
            self.win_in.Unlock(self.ps_rank)
            if self.before_header is not None:
                self.before_header()
        req = self._push_header(kind, version, loss, oracle_loss, last, grad.numel(), stop, lr)
        self.wait_time += wait(req)

    def recv_reply(self, out: torch.Tensor, poll=None) -> ReplyHeader:
        MPI = self.MPI
        req = self.comm.Irecv([self._head_out, MPI.DOUBLE], source=self.ps_rank, tag=_TAG_REPLY)
        self.wait_time += wait(req, poll=poll)
        if self.reply_mode == "get":
            self.win_out.Lock(self.ps_rank, MPI.LOCK_SHARED)
            self.win_out.Get([_np(out), MPI.FLOAT], self.ps_rank,
                             target=(self.worker * self.numel, self.numel, MPI.FLOAT))
            self.win_out.Unlock(self.ps_rank)
        else:
            self.win_out.Sync()
            out.copy_(self._out)
        return self._parse_reply()

    def close(self, collective: bool = True) -> None:
        """Collective: end the epochs and free the windows (``collective=False``, after a rank
        died: end the epochs and leave the windows to ``MPI_Finalize``)."""
        if self.is_ps:
            self.win_in.Unlock_all()
            if self.reply_mode == "get":
                self.win_out.Unlock_all()
        elif self.reply_mode == "put":
            self.win_out.Unlock_all()
        self._in = self._out = None
        if collective:
            self.win_in.Free()
            self.win_out.Free()


class P2PTransport(_Base):
    """Two-sided baseline (see the module docstring)."""

    name = "p2p"

    def __init__(self, comm, ps_rank: int, numel: int, *, extra: int = 0, reply_scalars: int = 0):
        super().__init__(comm, ps_rank, numel, extra=extra, reply_scalars=reply_scalars)
        W = self.num_workers if self.is_ps else 0
        self._grads = torch.zeros(W, numel + extra)
        self._replies = torch.zeros(W, numel)
        self._pending: list[list] = [[] for _ in range(W)]

    def recv_push(self) -> Push:
        MPI = self.MPI
        w, h = self._recv_header()
        buf = self._grads[w]
        if int(h[0]) == KIND_PUSH:
            n = min(int(h[4]), self.numel)
            try:                        # a worker that dies mid-push: its push is dropped
                self.comm.Recv([_np(buf[:n]), MPI.FLOAT], source=self.workers[w], tag=_TAG_GRAD)
                if self.extra:
                    self.comm.Recv([_np(buf[self.numel:]), MPI.FLOAT], source=self.workers[w],
                                   tag=_TAG_EXTRA)
            except MPI.Exception as exc:
                raise self._failed(exc) from None
            self.bytes_in += (n + self.extra) * 4
        return self._make_push(w, h, buf[: self.numel], buf[self.numel:])

    def send_reply(self, w: int, params: torch.Tensor, version: int, accepted: bool,
                   scalars=(), stop: bool = False) -> None:
        MPI = self.MPI
        rank = self.workers[w]
        try:
            self.wait_time += wait_all(self._pending[w])     # the previous reply has left
        except MPI.Exception as exc:
            self._pending[w] = []
            raise self._failed(exc) from None
        self._replies[w].copy_(params)
        head = self._reply_header(w, version, accepted, scalars, stop)
        self._pending[w] = [
            self.comm.Isend([head, MPI.DOUBLE], dest=rank, tag=_TAG_REPLY),
            self.comm.Isend([_np(self._replies[w]), MPI.FLOAT], dest=rank, tag=_TAG_THETA)]
        self.bytes_out += self.numel * 4

    def push(self, grad: torch.Tensor, extra: torch.Tensor | None = None, *, kind: int = KIND_PUSH,
             version: int = 0, loss: float = float("nan"), oracle_loss: float = float("nan"),
             last: bool = False, stop: bool = False, lr: float = float("nan")) -> None:
        MPI = self.MPI
        reqs = [self._push_header(kind, version, loss, oracle_loss, last, grad.numel(), stop, lr)]
        if kind == KIND_PUSH:
            if self.before_header is not None:      # here: after the header, before the data
                self.before_header()
            n = min(grad.numel(), self.numel)
            reqs.append(self.comm.Isend([_np(grad[:n]), MPI.FLOAT], dest=self.ps_rank,
                                        tag=_TAG_GRAD))
            if self.extra:
                reqs.append(self.comm.Isend([_np(extra), MPI.FLOAT], dest=self.ps_rank,
                                            tag=_TAG_EXTRA))
        self.wait_time += wait_all(reqs)

    def recv_reply(self, out: torch.Tensor, poll=None) -> ReplyHeader:
        MPI = self.MPI
        reqs = [self.comm.Irecv([self._head_out, MPI.DOUBLE], source=self.ps_rank, tag=_TAG_REPLY),
                self.comm.Irecv([_np(out), MPI.FLOAT], source=self.ps_rank, tag=_TAG_THETA)]
        self.wait_time += wait_all(reqs, poll=poll)
        return self._parse_reply()

    def close(self, collective: bool = True) -> None:
        for reqs in self._pending:
            try:
                self.wait_time += wait_all(reqs)
            except self.MPI.Exception:          # a reply to a worker that died
                if collective:
                    raise
        self._pending = []


def make_transport(kind: str, comm, ps_rank: int, numel: int, **kw):
    """``kind`` ``"rma"`` (reply by Get), ``"rma-put"`` (reply by Put) or ``"p2p"``."""
    if kind == "rma":
        return RMATransport(comm, ps_rank, numel, reply="get", **kw)
    if kind == "rma-put":
        return RMATransport(comm, ps_rank, numel, reply="put", **kw)
    if kind == "p2p":
        return P2PTransport(comm, ps_rank, numel, **kw)
    raise ValueError(f"unknown transport {kind!r}")


TRANSPORTS = ("rma", "rma-put", "p2p")


def _window_tensor(win) -> torch.Tensor:
    mem = win.tomemory()
    if len(mem) == 0:
        return torch.zeros(0)
    return torch.from_numpy(np.frombuffer(mem, dtype=np.float32))


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU float32 tensor (MPI buffers)."""
    if t.device.type != "cpu":
        raise ValueError("PS transports move CPU tensors; copy device tensors to the host first")
    return t.detach().contiguous().numpy()
