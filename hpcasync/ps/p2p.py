"""The two-sided parameter-server transport (``--ps-transport p2p``) and its reply pool.

A push is a header ``Isend`` followed by the gradient (and float buffers) ``Isend``; the PS
``Recv``s the gradient, after its header, into ONE buffer (it handles one push at a time, and a
push's gradient is used only until that worker is answered). A reply is a header and θ ``Isend``;
θ is sent from a copy (the rule's θ changes at the next push while the send may still be in
flight) taken from a :class:`ReplyPool`, where equal replies share one copy.

So the PS holds (n + e)·4 + R·n·4 bytes, R the copies alive (at most one reply in flight per
worker, so R ≤ N; small in practice: docs/design/ps.md#memory). ``peak_bytes`` records the most
it held.

Example (tests/test_ps_memory.py): ``t = P2PTransport(comm, 0, numel)``; the PS's
``t.send_reply(w, theta, version, True)`` to three workers at one version leaves
``t.pool.buffers == 1`` until they receive.

Differences from a textbook two-sided PS (e.g. the parameter servers of Li et al., OSDI 2014): one
receive buffer and pooled reply copies instead of per-worker buffers, since this PS serves pushes
one at a time.

Design: docs/design/ps.md#two-sided-transport (the reply pool).
"""
from __future__ import annotations

import weakref

import torch

from .. import inject
from .wire import (_TAG_EXTRA, _TAG_GRAD, _TAG_REPLY, _TAG_THETA, KIND_PUSH, Push, ReplyHeader,
                   _Base, _np, wait_all)


class _Copy:
    """One reply copy: its buffer, the version and source it was taken from, the sends using it
    (worker -> request)."""

    __slots__ = ("buf", "version", "src", "src_version", "users")

    def __init__(self, buf: torch.Tensor):
        self.buf, self.version, self.src, self.src_version = buf, -1, None, -1
        self.users: dict[int, object] = {}


class ReplyPool:
    """Copies of θ for replies in flight, shared by equal replies
    (docs/design/ps.md#two-sided-transport)."""

    def __init__(self, numel: int, *, spares: int = 1):
        self.numel, self.spares = numel, spares
        self._live: list[_Copy] = []
        self._spare: list[torch.Tensor] = []
        self.shared = 0             # replies that reused a copy in flight
        self.copies = 0             # replies that made a copy

    @property
    def buffers(self) -> int:
        """Copies allocated now (in flight + spare)."""
        return len(self._live) + len(self._spare)

    def nbytes(self) -> int:
        return self.buffers * self.numel * 4

    def take(self, params: torch.Tensor, version: int) -> _Copy:
        """A copy holding ``params`` (shared with an equal one in flight, else a fresh copy);
        the caller adds its send with :meth:`use`."""
        self.reap()
        for c in self._live:
            if c.version == version and self._same(c, params):
                self.shared += 1
                return c
        c = _Copy(self._spare.pop() if self._spare else torch.empty(self.numel))
        with torch.no_grad():
            c.buf.copy_(params)
        c.version, c.src, c.src_version = version, weakref.ref(params), params._version
        self._live.append(c)
        self.copies += 1
        return c

    @staticmethod
    def _same(c: _Copy, params: torch.Tensor) -> bool:
        if c.src is not None and c.src() is params and params._version == c.src_version:
            return True
        return torch.equal(params.detach().view(torch.int32), c.buf.view(torch.int32))  # bitwise

    def use(self, c: _Copy, worker: int, req) -> None:
        c.users[worker] = req

    def release(self, worker: int) -> None:
        """Worker ``worker``'s previous reply has left (or failed): drop its use."""
        for c in self._live:
            c.users.pop(worker, None)
        self._retire()

    def reap(self) -> None:
        """Drop the uses whose send has completed; retire the copies no send uses."""
        for c in self._live:
            for w, req in list(c.users.items()):
                try:
                    done = req.Get_status()
                except Exception:  # noqa: BLE001 - a failed send no longer reads the buffer
                    done = True
                if done:
                    del c.users[w]
        self._retire()

    def _retire(self) -> None:
        keep = []
        for c in self._live:
            if c.users:
                keep.append(c)
            elif len(self._spare) < self.spares:
                self._spare.append(c.buf)
        self._live = keep

    def clear(self) -> None:
        self._live, self._spare = [], []


class P2PTransport(_Base):
    """Two-sided baseline (docs/design/ps.md#transports)."""

    name = "p2p"

    def __init__(self, comm, ps_rank: int, numel: int, *, extra: int = 0, reply_scalars: int = 0,
                 groups: int = 1, params: int = 0):
        super().__init__(comm, ps_rank, numel, extra=extra, reply_scalars=reply_scalars,
                         groups=groups, params=params)
        W = self.num_workers if self.is_ps else 0
        self._grad = torch.zeros(numel + extra if self.is_ps else 0)
        self.pool = ReplyPool(numel) if self.is_ps else None
        self._pending: list[list] = [[] for _ in range(W)]
        self._note_bytes()

    def state_bytes(self) -> int:
        return self._grad.numel() * 4 + (self.pool.nbytes() if self.pool is not None else 0)

    def recv_push(self) -> Push:
        return self.complete_push(*self.recv_header())

    def complete_push(self, w: int, h) -> Push:
        """The push whose header ``h`` came from worker ``w``: its data is received now (it
        waits in MPI's queue until then; :mod:`.ordering` delays it)."""
        MPI = self.MPI
        buf = self._grad
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
            self.pool.release(w)
            raise self._failed(exc) from None
        self.pool.release(w)
        if (params.dtype != torch.float32 or params.numel() != self.numel
                or params.device.type != "cpu"):
            raise ValueError(f"a reply must be {self.numel} float32 values on the CPU, got "
                             f"{params.numel()} {params.dtype} on {params.device}")
        copy = self.pool.take(params, version)
        head = self._reply_header(w, version, accepted, scalars, stop)
        theta = self.comm.Isend([_np(copy.buf), MPI.FLOAT], dest=rank, tag=_TAG_THETA)
        self._pending[w] = [self.comm.Isend([head, MPI.DOUBLE], dest=rank, tag=_TAG_REPLY), theta]
        self.pool.use(copy, w, theta)
        self.bytes_out += self.numel * 4
        self._note_bytes()

    def push(self, grad: torch.Tensor, extra: torch.Tensor | None = None, *, kind: int = KIND_PUSH,
             **head) -> None:
        """Worker: send ``grad`` (and ``extra``) with a header of ``kind`` (``head``: the
        header's fields, :meth:`~.wire._Base._push_header`)."""
        MPI = self.MPI
        reqs = [self._push_header(kind, grad.numel(), **head)]
        if kind == KIND_PUSH:
            if self.push_phase:                 # here: after the header, before the data
                inject.point(self.push_phase)
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
        self.withdraw_headers()
        for reqs in self._pending:
            try:
                self.wait_time += wait_all(reqs)
            except self.MPI.Exception:          # a reply to a worker that died
                if collective:
                    raise
        self._pending = []
        self._grad = torch.zeros(0)
        if self.pool is not None:
            self.pool.clear()
