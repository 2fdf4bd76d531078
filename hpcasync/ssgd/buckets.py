"""Gradient buckets for SSGD, reduced while the backward pass still computes.

The flat gradient buffer ``FlatModel.grads`` holds the parameters in ``named_parameters()`` order;
backward produces their gradients roughly in *reverse* order (the last layer first). So buckets are
cut from the **end** of the buffer: walking the parameters backwards, a bucket closes once it holds
at least ``bucket_bytes`` bytes (a parameter is never split). Bucket 0 covers the last parameters,
the last bucket the first ones; each bucket is one contiguous range ``[lo, hi)`` of ``grads``.

For ranks i = 0 … N-1 and each bucket b the reduction is the same as for the whole buffer,
g_b ← (1/N)·Σ_i g_b^(i) — cutting only changes which elements travel together, never how one element
is summed, so every bucket is one ``allreduce(comm, grads[lo:hi], average=True, compress=…)``.

Example::

    red = BucketReducer(flat, comm, bucket_bytes=256 * 1024, overlap=True)
    loss.backward()                  # buckets start as their gradients complete
    red.finish()                     # all buckets averaged; flat.grads is the mean gradient

Design: docs/design/ssgd.md#buckets (overlap with a communication thread or with ``test()``
from the hooks, differences from DDP's and Horovod's reducers).
"""
from __future__ import annotations

import logging
import queue
import threading

import torch

from ..comm import allreduce, iallreduce
from ..errors import ConfigError
from .options import DEFAULT_PROGRESS, PROGRESS

log = logging.getLogger("hpcasync")

DEFAULT_BUCKET_BYTES = 256 * 1024     # with overlap: buckets start during backward
#: without overlap: one bucket up to Horovod's default fusion threshold (HOROVOD_FUSION_THRESHOLD,
#: 64 MiB). Reduced after backward, a bucket gains nothing from being small, and every extra
#: collective costs a latency -- milliseconds when ranks share cores.
FUSION_BYTES = 64 * 2**20


def default_bucket_bytes(overlap: bool) -> int:
    """The bucket size when none is given: small buckets to overlap, one fused bucket else."""
    return DEFAULT_BUCKET_BYTES if overlap else FUSION_BYTES


def bucket_ranges(offsets: list[int], numels: list[int], bucket_bytes: int,
                  itemsize: int = 4) -> list[tuple[int, int, list[int]]]:
    """Buckets as ``(lo, hi, param_indices)``, bucket 0 holding the last parameters.

    Walking parameters from the last to the first, a bucket is closed once it holds at least
    ``bucket_bytes`` (wire) bytes; ranges are contiguous, cover ``[0, total)`` and never split a
    parameter.
    """
    if bucket_bytes < 1:
        raise ConfigError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets, members, hi, size = [], [], None, 0
    for k in reversed(range(len(offsets))):
        if hi is None:
            hi = offsets[k] + numels[k]
        members.append(k)
        size += numels[k] * itemsize
        if size >= bucket_bytes:
            buckets.append((offsets[k], hi, members))
            members, hi, size = [], None, 0
    if members:
        buckets.append((offsets[members[-1]], hi, members))
    return buckets


