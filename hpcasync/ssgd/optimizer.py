"""SSGD's optimizer: average gradients across ranks, then the user's optimizer step.

Every step, every rank averages its gradient with all the others', g ← (1/N)·Σ_i g^(i), and applies
the same local optimizer step, so replicas stay bitwise identical (invariant 3). The gradient's
path: ``loss.backward()`` writes into views of ``FlatModel.grads``; the buffer is cut into buckets
(contiguous ranges from its end, :mod:`.buckets`), each averaged by one allreduce — with
``overlap=True`` (the default on a GPU; off on the CPU, where it is slower: docs/design/ssgd.md)
started from gradient hooks while backward still runs, on a communication thread;
``synchronize()`` waits for them (and averages the BatchNorm buffers last) -> the user's
``optimizer.step()`` reads the averaged ``p.grad`` views. ``overlap=False`` reduces the same buckets
in the same order after backward: the results are bitwise those of the overlapped path.

Differences from Horovod's ``DistributedOptimizer`` (per-parameter hooks, fused on a timer by a
background thread) and DDP (bucket copies, 25 MiB buckets): see :mod:`.buckets`.
"""
from __future__ import annotations

import logging
import time

import torch

from ..comm import allreduce
from ..comm.broadcast import broadcast
from ..errors import ConfigError
from ..optim import AlgorithmOptimizer, as_flat
from ..passes import BackwardPasses
from ..topology import init_mpi
from .buckets import DEFAULT_PROGRESS, BucketReducer, default_bucket_bytes
from .powersgd import PowerSGD

log = logging.getLogger("hpcasync")


