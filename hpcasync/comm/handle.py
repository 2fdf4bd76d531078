"""One description of a reduction, two ways to run it: blocking, or as a :class:`Handle`.

Every reduction in :mod:`hpcasync.comm` is written once, as a generator of *steps*: local work
(copies, casts, sums) between the ``yield`` of each collective it needs. The generator yields a
tuple of collective descriptors (:class:`Barrier`, :class:`Allreduce`, ...); the driver either runs
them blocking in order (:func:`run_blocking`), or starts them all as nonblocking requests and
resumes the generator once they have completed (:class:`Handle`). So the nonblocking variant cannot
drift from the blocking one, and a blocking call still uses MPI's tuned blocking collectives (Open
MPI's nonblocking ``libnbc`` algorithms are slower).

Progress: like MPI itself without a progress thread, a nonblocking reduction moves on only inside
``test()``/``wait()`` (and other MPI calls of this process). Collectives that a generator issues
*after* its first step run on a private duplicate of the caller's communicator, so they can never
interleave with the caller's own collectives in a different order on different ranks.

Example::

    h = iallreduce(comm, grads, average=True, name="grads", step=12)
    ...                                   # compute
    grads = h.wait()                      # h.name == "grads", h.step == 12
"""
from __future__ import annotations

from typing import Callable, Iterator, NamedTuple

import torch


_in_place = None


def in_place():
    """``MPI.IN_PLACE`` (imported on first use: importing mpi4py.MPI initialises MPI)."""
    global _in_place
    if _in_place is None:
        from mpi4py import MPI
        _in_place = MPI.IN_PLACE
    return _in_place


class Barrier(NamedTuple):
    comm: object

    def run(self):
        self.comm.Barrier()

    def start(self):
        return self.comm.Ibarrier()


class Allreduce(NamedTuple):
    comm: object
    buf: list          # [numpy view, MPI datatype]
    op: object

    def run(self):
        self.comm.Allreduce(in_place(), self.buf, op=self.op)

    def start(self):
        return self.comm.Iallreduce(in_place(), self.buf, op=self.op)


class Started(NamedTuple):
    req: object        # an inactive persistent request (:mod:`.persistent`), started again

    def run(self):
        self.req.Start()
        self.req.Wait()

    def start(self):
        self.req.Start()
        return self.req


class ReduceScatter(NamedTuple):
    comm: object
    send: list         # [numpy view, MPI datatype] of the whole buffer
    recv: list         # [numpy view, MPI datatype] of this rank's piece
    counts: list
    op: object

    def run(self):
        self.comm.Reduce_scatter(self.send, self.recv, self.counts, op=self.op)

    def start(self):
        return self.comm.Ireduce_scatter(self.send, self.recv, self.counts, op=self.op)


class Allgatherv(NamedTuple):
    comm: object
    send: list         # [numpy view, MPI datatype] of this rank's piece
    recv: list         # [numpy view, (counts, displacements), MPI datatype]

    def run(self):
        self.comm.Allgatherv(self.send, self.recv)

    def start(self):
        return self.comm.Iallgatherv(self.send, self.recv)


Steps = Iterator[tuple]


def _test_all(reqs: list) -> bool:
    """``MPI_Testall``; over persistent requests ``MPI_Test`` on each instead: MPICH 5.0.2's
    ``MPI_Testall`` raises MPI_ERR_IN_STATUS (every status MPI_SUCCESS) once a persistent
    collective has completed, its ``MPI_Test`` does not."""
    from mpi4py import MPI

    if any(isinstance(r, MPI.Prequest) for r in reqs):
        return all(r.Test() for r in reqs)
    return MPI.Request.Testall(reqs)


def run_blocking(steps: Steps) -> None:
    """Drive a step generator to its end with blocking collectives."""
    for colls in steps:
        for coll in colls:
            coll.run()


class Handle:
    """An allreduce in flight: ``wait()`` returns the reduced tensor, ``test()`` says if it is done.

    Attributes: ``name`` and ``step`` (what the caller said it was, for logs and for matching the
    result to the step that started it), ``tensor`` (the tensor that receives the result) and
    ``done``. Waiting twice is harmless; until ``wait()``/``test()`` has returned done, the tensor's
    contents are undefined.
    """

    __slots__ = ("name", "step", "tensor", "done", "_steps", "_reqs", "_on_done")

    def __init__(self, steps: Steps, tensor: torch.Tensor, *, name: str = "",
                 step: int | None = None, on_done: Callable[[], None] | None = None):
        self.name, self.step, self.tensor = name, step, tensor
        self.done = False
        self._steps, self._reqs, self._on_done = steps, [], on_done
        self._advance()

    def _advance(self) -> None:
        """Resume the generator until it yields collectives (started here) or ends."""
        while True:
            try:
                colls = next(self._steps)
            except StopIteration:
                self._finish()
                return
            self._reqs = [c.start() for c in colls]
            if self._reqs:
                return

    def _finish(self) -> None:
        self.done, self._reqs, self._steps = True, [], None
        if self._on_done is not None:
            cb, self._on_done = self._on_done, None
            cb()

    def test(self) -> bool:
        """Make progress without blocking; True once the result is in ``tensor``."""
        while not self.done and _test_all(self._reqs):
            self._advance()
        return self.done

    def wait(self) -> torch.Tensor:
        """Block until the reduction is complete; returns ``tensor``."""
        from mpi4py import MPI

        while not self.done:
            MPI.Request.Waitall(self._reqs)
            self._advance()
        return self.tensor

    def __repr__(self) -> str:
        state = "done" if self.done else "in flight"
        return f"Handle(name={self.name!r}, step={self.step}, numel={self.tensor.numel()}, {state})"