class BucketReducer:
    """Average ``flat.grads`` bucket by bucket, overlapped with backward (see module doc).

    Args:
        flat: the :class:`~hpcasync.comm.FlatModel`.
        comm: communicator to average over.
        bucket_bytes: bucket size in bytes of float32 gradient (default 256 KiB).
        overlap: start buckets from gradient hooks on a communication thread (default True);
            False: reduce the same buckets in the same order in :meth:`finish`.
        compress: ``None``, ``"bf16"`` or ``"fp16"``: each bucket's wire format.
        progress: how communication advances during backward. ``"thread"`` (default): a
            communication thread runs each started bucket's blocking allreduce. ``"test"``: no
            thread; the hooks start ``iallreduce`` (MPI_Iallreduce) and call ``test()`` on the
            buckets in flight at every hook, ``finish()`` waits. Each mode's ``overlap=False`` runs
            the same call per bucket (blocking / nonblocking then wait), so on-vs-off stays bitwise
            within a mode; the two modes may differ in the last bits (Open MPI's blocking and
            nonblocking collectives use different algorithms).
        last_pass: callable, True when the backward now running is the last of the step
            (``backward_passes_per_step``); hooks of earlier passes only accumulate.
        average: average (default) or, False, sum the gradients (Horovod's ``op=Sum``).
        presence: optional callable returning, per parameter, 1.0 if it got a gradient on this
            rank this step, else 0.0. Then the bucket reduced last (it starts at offset 0) carries
            ``flat.presence`` in front of its gradients, filled just before it starts: after
            :meth:`finish`, ``flat.presence[k] > 0`` iff parameter k got a gradient on some rank
            (DDP's "globally unused" map, at no extra message). When the last bucket starts every
            other bucket has started, so every parameter's presence is known by then.
        whole: optional callable ``whole(presence)`` that averages all of ``flat.grads`` at once
            in place of the buckets (``overlap=False`` only; PowerSGD, :mod:`.powersgd`), given
            ``flat.presence`` (or None) to sum along.

    Attributes: ``buckets`` (``(lo, hi, param_indices)``), ``events`` (when recording: a list of
    ``("ready", param_index)`` / ``("start", bucket)`` / ``("done", bucket)`` tuples of the current
    step, for tests), ``record`` (switch for ``events``).
    """

    def __init__(self, flat, comm, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 overlap: bool = True, compress: str | None = None,
                 progress: str = DEFAULT_PROGRESS, last_pass=lambda: True, average: bool = True,
                 presence=None, whole=None):
        if progress not in PROGRESS:
            raise ConfigError(f"progress must be one of {', '.join(PROGRESS)}, got {progress!r}")
        self.flat, self.comm, self.compress, self.progress = flat, comm, compress, progress
        self.average = average
        self._presence = presence
        self._whole = whole
        self._inflight = []             # progress="test": handles of started buckets
        numels = [int(torch.Size(s).numel()) for s in flat.shapes]
        self.overlap = bool(overlap) and (progress == "test" or self._threads_ok())
        self._last_pass = last_pass
        self.record, self.events = False, []
        self._views = [v for _, v in flat.views("grads")]
        self._hooks, self._thread, self._queue = [], None, None
        self._error: BaseException | None = None
        self.set_buckets(bucket_ranges(flat.offsets, numels, int(bucket_bytes)))
        if self.overlap:
            for k, p in enumerate(flat.parameters):
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(k)))

    def set_buckets(self, buckets: list) -> None:
        """Reduce in these buckets (``[(lo, hi, member indices), ...]``, as
        :func:`bucket_ranges` makes them; Horovod's ``groups=`` give their own), from the next
        step on."""
        self.buckets = buckets
        self._bucket_of = {k: b for b, (_, _, members) in enumerate(buckets) for k in members}
        self._reset()

    def _threads_ok(self) -> bool:
        from mpi4py import MPI

        if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
            return True
        log.warning("ssgd: MPI was initialised without THREAD_MULTIPLE: gradient buckets are "
                    "reduced after backward (no overlap)")
        return False

    # -- per step -------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._pending = [len(m) for _, _, m in self.buckets]
        self._seen = [False] * len(self.flat.shapes)
        self._next = 0                  # the next bucket to start (buckets start in index order)
        self._marked = False            # flat.presence filled for this step
        self._started = 0
        if self.record:
            self.events = []

    def _hook(self, k: int):
        view = self._views[k]

        def hook(p: torch.Tensor) -> None:
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)          # a zero_grad(set_to_none=True) detached it
                p.grad = view
            if not self._last_pass():
                return
            if self._seen[k]:
                raise ConfigError(f"ssgd: gradient of {self.flat.names[k]} computed twice in one "
                                  "step while its bucket is being reduced; use "
                                  "backward_passes_per_step or overlap=False")
            self._seen[k] = True
            if self.record:
                self.events.append(("ready", k))
            b = self._bucket_of[k]
            self._pending[b] -= 1
            if self._pending[b] == 0:
                self._start_ready()
            if self._inflight:
                self._poll()
        return hook

    def _poll(self) -> None:
        """progress="test": advance the nonblocking reductions in flight (in order)."""
        while self._inflight and self._inflight[0][1].test():
            b, _ = self._inflight.pop(0)
            if self.record:
                self.events.append(("done", b))
        for _, h in self._inflight:
            h.test()

    def _start_ready(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _mark(self) -> None:
        """Fill ``flat.presence`` for this step (once; before the last bucket starts and before
        any gradient is re-bound to the flat buffer)."""
        if self._presence is not None and not self._marked:
            self._marked = True
            self.flat.presence.copy_(torch.tensor(self._presence(), dtype=torch.float32))

    def _span(self, b: int) -> torch.Tensor:
        """What bucket b reduces: its range of ``grads``; the last one with ``presence`` ahead."""
        lo, hi, _ = self.buckets[b]
        if self._presence is not None and b == len(self.buckets) - 1:
            return self.flat.presence_and_grads[:self.flat.presence.numel() + hi]
        return self.flat.grads[lo:hi]

    def _launch(self, b: int) -> None:
        if b == len(self.buckets) - 1:
            self._mark()
        if self.record:
            self.events.append(("start", b))
        if self.progress == "test":
            self._inflight.append((b, self._start(b)))
            self._poll()
            return
        if self._thread is None:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._serve, name="hpcasync-ssgd-buckets",
                                            daemon=True)
            self._thread.start()
        self._started += 1
        self._queue.put(b)

    def _start(self, b: int):
        return iallreduce(self.comm, self._span(b), average=self.average,
                          compress=self.compress, name="ssgd-bucket", step=b)

    def _reduce(self, b: int) -> None:
        if self.progress == "test":
            self._start(b).wait()
        else:
            allreduce(self.comm, self._span(b), average=self.average,
                      compress=self.compress)
        if self.record:
            self.events.append(("done", b))

    def _serve(self) -> None:
        while True:
            b = self._queue.get()
            try:
                if b is None:
                    return
                if self._error is None:       # after an error, drain without communicating
                    self._reduce(b)
            except BaseException as exc:      # noqa: BLE001 (re-raised in the main thread)
                self._error = exc
            finally:
                self._queue.task_done()

    def finish(self) -> None:
        """Reduce every bucket of this step; on return ``flat.grads`` is averaged."""
        try:
            if self._next < len(self.buckets):
                self._mark()            # before _zero_missing/collect_grads re-bind gradients
            if self.overlap:
                if self._next < len(self.buckets):
                    self._zero_missing()
                    for b in range(self._next, len(self.buckets)):
                        self._launch(b)
                    self._next = len(self.buckets)
                self._wait_all()
                if self._error is not None:
                    err, self._error = self._error, None
                    raise RuntimeError(f"ssgd: bucket allreduce failed in the communication "
                                       f"thread: {err!r}") from err
            elif self._whole is not None:
                self.flat.collect_grads()
                self._whole(None if self._presence is None else self.flat.presence)
            else:
                self.flat.collect_grads()
                for b in range(len(self.buckets)):
                    if self.record:
                        self.events.append(("start", b))
                    self._reduce(b)
        finally:
            self._reset()

    def _zero_missing(self) -> None:
        """Parameters whose hook did not fire (no gradient this step, or set_to_none): their
        slots get this step's gradient or zero, as ``FlatModel.collect_grads`` does; buckets
        already in flight are not touched (their gradients are all views)."""
        for b in range(self._next, len(self.buckets)):
            for k in self.buckets[b][2]:
                p, view = self.flat._params[k], self._views[k]      # noqa: SLF001
                g = p.grad
                if g is None:
                    view.zero_()
                elif g.data_ptr() != view.data_ptr():
                    view.copy_(g)
                p.grad = view

    def _wait_all(self) -> None:
        if self._queue is not None:
            self._queue.join()
        while self._inflight:
            b, h = self._inflight.pop(0)
            h.wait()
            if self.record:
                self.events.append(("done", b))

    def discard(self) -> None:
        """Wait for buckets in flight and forget this step's progress (a backward that is not
        followed by a step, e.g. ``zero_grad()`` after an evaluation backward)."""
        self._wait_all()
        self._error = None
        self._reset()

    def set_comm(self, comm) -> None:
        """Reduce over ``comm`` from now on (the survivors' communicator after a ULFM recovery):
        requests in flight on the old, revoked communicator are abandoned, and this step's
        progress is forgotten."""
        self.comm = comm
        self._inflight = []
        self._error = None
        self._reset()

    def close(self) -> None:
        """Remove the hooks and stop the thread."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None