class DistributedOptimizer(AlgorithmOptimizer):
    """SSGD: wrap a torch optimizer so ``step()`` first averages gradients across ``comm``.

    Args:
        optimizer: the user's optimizer over the model's parameters (any torch optimizer).
        model: the model (an ``nn.Module``, flattened here; or its :class:`FlatModel`).
        comm: the communicator to average over (default: every rank, ``MPI.COMM_WORLD``).
        backward_passes_per_step: Horovod's meaning: the loop calls ``backward()`` this many
            times, then ``step()`` once; the gradients are summed locally, averaged over ranks in
            one allreduce, then the optimizer steps. A parameter whose gradient is computed more
            often before ``step()`` is a one-line error (as in Horovod); ``step()`` after fewer
            passes reduces what there is (as Horovod). With ``overlap`` a bucket starts on its
            parameters' last pass only.
        compress: ``None``, ``"bf16"`` or ``"fp16"``: the wire format of the allreduce;
            ``"powersgd"`` or a :class:`~hpcasync.ssgd.powersgd.PowerSGD` (its options): the
            gradient averaged as a low-rank approximation with error feedback, as DDP's
            ``powerSGD_hook`` (:mod:`.powersgd`; reduced after backward, not overlapped).
        average_buffers: average floating buffers (BatchNorm running statistics) in one more
            allreduce after the gradients' buckets, every step (default True: replicas stay
            bitwise identical, buffers included; the cost is the buffers' few bytes). False: only
            when :meth:`average_buffers` is called.
        overlap: True: start each gradient bucket's allreduce as soon as backward has produced
            all its gradients; False: the same buckets after backward, in ``step()`` (bitwise the
            same results). Default None = on when the model is on a GPU, off on the CPU: with
            the CPU computing backward, the communication thread competes with it for the core,
            and overlapped steps are slower than non-overlapped ones (figures:
            docs/design/ssgd.md). On a GPU the CPU is free to drive MPI while the device
            computes, which is what overlap is for.
        bucket_bytes: bucket size in bytes of float32 gradient. Default: 256 KiB with overlap
            (buckets start during backward; resnet20's 1.1 MB of gradient makes ~5), one bucket
            of up to 64 MiB without (Horovod's fusion threshold, as ``hpcasync.horovod``: after
            backward a small bucket only adds an allreduce latency: docs/design/ssgd.md).
        progress: ``"thread"`` (default: a communication thread runs the blocking allreduces) or
            ``"test"`` (nonblocking allreduces advanced from the gradient hooks); see
            :class:`~hpcasync.ssgd.buckets.BucketReducer`.

    It is a ``torch.optim.Optimizer`` whose ``param_groups``/``state`` are the wrapped optimizer's,
    so LR schedulers and ``state_dict`` work on it (:mod:`hpcasync.optim`).

    Example::

        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
        opt.broadcast_parameters(root=0)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    """

    algorithm = "ssgd"
    _warns_unused = False       # parameters with no gradient on any rank get p.grad = None
    _amp_supported = True       # GradScaler on the averaged gradients (step())

    def __init__(self, optimizer: torch.optim.Optimizer, model, comm=None, *,
                 backward_passes_per_step: int = 1, compress: str | None = None,
                 average_buffers: bool = True, overlap: bool | None = None,
                 bucket_bytes: int | None = None, progress: str = DEFAULT_PROGRESS):
        if (not isinstance(backward_passes_per_step, int) or isinstance(backward_passes_per_step, bool)
                or backward_passes_per_step < 1):
            raise ConfigError(f"backward_passes_per_step must be an integer >= 1, got "
                              f"{backward_passes_per_step!r}")
        powersgd = compress if isinstance(compress, PowerSGD) else \
            PowerSGD() if compress == "powersgd" else None
        if powersgd is None and compress not in (None, "bf16", "fp16"):
            raise ConfigError(f"compress must be None, 'bf16', 'fp16', 'powersgd' or a "
                              f"hpcasync.PowerSGD, got {compress!r}")
        if powersgd is not None and overlap:
            raise ConfigError("compress=powersgd compresses the whole gradient after backward: "
                              "overlap=True is not supported with it")
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int)
                                         or isinstance(bucket_bytes, bool) or bucket_bytes < 4):
            raise ConfigError(f"bucket_bytes must be an integer >= 4 (one float32), got "
                              f"{bucket_bytes!r}")
        self._wrap(as_flat(model), optimizer)
        if comm is None:
            comm = init_mpi().COMM_WORLD
        self.comm = comm
        self.powersgd = powersgd
        self.compress = None if powersgd is not None else compress
        self.sync_buffers = bool(average_buffers) and self.flat.buffer_numel > 0
        # backward passes counted per parameter (Horovod's meaning); their hooks are registered
        # before the reducer's, which read ``last`` (hooks of one tensor run in that order)
        grouped = {id(p) for g in self.param_groups for p in g["params"]}
        counted = [id(p) in grouped for p in self.flat.parameters]
        self._passes = BackwardPasses(self.flat, backward_passes_per_step, counted)
        self._none_if_unused = True    # zero_grad(set_to_none=...): torch's default
        self.steps = 0             # optimizer steps taken
        self.bytes_sent = 0        # payload bytes handed to allreduce by this rank
        self.comm_time = 0.0       # seconds spent in allreduce
        self._synchronized = False
        self._skip = False
        self._told_clip = False
        # a subclass with its own synchronize() (e.g. a hierarchical allreduce) must not have
        # the buckets started behind its back: no hooks for it
        if overlap is None:                     # auto: see the docstring
            overlap = self.flat.params.device.type == "cuda" and powersgd is None
        overlap = overlap and type(self).synchronize is DistributedOptimizer.synchronize
        if bucket_bytes is None:
            bucket_bytes = default_bucket_bytes(overlap)
        self.reducer = BucketReducer(
            self.flat, comm, bucket_bytes=bucket_bytes, overlap=overlap, compress=self.compress,
            progress=progress, last_pass=lambda: self._passes.last,
            presence=self._passes.presence, whole=self._whole_reduction())
        self.overlap = self.reducer.overlap

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes per ``step()`` (settable between steps, as Horovod's
        ``set_backward_passes_per_step``)."""
        return self._passes.passes

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
            raise ConfigError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        self._passes.passes = passes
        self._passes.reset()

    def passes_pending(self) -> int:
        """Backward passes counted since the last ``step()`` when the step takes several
        (``backward_passes_per_step`` > 1; else 0): a gradient accumulation in progress."""
        return self._passes.seen if self._passes.passes > 1 else 0

    @property
    def passes(self) -> int:
        """Backward passes seen this step (the most of any parameter)."""
        return self._passes.seen

    @classmethod
    def cli_keywords(cls, given: dict, topo=None) -> dict:
        """This class's constructor keywords for ``hpcasync train`` from ``given``: the values of
        its algorithm's registry :class:`~hpcasync.registry.Option` s that the command line
        gave, by their ``hyper`` names (an option not given is absent: the constructor's default
        applies). ``topo`` is the run's topology, or None for the check made before MPI starts
        (a bad value: a ConfigError). A method whose options are not its keywords one for one
        (DiLoCo's outer lr) overrides it."""
        return dict(given)

    def broadcast_parameters(self, root: int = 0) -> None:
        """Make every replica start from ``root``'s parameters and buffers (not from seeds)."""
        for tensor in (self.flat.params, self.flat.buffers):
            if tensor.numel():
                broadcast(self.comm, tensor, root=root)

    def synchronize(self) -> None:
        """Average the flat gradient buffer (and the float buffers, with ``average_buffers``)
        across ranks, in place: waits for the buckets started during backward and reduces the
        others (with ``overlap=False``: all of them, in the same order). Called by ``step()``.
        ``comm_time`` counts the time waited here (communication hidden behind backward is not).

        Parameters that got no gradient on any rank this step (``requires_grad=False``, unused
        by every rank's forward) end with ``p.grad = None``, so torch's optimizer leaves them and
        their state untouched, as it does in one process (after ``zero_grad(set_to_none=False)``
        they keep a zero gradient instead, as torch's would). A parameter used on some ranks only
        gets the average over all ranks, the others counting zero (as DDP)."""
        t0 = time.perf_counter()
        self._check_bound()       # before any collective: every rank stops at the same step
        self.reducer.finish()
        self.flat.collect_grads()  # (a no-op pointer check: the reducer re-bound every gradient)
        self._release_unused()
        wire = self.flat.numel
        if self.sync_buffers:     # the buffers' bucket, last: BatchNorm statistics of this step
            self.flat.buffer_wire.copy_(self.flat.buffers)
            allreduce(self._step_comm(), self.flat.buffer_wire, average=True,
                      compress=self.compress)
            self.flat.buffers.copy_(self.flat.buffer_wire)
            wire += self.flat.buffer_numel
        self.comm_time += time.perf_counter() - t0
        if self.powersgd is not None:           # (presence travels with its uncompressed part)
            wire += self.powersgd.sent_numel - self.flat.numel - self.flat.presence.numel()
        self.bytes_sent += wire * (2 if self.compress else 4)
        self._passes.reset()
        self._synchronized = True

    def _step_comm(self):
        """The ranks each step averages the buffers over: all of ``comm``. LocalSGD's family
        also averages its gradients over it, and None there is a local step (hierarchical
        DiLoCo: the node's ranks)."""
        return self.comm

    def _release_unused(self) -> None:
        """``p.grad = None`` where no rank got a gradient (``flat.presence`` after the last
        bucket); the next ``zero_grad()``/``synchronize()`` binds them to the flat buffer again."""
        if not self._none_if_unused:
            return
        for p, used in zip(self.flat.parameters, self.flat.presence.tolist()):
            if not used:
                p.grad = None

    def _check_skip(self) -> None:
        if not self._synchronized:
            log.warning("skip_synchronize() without synchronize(): gradients are not averaged")

    def step(self, closure=None):
        """Average the gradients (unless inside ``skip_synchronize()``), then the wrapped
        optimizer's step. Every call steps: accumulation is ``backward_passes_per_step``
        backward passes before one ``step()`` (Horovod's meaning).

        Under ``torch.amp.GradScaler`` the gradients are averaged first, as with Horovod::

            scaler.scale(loss).backward()
            opt.synchronize()
            scaler.unscale_(opt)                # optional (a clip of the average goes here)
            with opt.skip_synchronize():
                scaler.step(opt)                # every rank skips, or steps, alike
            scaler.update()

        ``scaler.step(opt)`` on gradients not averaged yet is a one-line error: the scaler's
        check would see each rank's own gradients, so one rank's inf would skip the step there
        only and give the ranks different scales."""
        if closure is not None:
            raise ConfigError("DistributedOptimizer.step does not take a closure")
        try:
            if not self._skip:
                if self.__dict__.get("found_inf") is not None:
                    raise ConfigError(
                        f"{self.algorithm}: GradScaler.step(opt) on gradients not averaged yet: "
                        "each rank would skip the step or not, and set its scale, on its own "
                        "gradients (an inf on one rank); average them first: opt.synchronize(); "
                        "scaler.unscale_(opt); then `with opt.skip_synchronize(): "
                        "scaler.step(opt)`; scaler.update()")
                self._note_local_clip()
                self.synchronize()
            else:
                self._check_bound()
                self.reducer.discard()
        except BaseException:
            self._passes.reset()    # the step is dropped; the next zero_grad() starts afresh
            self._amp_forget()
            raise
        self._passes.reset()
        self._synchronized = False
        if not self._amp_step():    # GradScaler: an inf in the averaged gradients on every rank
            return None
        self.steps += 1
        return self.optimizer.step()

    def _note_local_clip(self) -> None:
        """Say once (rank 0) when the gradients were changed in place between the last
        ``backward()`` and ``step()``: most often a norm clip, which then acts on each rank's
        local gradient before the average, where one process would clip the average. Seen
        when the gradients are the flat buffer's views (``opt.zero_grad()``, the usual) and
        not overlapped (with ``overlap`` the reductions themselves write the buffer during
        backward)."""
        if self._told_clip or self.overlap or not self._passes.changed_since_backward():
            return
        self._told_clip = True
        if self.comm.Get_rank() == 0:
            log.warning("%s: the gradients were changed between backward() and step() (a "
                        "clip_grad_norm_?): step() averages them across ranks after that, so a "
                        "clip there clips each rank's local gradient, not the average the "
                        "optimizer applies. To clip the average: opt.synchronize(); clip; then "
                        "`with opt.skip_synchronize(): opt.step()`", self.algorithm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffer (the gradients stay its views whatever ``set_to_none``
        says) and forget the backward passes counted so far, as torch's ``zero_grad`` drops the
        gradients. ``set_to_none`` decides what a parameter that then gets no gradient on any
        rank holds at ``step()``: None (torch's default; the optimizer skips it) or zeros."""
        self._check_bound()
        self.reducer.discard()    # a backward not followed by step(): wait for what it started
        self._passes.reset()
        self._none_if_unused = bool(set_to_none)
        self.flat.zero_grad()

    def close(self) -> None:
        """Remove the gradient hooks and stop the communication thread. Call it when done with an
        optimizer that other code outlives (otherwise the hooks keep it alive and its idle daemon
        thread waits until the process exits)."""
        self.reducer.close()
        self._passes.close()

    def set_comm(self, comm) -> None:
        """Average over ``comm`` from now on: after dead ranks were shrunk out of the world
        (ULFM, :meth:`hpcasync.runtime.elastic.FaultTolerance.reset`). The step in progress is dropped:
        call ``zero_grad()`` and redo its backward."""
        self.comm = comm
        self.reducer.set_comm(comm)
        self._passes.reset()
        self._synchronized = False

    def _whole_reduction(self):
        """The reduction of the whole gradient that replaces the buckets', or None (PowerSGD's;
        a subclass's own)."""
        return self._powersgd_reduce if self.powersgd is not None else None

    def _powersgd_reduce(self, presence) -> None:
        """The reducer's whole-buffer reduction with PowerSGD (trainable parameters only are
        compressed)."""
        views = [v for _, v in self.flat.views("grads")]
        self.powersgd.reduce(self.comm, self.flat.grads, views,
                             [p.requires_grad for p in self.flat.parameters], presence=presence)

    def average_buffers(self) -> None:
        """Average floating-point module buffers (BatchNorm running statistics) across ranks."""
        if self.flat.buffers.numel():
            allreduce(self.comm, self.flat.buffers, average=True)

    #: the inner optimizer's per-parameter state (momentum, Adam's moments) is each rank's own:
    #: the ranks step on their own gradients (local SGD, SlowMo, DiLoCo)
    own_optimizer_state = False

    def local_state_dict(self) -> dict | None:
        """This rank's own state, beside :meth:`state_dict` (what the replicas share): the inner
        optimizer's per-parameter state where each rank steps on its own gradient
        (:attr:`own_optimizer_state`) and PowerSGD's error-feedback memory; None where the ranks
        hold the same (plain SSGD). The CLI's checkpoints keep every rank's, and a resumed rank
        loads its own (:meth:`load_local_state_dict`): the resumed run is the uninterrupted one."""
        out = {}
        if self.own_optimizer_state:
            out["optimizer_state"] = self.optimizer.state_dict()["state"]
        if self.powersgd is not None and self.powersgd.error is not None:
            out["powersgd_error"] = self.powersgd.error
        return out or None

    def load_local_state_dict(self, local: dict | None) -> None:
        """Load what :meth:`local_state_dict` gave on this rank (after :meth:`load_state_dict`,
        whose inner optimizer state, another rank's, it replaces)."""
        if not local:
            return
        if "optimizer_state" in local:
            groups = self.optimizer.state_dict()["param_groups"]
            self.optimizer.load_state_dict({"state": local["optimizer_state"],
                                            "param_groups": groups})
        if "powersgd_error" in local and self.powersgd is not None:
            self.powersgd.load_local(local["powersgd_error"])

    def check_run_length(self, steps: int) -> None:
        """Said once on rank 0 when PowerSGD's plain start covers a run of ``steps`` steps per
        rank (the CLI's, before training): no step is compressed."""
        ps = self.powersgd
        if ps is not None and ps.start_iter >= steps and self.comm.Get_rank() == 0:
            log.warning("PowerSGD: the run's %d steps per rank are all inside its %d plain "
                        "steps first (start_iter, --powersgd-start-iter): no step is "
                        "compressed", steps, ps.start_iter)

    def _extra_state(self) -> dict:
        extra = {"steps": self.steps}
        if self.powersgd is not None:
            extra["powersgd"] = self.powersgd.state_dict()
        return extra

    def _load_extra(self, extra: dict) -> None:
        self.steps = int(extra.get("steps", 0))
        # (a state of another compression: PowerSGD's own state is kept, or left out, as DDP's
        # hook state is apart from the optimizer's)
        if self.powersgd is not None and "powersgd" in extra:
            self.powersgd.load_state_dict(extra["powersgd"])
