"""One global order of pushes for a sharded parameter server (``ps_ranks`` K > 1).

Shard 0's server is the sequencer: for every push header it receives it tells servers 1..K-1
which worker's push comes next (one 8-byte message each, sent before it applies the push), and
they apply pushes in exactly that order, so every shard computes the order-dependent scalars
(SHAT's α, LC-ASGD's prediction, SMEGA2's cycle, the warm-up clock) from the same history and K
shards give bitwise the single server's θ (``tests/mpi/test_ps_shard_order.py``)::

    transport = ordered(opt.transport, opt.layout)    # what ParameterServer.make_server does
    PSServer(transport, rule, ...)                    # the server loop is unchanged

Design: docs/design/ps.md#push-order (why, how a server s > 0 waits, cost, what is not ordered).
"""
from __future__ import annotations

import collections
import time

import numpy as np

from ..errors import ProcessFailedError, proc_failure
from .shards import ShardError
from .wire import KIND_PUSH

_TAG_ORDER = 4192          # server 0 -> server s > 0: the worker whose push comes next


def ordered(transport, layout):
    """``transport`` itself with one server; else the ordered view of it
    (docs/design/ps.md#push-order)."""
    if layout.K == 1 or layout.shard < 0:
        return transport
    cls = OrderLeader if layout.shard == 0 else OrderFollower
    return cls(transport, layout)


class _Ordered:
    """Everything but ``recv_push`` is the wrapped transport's."""

    def __init__(self, transport, layout):
        from mpi4py import MPI

        self.MPI, self.inner, self.layout = MPI, transport, layout
        self.comm = layout.comm            # the job's communicator: server ranks talk on it

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)

    def __setattr__(self, name, value):
        if name in ("MPI", "inner", "layout", "comm") or name.startswith("_o"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)


class OrderLeader(_Ordered):
    """Shard 0's server: receives as usual and announces each push's worker to the others."""

    def __init__(self, transport, layout):
        super().__init__(transport, layout)
        object.__setattr__(self, "_osends", collections.deque())

    def recv_push(self):
        w, h = self.inner.recv_header()
        if int(h[0]) == KIND_PUSH:
            buf = np.array([w], np.int64)
            for server in self.layout.servers[1:]:
                self._osends.append((self.comm.Isend([buf, self.MPI.INT64_T], dest=server,
                                                     tag=_TAG_ORDER), buf))
            while self._osends and self._osends[0][0].Test():
                self._osends.popleft()
        return self.inner.complete_push(w, h)

    def finish(self, collective: bool = True) -> None:
        """At close: complete the announcements (each one is taken by its follower, which
        applies every push shard 0 announced before it ends; 60 s without that is a bug)."""
        if not collective:
            return
        t0 = time.monotonic()
        while self._osends:
            if self._osends[0][0].Test():
                self._osends.popleft()
            elif time.monotonic() - t0 > 60:
                raise ShardError(f"shard servers {self.layout.servers[1:]} did not take "
                                 f"{len(self._osends)} push announcements of shard 0 in 60 s: "
                                 "the shards disagree on the pushes they took")
            else:
                time.sleep(1e-3)


class OrderFollower(_Ordered):
    """Server s > 0: applies pushes in shard 0's order (docs/design/ps.md#push-order)."""

    def __init__(self, transport, layout):
        super().__init__(transport, layout)
        object.__setattr__(self, "_obuf", np.zeros(1, np.int64))
        object.__setattr__(self, "_oreq", None)
        object.__setattr__(self, "_onext", None)       # the worker whose push is due
        object.__setattr__(self, "_oheld", {})         # worker -> its push header, not yet due

    def _announced(self) -> bool:
        if self._onext is not None:
            return True
        if self._oreq is None:
            self._oreq = self.comm.Irecv([self._obuf, self.MPI.INT64_T],
                                         source=self.layout.servers[0], tag=_TAG_ORDER)
        try:
            if not self._oreq.Test():
                return False
        except self.MPI.Exception as exc:
            if not proc_failure(exc):
                raise
            # shard 0's server died (ULFM): this server joins the takeover (ps.runtime)
            raise ProcessFailedError(f"the parameter server (rank {self.layout.servers[0]}) died "
                                     "(shard 0, which orders the pushes)",
                                     [self.layout.servers[0]]) from None
        self._oreq, self._onext = None, int(self._obuf[0])
        return True

    def recv_push(self):
        t, pause = self.inner, 2e-5
        t0 = time.perf_counter()
        while True:
            if self._announced() and self._onext in self._oheld:
                w = self._onext
                self._onext = None
                t.wait_time += time.perf_counter() - t0
                return t.complete_push(w, self._oheld.pop(w))
            if self._onext is not None and t.lost(self._onext):
                # announced by shard 0, then found dead here before its header came: it never
                # comes (shard 0 took the push, this shard drops it, as a dead worker's in-flight
                # push); the next announcement is due
                self._onext = None
                continue
            got = t.poll_header()
            if got is not None:
                w, h = got
                if int(h[0]) != KIND_PUSH:
                    t.wait_time += time.perf_counter() - t0
                    return t.complete_push(w, h)
                if w in self._oheld:
                    raise RuntimeError(f"shard {self.layout.shard}: worker {w} pushed again before "
                                       "its previous push was applied (a worker must wait for "
                                       "every reply)")
                self._oheld[w] = h.copy()
                pause = 2e-5
                continue
            if t.idle_hook is not None:
                t.idle_hook()
            time.sleep(pause)
            pause = min(1e-3, pause * 2)

    def finish(self, collective: bool = True) -> None:
        """At close: withdraw the receive posted for an announcement that will not come."""
        if self._oreq is not None:
            self._oreq.Cancel()
            self._oreq.Wait()
            self._oreq = None
