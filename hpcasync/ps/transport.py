"""How pushes and replies travel between the parameter server and its workers.

Two transports with one interface (the PS loop and the workers do not know which one they use):
``RMATransport`` (default, ``--ps-transport rma``: MPI one-sided communication, one slot per worker
in the PS's window, the reply written into the slot the gradient came in) and ``P2PTransport``
(``--ps-transport p2p``, module ``ps.p2p``: the two-sided baseline).

Nobody spins: every wait is ``Test`` + sleep with exponential backoff (20 µs doubling to 1 ms),
so an idle PS or a worker waiting for its reply leaves the core to the ranks that compute.

Example::

    t = make_transport("rma", comm, 0, numel)       # collective
    if t.is_ps: push = t.recv_push(); t.send_reply(push.worker, theta, version, True)
    else:       t.push(grad, version=v); head = t.recv_reply(local)

Differences from the reference PS designs (e.g. Li et al., "Scaling Distributed Machine Learning
with the Parameter Server", OSDI 2014, two-sided messages): the default is one-sided, and the PS
reuses each worker's gradient slot for its reply.

Design: docs/design/ps.md#transports (the RMA protocol, memory, preemption messages, failures).
"""
from __future__ import annotations

import torch

from .. import inject
from .memory import transport_bytes, worker_transport_bytes
from .p2p import P2PTransport, ReplyPool
from .wire import (_TAG_REPLY, KIND_DONE, KIND_FINISH, KIND_PEEK, KIND_PUSH, KIND_STOP, Push,
                   ReplyHeader, _Base, _np, _window_tensor, wait, wait_all)

__all__ = ["KIND_DONE", "KIND_FINISH", "KIND_PEEK", "KIND_PUSH", "KIND_STOP", "P2PTransport",
           "Push", "RMATransport", "ReplyHeader", "ReplyPool", "TRANSPORTS", "make_transport",
           "transport_bytes", "wait", "wait_all", "worker_transport_bytes"]


class RMATransport(_Base):
    """One-sided transport (docs/design/ps.md#transports). Collective construction and ``close``."""

    name = "rma"

    def __init__(self, comm, ps_rank: int, numel: int, *, extra: int = 0, reply_scalars: int = 0,
                 reply: str = "get", groups: int = 1, params: int = 0):
        super().__init__(comm, ps_rank, numel, extra=extra, reply_scalars=reply_scalars,
                         groups=groups, params=params)
        MPI = self.MPI
        if reply not in ("get", "put"):
            raise ValueError(f"reply must be 'get' or 'put', got {reply!r}")
        self.reply_mode = reply
        self.name = "rma" if reply == "get" else "rma-put"
        self.slot = numel + extra
        W = self.num_workers
        self._sizes = [W * self.slot * 4 if self.is_ps else 0, 0]      # bytes: in, out windows
        self.win_in = MPI.Win.Allocate(self._sizes[0], 4, comm=comm)
        self._in = _window_tensor(self.win_in)
        self.win_out = self._out = None         # get: the replies go into the gradient slots
        if reply == "put":
            self._sizes[1] = 0 if self.is_ps else numel * 4
            self.win_out = MPI.Win.Allocate(self._sizes[1], 4, comm=comm)
            self._out = _window_tensor(self.win_out)
        # the owner of window memory keeps a shared epoch open on it (for Win.Sync)
        if self.is_ps:
            self.win_in.Lock_all(MPI.MODE_NOCHECK)
        elif reply == "put":
            self.win_out.Lock_all(MPI.MODE_NOCHECK)
        self._note_bytes()

    def state_bytes(self) -> int:
        """Bytes of this rank's windows as allocated (the PS's slots; a worker's rma-put reply
        window); 0 once closed."""
        return sum(self._sizes)

    # PS side
    def recv_push(self) -> Push:
        return self.complete_push(*self.recv_header())

    def complete_push(self, w: int, h) -> Push:
        """The push whose header ``h`` came from worker ``w`` (:meth:`recv_push`'s second half;
        the sharded server's ordered receive calls it later, :mod:`.ordering`)."""
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
            if self.reply_mode == "get":            # into slot w: its gradient is consumed
                base = w * self.slot
                self._in[base: base + self.numel].copy_(params)
                self.win_in.Sync()
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
             **head) -> None:
        """Worker: send ``grad`` (and ``extra``) with a header of ``kind`` (``head``: the
        header's fields, :meth:`~.wire._Base._push_header`)."""
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
            if self.push_phase:
                inject.point(self.push_phase)
        req = self._push_header(kind, grad.numel(), **head)
        self.wait_time += wait(req)

    def recv_reply(self, out: torch.Tensor, poll=None) -> ReplyHeader:
        MPI = self.MPI
        req = self.comm.Irecv([self._head_out, MPI.DOUBLE], source=self.ps_rank, tag=_TAG_REPLY)
        self.wait_time += wait(req, poll=poll)
        if self.reply_mode == "get":                # from its own slot (design: ps.md#transports)
            self.win_in.Lock(self.ps_rank, MPI.LOCK_SHARED)
            self.win_in.Get([_np(out), MPI.FLOAT], self.ps_rank,
                            target=(self.worker * self.slot, self.numel, MPI.FLOAT))
            self.win_in.Unlock(self.ps_rank)
        else:
            self.win_out.Sync()
            out.copy_(self._out)
        return self._parse_reply()

    def close(self, collective: bool = True) -> None:
        """Collective: end the epochs and free the windows (``collective=False``, after a rank
        died: end the epochs and leave the windows to ``MPI_Finalize``)."""
        if self.is_ps:
            self.withdraw_headers()
            self.win_in.Unlock_all()
        elif self.reply_mode == "put":
            self.win_out.Unlock_all()
        self._in = self._out = None
        self._sizes = [0, 0]
        if collective:
            self.win_in.Free()
            if self.win_out is not None:
                self.win_out.Free()


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
