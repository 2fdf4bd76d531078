"""The wire layer shared by the parameter-server transports (``ps.transport``, ``ps.p2p``).

Message kinds and tags, the push and reply headers (:class:`Push`, :class:`ReplyHeader`), the
non-spinning waits (:func:`wait`: ``Test`` + sleep with exponential backoff), and :class:`_Base`,
the bookkeeping every transport shares (communicator, worker numbering, headers, byte counters,
the worker-failure mapping, the end message, the memory counters). The protocol itself is
described in docs/design/ps.md#transports.

Example::

    seconds = wait(comm.Isend([buf, MPI.FLOAT], dest=0, tag=_TAG_GRAD))    # sleeps, never spins

Differences from a plain ``req.Wait()``: the backoff leaves the core to the ranks that compute
(4 ranks on 2 cores in the tests), at up to 1 ms of added latency per wait.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

# header sent with every push (float64): kind, version, loss, oracle loss, numel, last, stop, lr,
# momentum, weight decay (the worker's current hyperparameters: NaN when it sends none); with G
# param groups the weight decays of groups 1..G-1 and then their lrs follow (8 + 2G values); then
# the count of checkpoint requests the worker sent before this message (the server receives those
# from it before it handles the message: :mod:`.loop_checkpoint`); then, for a model of P
# parameters, which of them are frozen on the worker now (requires_grad=False), one bit each,
# BITS_PER_WORD to a float64 word (exact integers), ceil(P / BITS_PER_WORD) words
BITS_PER_WORD = 52
KIND_PUSH, KIND_PEEK, KIND_STOP, KIND_DONE, KIND_FINISH = 1, 2, 3, 4, 5
_PUSH_HEADER = 9
_TAG_PUSH, _TAG_GRAD, _TAG_EXTRA, _TAG_REPLY, _TAG_THETA, _TAG_END = (4101, 4102, 4103, 4104,
                                                                     4105, 4106)


def mask_words(flags) -> tuple[int, ...]:
    """``flags`` (one bool per parameter) as integers of :data:`BITS_PER_WORD` bits each."""
    flags = list(flags)
    return tuple(sum(1 << b for b, f in enumerate(flags[i: i + BITS_PER_WORD]) if f)
                 for i in range(0, len(flags), BITS_PER_WORD))


def mask_flags(words, n: int) -> list[bool]:
    """The ``n`` bools that :func:`mask_words` packed into ``words``."""
    return [bool((int(words[k // BITS_PER_WORD]) >> (k % BITS_PER_WORD)) & 1) for k in range(n)]


def wait_until(ready, *, first: float = 2e-5, cap: float = 1e-3, poll=None) -> float:
    """Call ``ready()`` until it is true without spinning: sleep 20 µs between calls, doubling up
    to ``cap`` (``poll()`` is called before each sleep). Returns the seconds spent waiting."""
    t0 = time.perf_counter()
    pause = first
    while not ready():
        if poll is not None:
            poll()
        time.sleep(pause)
        pause = min(cap, pause * 2)
    return time.perf_counter() - t0


def wait(req, status=None, **kw) -> float:
    """Complete ``req`` without spinning (:func:`wait_until` on ``req.Test``)."""
    return wait_until(lambda: req.Test(status), **kw)


def wait_all(reqs, **kw) -> float:
    return sum(wait(r, **kw) for r in reqs)


#: the end message's value that sends every worker out of the run for a grow-back (0: the
#: work is done, 1: a stop for a preemption; :mod:`.growth`)
END_GROW = 2


@dataclass
class Push:
    """One message received by the PS: what the worker sent (``grad``/``extra`` are views of
    transport memory, valid until the PS replies to that worker (rma writes the reply there) or
    takes the next push (p2p has one receive buffer), whichever comes first)."""
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
    lr: float | tuple = float("nan")            # the worker's learning rate (one per param group)
    momentum: float = float("nan")              # its momentum (one for every group)
    weight_decay: float | tuple = float("nan")  # its weight decay (one per param group)
    frozen: tuple[int, ...] = ()                # its frozen parameters now (:func:`mask_words`)
    requests: int = 0             # checkpoint requests it sent before this message (all so far)


@dataclass
class ReplyHeader:
    version: int
    accepted: bool
    scalars: tuple[float, ...]
    stop: bool = False            # the PS stops: this was the worker's last step


class _Base:
    """Shared bookkeeping: communicator, PS rank, worker numbering, headers, byte counters.

    Memory (``ps.memory``): :meth:`state_bytes` is what this rank's transport holds now (windows,
    gradient and reply buffers; the few-dozen-byte headers are not counted), ``peak_bytes`` the
    most it held so far, :meth:`bound_bytes` the most it can hold (``memory.transport_bytes``)."""

    name = "base"

    def __init__(self, comm, ps_rank: int, numel: int, *, extra: int = 0, reply_scalars: int = 0,
                 groups: int = 1, params: int = 0):
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
        self.groups = groups       # param groups: each push carries G lrs and weight decays
        self.mask_words = -(-params // BITS_PER_WORD)     # and P frozen-parameter bits
        self._head_in = np.zeros(_PUSH_HEADER + 2 * groups + self.mask_words, np.float64)
        self._head_out = np.zeros(3 + reply_scalars, np.float64)
        self._reply_heads = [np.zeros(3 + reply_scalars, np.float64)
                             for _ in range(self.num_workers)] if self.is_ps else []
        self.bytes_in = 0          # PS: payload bytes received (gradients, buffers)
        self.bytes_out = 0         # PS: payload bytes sent (replies)
        self.wait_time = 0.0       # seconds spent waiting (PS: idle; worker: for replies)
        self._end = np.zeros(1, np.float64)
        self.end_code = 0                   # the last end message (END_GROW: a grow-back)
        W = self.num_workers if self.is_ps else 0   # PS: a header receive per worker
        self._heads_in = [np.zeros_like(self._head_in) for _ in range(W)]
        self._head_reqs = [None] * W       # its posted receive (None: not posted)
        self._head_ready = [False] * W     # a withdrawn receive had a header: it is due
        self._head_dead = [False] * W      # no receive is posted for a dead worker
        self._head_next = 0                # the worker polled first (round robin)
        self.idle_hook = None      # PS: called while waiting for a header
        self.push_phase = "push"   # worker: the hpcasync.inject phase its pushes pass
        self.requests = 0          # worker: checkpoint requests sent so far (in every header)
        self.peak_bytes = 0        # the most state_bytes() has been (updated by subclasses)

    def state_bytes(self) -> int:
        """Bytes this rank's transport holds now (subclasses)."""
        raise NotImplementedError

    def bound_bytes(self) -> int:
        """The most this rank's transport can hold (``memory.transport_bytes``)."""
        from .memory import transport_bytes, worker_transport_bytes

        if self.is_ps:
            return transport_bytes(self.name, self.num_workers, self.numel, self.extra)
        return worker_transport_bytes(self.name, self.numel, self.extra)

    def memory_record(self, rule_bytes: int) -> dict:
        """PS: the memory fields of the run's records (``memory.memory_record``), with this
        transport's bound and measured peak; the buffer table is the server's N·extra floats."""
        from .memory import memory_record

        return memory_record(self.name, self.num_workers, self.numel, self.extra, rule_bytes,
                             peak=self.peak_bytes)

    def _note_bytes(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.state_bytes())

    def _failed(self, exc: BaseException):
        """PS: the :class:`WorkerFailed` for an MPI error that reports dead ranks (their worker
        indices), a ProcessFailedError for a revoked communicator (a sharded server's takeover),
        or ``exc`` itself for any other error. The caller raises it. The header receives of the
        dead workers are dropped: none is posted for them again."""
        from ..errors import ProcessFailedError
        from ..runtime.ft import WorkerFailed, failed_ranks

        if isinstance(exc, self.MPI.Exception) and \
                exc.Get_error_class() == getattr(self.MPI, "ERR_REVOKED", None):
            return ProcessFailedError("the server's communicator was revoked: a survivor began a "
                                      "takeover (ps.takeover)")
        ranks = failed_ranks(self.comm, exc)
        if ranks is None:
            return exc
        dead = [self.workers.index(r) for r in ranks if r in self.workers]
        for w in dead:
            self._head_dead[w] = True
            self._head_reqs[w] = None
        return WorkerFailed(dead)

    # -- PS side -------------------------------------------------------------------------------
    # One header receive per live worker, each from that worker alone, taken in turn (round
    # robin from the worker after the last one served). Not one receive from MPI_ANY_SOURCE:
    # under ULFM (Open MPI 5.0.11) such a receive can go on failing with
    # MPI_ERR_PROC_FAILED_PENDING at every test after the death it reports was acknowledged,
    # and a server spinning on it never serves again (docs/design/ps.md#header-receives).
    def receiving(self) -> bool:
        """PS: a header receive is posted and not yet completed."""
        return any(r is not None for r in self._head_reqs)

    def _post_header(self, w: int):
        req = self._head_reqs[w]
        if req is None and not self._head_dead[w]:
            req = self._head_reqs[w] = self.comm.Irecv(
                [self._heads_in[w], self.MPI.DOUBLE], source=self.workers[w], tag=_TAG_PUSH)
        return req

    def lost(self, w: int) -> bool:
        """PS: worker ``w`` was found dead (no header of it is received again)."""
        return self._head_dead[w]

    def poll_header(self) -> tuple[int, np.ndarray] | None:
        """PS: ``(worker, header)`` if a push header has arrived, else None (never waits). The
        header array is reused by that worker's next receive: copy it to keep it."""
        W = self.num_workers
        for k in range(W):
            w = (self._head_next + k) % W
            if self._head_ready[w]:
                self._head_ready[w] = False
            else:
                req = self._post_header(w)
                if req is None:
                    continue
                try:
                    if not req.Test():
                        continue
                except self.MPI.Exception as exc:
                    self._head_reqs[w] = None
                    raise self._failed(exc) from None
                self._head_reqs[w] = None
            self._head_next = (w + 1) % W
            return w, self._heads_in[w]
        return None

    def recv_header(self) -> tuple[int, np.ndarray]:
        """PS: wait for the next push's header; ``(worker, header)``. ``complete_push`` takes
        the rest (the ordered view of a sharded server calls the two apart, :mod:`.ordering`)."""
        got = None

        def arrived() -> bool:
            nonlocal got
            got = self.poll_header()
            return got is not None

        self.wait_time += wait_until(arrived, poll=self.idle_hook)
        return got

    def withdraw_headers(self) -> None:
        """PS: cancel the posted header receives (before a spawn, and at close). A receive that
        had already matched a header keeps it: :meth:`poll_header` returns it first."""
        for w, req in enumerate(self._head_reqs):
            if req is None:
                continue
            self._head_reqs[w] = None
            status = self.MPI.Status()
            try:
                req.Cancel()
                req.Wait(status)
            except self.MPI.Exception:          # its worker died: nothing to keep
                continue
            if not status.Is_cancelled():
                self._head_ready[w] = True

    def _make_push(self, w: int, h: np.ndarray, grad: torch.Tensor, extra: torch.Tensor) -> Push:
        numel = int(h[4])            # what the worker claims; the PS rejects numel != self.numel
        G = self.groups
        lr = float(h[7]) if G == 1 else (float(h[7]), *(float(x) for x in h[9 + G: 8 + 2 * G]))
        wd = float(h[9]) if G == 1 else tuple(float(x) for x in h[9: 9 + G])
        frozen = tuple(int(x) for x in h[9 + 2 * G:])
        return Push(worker=w, kind=int(h[0]), version=int(h[1]), loss=float(h[2]),
                    oracle_loss=float(h[3]), numel=numel, last=bool(h[5]), grad=grad, extra=extra,
                    stop=bool(h[6]), lr=lr, momentum=float(h[8]), weight_decay=wd, frozen=frozen,
                    requests=int(h[8 + 2 * G]))

    def _reply_header(self, w: int, version: int, accepted: bool, scalars,
                      stop: bool = False) -> np.ndarray:
        head = self._reply_heads[w]
        head[0], head[1], head[2] = version, float(accepted), float(stop)
        if self.reply_scalars:
            head[3:] = np.asarray(tuple(scalars), np.float64)[: self.reply_scalars]
        return head

    def send_end(self, w: int, stop: bool | int) -> None:
        """PS: tell worker ``w`` there is no more work, and whether the job stops (preemption;
        :data:`END_GROW`: every rank leaves the run for a grow-back, :mod:`.growth`)."""
        msg = np.array([float(stop)])
        try:
            self.wait_time += wait(self.comm.Isend([msg, self.MPI.DOUBLE], dest=self.workers[w],
                                                   tag=_TAG_END))
        except self.MPI.Exception as exc:
            raise self._failed(exc) from None

    # -- worker side ---------------------------------------------------------------------------
    def _push_header(self, kind: int, numel: int, *, version: int = 0, loss: float = math.nan,
                     oracle_loss: float = math.nan, last: bool = False, stop: bool = False,
                     lr=math.nan, momentum=math.nan, weight_decay=math.nan, frozen=()):
        """Worker: send the header of a message of ``kind`` (module comment: its layout)."""
        G, h = self.groups, self._head_in
        lrs = lr if isinstance(lr, (tuple, list)) else (lr,) * G
        wds = weight_decay if isinstance(weight_decay, (tuple, list)) else (weight_decay,) * G
        if len(lrs) != G or len(wds) != G:
            raise ValueError(f"a push carries {G} lrs and weight decays, got {len(lrs)} and "
                             f"{len(wds)}")
        h[:8] = (kind, version, loss, oracle_loss, numel, float(last), float(stop), lrs[0])
        h[8] = momentum
        h[9: 9 + G] = wds
        h[9 + G: 8 + 2 * G] = lrs[1:]
        h[8 + 2 * G] = self.requests
        h[9 + 2 * G:] = 0.0
        h[9 + 2 * G: 9 + 2 * G + len(frozen)] = frozen
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
        self.end_code = int(self._end[0])
        return bool(self._end[0])


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
