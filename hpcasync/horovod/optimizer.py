"""``hvd.DistributedOptimizer``: the user's optimizer, its gradients averaged by hpcasync's SSGD —
or, with ``algorithm=``, any of the toolkit's algorithms.

The SSGD path (default): the returned object's class is a subclass of the user's optimizer class
(``isinstance(opt, torch.optim.SGD)`` holds; its ``param_groups`` and ``state`` are the user
optimizer's own objects), with Horovod's ``synchronize()`` / ``skip_synchronize()`` /
``set_backward_passes_per_step()`` and guards. Its parameters are flattened into one float32
buffer (:class:`hpcasync.comm.FlatModel` over a holder of the optimizer's parameters; the
Parameter objects stay the same) and the gradients are reduced by
:class:`hpcasync.ssgd.buckets.BucketReducer` — contiguous buckets of the flat gradient buffer,
started from gradient hooks during backward (``overlap``) or after it, as hpcasync's own SSGD does.
So the path from ``optimizer.step()`` to the wire is::

    step() -> synchronize() -> BucketReducer.finish() -> allreduce(comm, grads[lo:hi]) per bucket
           -> the user's optimizer class's step()

Where it differs from Horovod (``horovod/torch/optimizer.py``):

* fusion is by fixed contiguous buckets of the flat buffer (``bucket_bytes``: 256 KiB when
  overlapping, else 64 MiB, Horovod's fusion threshold), not Horovod's timed fusion buffer;
  ``overlap`` defaults to on for CUDA parameters and off on the CPU, where it is slower
  (``hpcasync.ssgd.DistributedOptimizer``); ``num_groups``/``groups`` make the buckets
  (each group one bucket; a group must be a contiguous run of parameters, else ConfigError);
* the flat buffer serves float32 parameters on one device with ``Compression.none/fp16/bf16``;
  any other dtype (float64, float16, bfloat16, mixed), several devices or a custom compressor
  take Horovod's own per-tensor path (:mod:`.per_tensor`: compress each gradient, one grouped
  allreduce in each tensor's dtype, decompress); frozen (``requires_grad=False``) parameters of
  other dtypes are left out;
* agreement (:mod:`.agree`): construction checks once that every rank has the same parameter
  layout (HorovodInternalError naming the parameter otherwise); each step exchanges 32 bytes so
  that a rank in ``hvd.join()`` contributes zeros to the step's buckets, as Horovod's does;
* ``zero_grad()`` zeroes the gradients in place (they stay views of the flat buffer) whatever
  ``set_to_none`` says;
* ``gradient_predivide_factor`` f is Horovod's: gradients scaled by 1/f before the sum and by
  f/size after it (then ``overlap`` is off: the scaling needs the whole gradient);
* ``op=hvd.Adasum`` returns Horovod's Adasum optimizer (:mod:`.adasum`), and sparse gradients are
  reduced as Horovod's are (:mod:`.sparse`).

``compress=hpcasync.PowerSGD(...)`` (or ``"powersgd"``; Horovod has no PowerSGD): the object
returned is hpcasync's SSGD with that compression (:func:`hpcasync.optimizer`, ``"ssgd"``, as
for another algorithm below); Horovod's ``compression``, ``op``, ``groups``, ``process_set`` and
more than one backward pass per step are one-line errors beside it.

``process_set=`` (:mod:`.process_sets`): the gradients are averaged over the set's ranks, on its
communicator; on a rank outside the set the optimizer reduces nothing and ``step()`` uses that
rank's own gradients, as Horovod's does (SSGD only: another ``algorithm`` raises
``NotImplementedError``).

Other algorithms (``algorithm="daso"``, ``"odsgd"``, a PS rule; or named at ``hvd.init``): the
object returned is the algorithm's optimizer from :func:`hpcasync.optimizer` (a
``torch.optim.Optimizer``, not the user's class) over the same parameters, hyperparameters taken
from the user's SGD and from the extra keywords. DASO needs ``epochs=`` and ``steps_per_epoch=``
(it closes each epoch itself after ``steps_per_epoch`` steps; pass ``step(loss=loss)`` to drive
its loss-plateau schedule, otherwise its knobs stay as given). A PS rule must be named at
``hvd.init(algorithm=...)`` (the server leaves the script there); without ``steps_per_epoch`` the
warm-up of smega2/dana/nag is off (logged once).
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import math
import warnings

import itertools
import weakref

import torch

from ..errors import ConfigError, proc_failure
from ..optim import unique_params
from ..ssgd.buckets import DEFAULT_PROGRESS, BucketReducer, default_bucket_bytes
from . import agree as _agree
from . import timeline as _timeline
from .adasum import distributed_optimizer as _adasum_optimizer
from .agree import Desc
from .basics import _state, require_algorithm
from .collectives import Adasum, Average, Sum
from .compression import BF16Compressor, Compression, FP16Compressor, NoneCompressor
from .per_tensor import PerTensorReducer
from .server import ParamHolder, send_spec, spec_of
from .sparse import SparseGrads

log = logging.getLogger("hpcasync")

_WIRE = {NoneCompressor: None, FP16Compressor: "fp16", BF16Compressor: "bf16"}
_SEQ = itertools.count()
_SEQS: dict = {}                # process set uid -> counter (the optimizers of a set, in order)
_LIVE: dict = {}                # "DistributedOptimizer.<k>" -> weakref, for a joined rank's part


def _serve_step(desc) -> None:
    """A joined rank's part in a DistributedOptimizer step of the active ranks: zeros."""
    ref = _LIVE.get(desc.name)
    opt = ref() if ref is not None else None
    if opt is None:
        raise _agree.HorovodInternalError(f"{desc.name} stepped on other ranks but is gone here")
    opt._hvd_serve_zeros()


_agree.SERVE["OPTIMIZER"] = _serve_step
_agree._NOT_WITH_JOIN["OPTIMIZER-INIT"] = ("DistributedOptimizer construction is not supported "
                                           "with Join at this time.")


class _HorovodOptimizer:
    """Mixed in before the user's optimizer class (see the module doc)."""

    _hvd_facade = True

    def _hvd_setup(self, named, compression, passes, op, overlap, bucket_bytes, progress,
                   predivide=1.0, groups=None, process_set=None):
        from ..comm import FlatModel

        # frozen parameters of other dtypes (integer buffers registered as parameters) get no
        # gradient and no update: they stay out of the reduction
        params = [p for p in _params(self) if p.requires_grad or p.dtype == torch.float32]
        self._hvd_params = params
        # the flat float32 buffer for float32 parameters on one device and a 16-bit or no
        # compressor; else Horovod's per-tensor reduction (.per_tensor)
        flat_ok = (compression in _WIRE and len({p.device for p in params}) <= 1
                   and all(p.dtype == torch.float32 for p in params))
        self._hvd_names = {id(p): n for n, p in named}
        self._parameter_names = {p: n for n, p in named}     # Horovod's attribute
        comm = _state().comm if process_set is None else process_set._comm
        _agree.agree(comm, Desc("OPTIMIZER-INIT", "DistributedOptimizer", op,
                                [(str(p.dtype)[6:], tuple(p.shape),
                                  self._hvd_names.get(id(p), f"parameter {k}"))
                                 for k, p in enumerate(params)],
                                None, (float(predivide), float(passes)),
                                params[0].device.type if params else "cpu"))
        self._hvd_comm, self._hvd_predivide = comm, float(predivide)
        if process_set is None or process_set.process_set_id == 0:
            name = f"DistributedOptimizer.{next(_SEQ)}"
        else:           # numbered within the set: its members build the same ones, in order
            seq = _SEQS.setdefault(process_set._uid, itertools.count())
            name = f"DistributedOptimizer.ps{process_set.process_set_id}.{next(seq)}"
        self._hvd_desc = Desc("OPTIMIZER", name, op)
        self._hvd_digest = _agree.digest(self._hvd_desc)
        self._hvd_agreed = False
        _LIVE[name] = weakref.ref(self)
        self.backward_passes_per_step = passes
        self._hvd_counts = [0] * len(params)
        self._hvd_last = True
        self._hvd_pending = False
        self._hvd_synchronized = False
        self._hvd_should_sync = True
        self._hvd_hooks = [p.register_post_accumulate_grad_hook(self._hvd_guard(k))
                           for k, p in enumerate(params) if p.requires_grad]
        if not flat_ok:
            self._hvd_flat = None
            self._hvd_reducer = PerTensorReducer(params, compression=compression, op=op,
                                                 predivide=float(predivide), name=name,
                                                 process_set=process_set)
            return
        self._hvd_flat = flat = FlatModel(ParamHolder(params))
        if overlap is None:
            overlap = flat.params.device.type == "cuda"
        if predivide != 1.0:
            overlap = False           # 1/f scales the whole gradient before any bucket starts
        if bucket_bytes is None:      # overlap: small buckets start early; else few, large ones
            bucket_bytes = default_bucket_bytes(overlap)    # without: 64 MiB, Horovod's fusion
        self._hvd_reducer = red = BucketReducer(
            flat, comm.Dup(), bucket_bytes=bucket_bytes, overlap=overlap,
            compress=_WIRE[compression], progress=progress,
            average=op == Average and predivide == 1.0, last_pass=lambda: self._hvd_last)
        if groups:
            red.set_buckets(_group_buckets(flat, params, groups))

    def _hvd_agree_step(self) -> None:
        """This step's 32-byte exchange (once per step): the ranks agree that they step this
        optimizer, and a rank in ``hvd.join()`` learns it has to contribute zeros."""
        if not self._hvd_agreed:
            self._hvd_agreed = True
            _agree.agree(self._hvd_comm, self._hvd_desc, self._hvd_digest)

    def _hvd_rebind(self, comm=None) -> None:
        """``hvd.elastic``: forget this step's progress and the collectives in flight (their
        communicators are revoked) and, given ``comm`` (the survivors' world after a reset),
        reduce over it from now on."""
        if comm is not None:
            self._hvd_comm = comm
        if self._hvd_flat is not None:
            self._hvd_reducer.set_comm(self._hvd_reducer.comm if comm is None else comm.Dup())
        self._hvd_agreed = False
        self._hvd_counts = [0] * len(self._hvd_counts)
        self._hvd_pending = self._hvd_synchronized = False
        self._hvd_should_sync = True

    def _hvd_serve_zeros(self) -> None:
        """Run this step's bucket allreduces on zeros (this rank has joined); its gradients are
        left as they were."""
        flat = self._hvd_flat
        if flat is None:
            raise _agree.HorovodInternalError("a per-tensor DistributedOptimizer's steps are "
                                              "served as allreduces, not optimizer steps")
        params = flat._params                                       # noqa: SLF001
        saved, grads = flat.grads.clone(), [p.grad for p in params]
        self._hvd_reducer.discard()
        for p in params:
            p.grad = None                 # every slot reduced as zero
        try:
            self._hvd_reducer.finish()
        finally:
            flat.grads.copy_(saved)
            for p, g in zip(params, grads):
                p.grad = g

    def _hvd_guard(self, k: int):
        def hook(p):
            self._hvd_counts[k] += 1
            if self._hvd_counts[k] > self.backward_passes_per_step:
                raise AssertionError(
                    f"the gradient of {self._hvd_names.get(id(p), f'parameter {k}')} was computed "
                    f"more than backward_passes_per_step={self.backward_passes_per_step} times "
                    "before step(): raise backward_passes_per_step to accumulate gradients "
                    "locally, or call step()/synchronize() after each backward")
            self._hvd_last = self._hvd_counts[k] == self.backward_passes_per_step
            self._hvd_pending = True
            if self._hvd_last and self._hvd_reducer.overlap:
                self._hvd_agree_step()          # before this step's first bucket starts
        return hook

    def synchronize(self) -> None:
        """Reduce the gradients across ranks now (every bucket; those started during backward are
        waited for)."""
        if self._hvd_flat is None:          # per tensor: the grouped allreduce agrees itself
            self._hvd_reducer.finish()
            self._hvd_sparse.finish()
            self._hvd_counts = [0] * len(self._hvd_counts)
            self._hvd_pending = False
            self._hvd_synchronized = True
            return
        self._hvd_agree_step()
        f = self._hvd_predivide
        try:
            if f != 1.0:                  # Horovod: prescale 1/f, postscale f/size
                self._hvd_flat.collect_grads()
                self._hvd_flat.grads.mul_(1.0 / f)
            with _timeline.span(_timeline.ROWS.get(self._hvd_desc.name, ()), "ALLREDUCE",
                                "MPI_ALLREDUCE"):
                self._hvd_reducer.finish()
            if f != 1.0:
                self._hvd_flat.grads.mul_(f / self._hvd_comm.Get_size())
            self._hvd_sparse.finish()     # sparse gradients: Horovod's allgathers (.sparse)
        except Exception as exc:          # noqa: BLE001 - a dead peer (ULFM): Horovod's error
            if proc_failure(exc):
                raise _agree.HorovodInternalError(f"a peer died during the gradient allreduce "
                                                  f"({exc})") from exc
            raise
        finally:
            self._hvd_agreed = False
        self._hvd_counts = [0] * len(self._hvd_counts)
        self._hvd_pending = False
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``optimizer.synchronize(); (clip ...); with optimizer.skip_synchronize(): step()``."""
        self._hvd_should_sync = False
        try:
            yield
        finally:
            self._hvd_should_sync = True

    def step(self, closure=None):
        if self._hvd_should_sync:
            if self._hvd_synchronized:
                warnings.warn("optimizer.step() called without "      # Horovod's words
                              "optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_pending:
            raise AssertionError("optimizer.zero_grad() between loss.backward() and "
                                 "optimizer.step()/synchronize(): the gradients of that backward "
                                 "are being reduced; call step() or synchronize() first")
        self._hvd_sparse.release()
        if self._hvd_flat is None:
            super().zero_grad(set_to_none)  # Horovod's: the optimizer's own
        else:
            self._hvd_flat.zero_grad()

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._hvd_counts = [0] * len(self._hvd_counts)

    def load_state_dict(self, state_dict) -> None:
        self._hvd_reducer.discard()
        self._hvd_agreed = False
        self._hvd_counts = [0] * len(self._hvd_counts)
        self._hvd_pending = self._hvd_synchronized = False
        self._hvd_should_sync = True
        super().load_state_dict(state_dict)


def _params(opt) -> list:
    return unique_params(opt.param_groups)


def _group_buckets(flat, params, groups) -> list:
    """Buckets from Horovod's ``groups``: an int n splits the parameters into n contiguous runs
    (Horovod's ``split_list``); a list of parameter lists gives one bucket per group, the
    parameters in no group one bucket each. Bucket 0 holds the last parameters, as
    :func:`~hpcasync.ssgd.buckets.bucket_ranges` orders them."""
    index = {id(p): k for k, p in enumerate(params)}
    n = len(params)
    if isinstance(groups, int):
        q, r = divmod(n, groups)
        runs = [list(range(i * q + min(i, r), (i + 1) * q + min(i + 1, r)))
                for i in range(groups)]
        runs = [run for run in runs if run]
    else:
        runs, seen = [], set()
        for g in groups:
            run = sorted(index[id(p)] for p in g if id(p) in index)
            if run and run != list(range(run[0], run[-1] + 1)):
                raise ConfigError("DistributedOptimizer(groups=...): hpcasync's buckets are "
                                  "contiguous ranges of the flat buffer; each group must be a run "
                                  "of consecutive parameters (in named_parameters() order)")
            if run:
                runs.append(run)
                seen.update(run)
        runs += [[k] for k in range(n) if k not in seen]
        runs.sort()
    ends = [flat.offsets[k] + int(torch.Size(flat.shapes[k]).numel()) for k in range(n)]
    return [(flat.offsets[run[0]], ends[run[-1]], list(reversed(run))) for run in reversed(runs)]


def _named(opt, named_parameters) -> list:
    """Horovod's checks of ``named_parameters`` (ValueError, as Horovod)."""
    if named_parameters is None:
        return [(f"allreduce.noname.{i}.{j}", p) for i, g in enumerate(opt.param_groups)
                for j, p in enumerate(g["params"])]
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters must be a sequence of (name, parameter) tuples, as "
                         "model.named_parameters() gives")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"parameter names in named_parameters must be unique; duplicates: "
                         f"{', '.join(dups)}")
    unnamed = {id(p) for p in _params(opt)} - {id(p) for _, p in named}
    if unnamed:
        raise ValueError(f"named_parameters was given but {len(unnamed)} of the optimizer's "
                         "parameters are not named in it")
    return named


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None, *,
                         algorithm: str | None = None, overlap: bool | None = None,
                         bucket_bytes: int | None = None,
                         progress: str = DEFAULT_PROGRESS, **hyper):
    """Horovod's ``DistributedOptimizer`` (module doc). hpcasync's keywords: ``algorithm`` (one of
    :func:`hpcasync.algorithms`; default: ``hvd.init``'s, else ssgd), ``overlap`` (default: on
    for CUDA parameters), ``bucket_bytes`` (default 256 KiB with overlap, else 64 MiB),
    ``progress`` (SSGD's buckets), and the algorithm's hyperparameters."""
    st = _state()
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    named = _named(optimizer, named_parameters)
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"DistributedOptimizer supports op=hvd.Average, hvd.Sum or hvd.Adasum, "
                         f"got {op!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got "
                         f"{backward_passes_per_step!r}")
    algorithm = require_algorithm(algorithm)
    if op == Adasum:      # Horovod's _DistributedAdasumOptimizer; on one rank its plain one
        adasum = _adasum_optimizer(optimizer, named, compression, backward_passes_per_step,
                                   process_set, algorithm)
        if adasum is not None:
            return adasum
        op = Sum
    pset, outside = _process_set(process_set)
    if algorithm in (None, "ssgd") and hyper.get("compress") is not None:
        _check_front_door_ssgd(compression, backward_passes_per_step, op, groups or num_groups,
                               pset, sparse_as_dense, gradient_predivide_factor)
        return _algorithm_optimizer(st, optimizer, "ssgd", hyper)
    if algorithm not in (None, "ssgd"):
        if pset.process_set_id != 0:
            raise NotImplementedError(f"hpcasync.horovod: DistributedOptimizer(process_set=...) "
                                      f"runs SSGD only, not algorithm={algorithm!r}")
        _check_allreduce_only(algorithm, compression, op, gradient_predivide_factor,
                              groups or num_groups, sparse_as_dense)
        return _algorithm_optimizer(st, optimizer, algorithm, hyper)
    if hyper:
        raise TypeError(f"DistributedOptimizer got unexpected keyword(s) {', '.join(hyper)} "
                        "(hyperparameters go with algorithm=...)")
    mixin = _OutsideOptimizer if outside else _HorovodOptimizer
    cls = type(type(optimizer).__name__, (mixin, type(optimizer)),
               {"__module__": __name__, "__doc__": mixin.__doc__})
    opt = cls.__new__(cls)
    opt.__dict__.update(optimizer.__dict__)        # the same param_groups, state and defaults
    for attr in ("step", "zero_grad"):             # instance patches of the wrapped optimizer
        opt.__dict__.pop(attr, None)
    if num_groups and groups is None:
        groups = num_groups               # Horovod: num_groups is the old name of groups=int
    if groups == 0:
        groups = None
    if groups is not None and not (isinstance(groups, list) or
                                   (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "torch.Tensor.")
    if outside:
        opt.backward_passes_per_step = backward_passes_per_step
        return opt
    opt._hvd_setup(named, compression, backward_passes_per_step, op, overlap, bucket_bytes,
                   progress, gradient_predivide_factor, groups, pset)
    names = [opt._hvd_names.get(id(p), f"noname.{k}") for k, p in enumerate(opt._hvd_params)]
    opt._hvd_sparse = SparseGrads(opt._hvd_params, names, as_dense=sparse_as_dense,
                                  average=op == Average, process_set=pset)
    if opt._hvd_flat is None:
        opt._hvd_reducer.sparse = opt._hvd_sparse
    _timeline.name_rows(opt._hvd_desc.name, [f"allreduce.{n}" for n in names])
    return opt


def _check_allreduce_only(algorithm, compression, op, predivide, groups, sparse_as_dense) -> None:
    """The arguments that shape SSGD's gradient allreduce do nothing for another algorithm (it
    averages parameters, pushes to a server, or reduces with its own schedule and casts):
    given, a one-line error (a ConfigError, a ValueError as Horovod's argument errors) instead of
    a run that ignored them. ``backward_passes_per_step`` is kept: a step after several backward
    passes steps on their sum, as Horovod's does."""
    given = _allreduce_arguments_given(compression, op, groups, sparse_as_dense, predivide)
    if given:
        raise ConfigError(f"DistributedOptimizer({', '.join(given)}=...) shapes SSGD's gradient "
                          f"allreduce; algorithm={algorithm!r} reduces in its own way: leave "
                          f"{'it' if len(given) == 1 else 'them'} at Horovod's default")


def _allreduce_arguments_given(compression, op, groups, sparse_as_dense, predivide,
                               pset=None) -> list[str]:
    """The names of Horovod's arguments that shape the gradient allreduce (and ``pset``, the
    process set, when passed) given at other than their defaults."""
    return [name for name, odd in (
        ("compression", compression is not Compression.none), ("op", op != Average),
        ("groups", bool(groups)), ("process_set", pset is not None and pset.process_set_id != 0),
        ("sparse_as_dense", bool(sparse_as_dense)),
        ("gradient_predivide_factor", predivide != 1.0)) if odd]


def _process_set(process_set):
    """``(registered set, outside)``: a rank outside the set builds Horovod's inert optimizer."""
    from .process_sets import ProcessSet, _registered, global_process_set, resolve

    if (isinstance(process_set, ProcessSet) and process_set.process_set_id
            and process_set.included() is False):
        return _registered(process_set), True
    if process_set is None:
        return global_process_set, False
    return resolve(process_set, "Allreduce")[1], False


class _OutsideOptimizer:
    """DistributedOptimizer on a rank outside its ``process_set`` (Horovod's): it reduces nothing;
    ``step()`` is the optimizer's own, on this rank's gradients."""

    _hvd_facade = True

    def synchronize(self) -> None:
        pass

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes


# -- the toolkit's other algorithms ----------------------------------------------------------------

def _check_front_door_ssgd(compression, passes, op, groups, pset, sparse_as_dense,
                           predivide) -> None:
    """``compress=`` (PowerSGD, which Horovod has not) runs the front door's SSGD: Horovod's
    own options that it does not take are one-line errors, not dropped."""
    given = _allreduce_arguments_given(compression, op, groups, sparse_as_dense, predivide, pset)
    if given:
        raise ConfigError(f"DistributedOptimizer(compress=...) runs hpcasync's SSGD with that "
                          f"compression; it does not take {', '.join(given)} (drop "
                          f"{'it' if len(given) == 1 else 'them'})")
    if passes != 1:
        raise ConfigError("DistributedOptimizer(compress=...) steps once per backward pass: "
                          "backward_passes_per_step must be 1")


def _algorithm_optimizer(st, optimizer, algorithm: str, hyper: dict):
    from ..api import PS_ALGORITHMS, _share_torch_optimizer, optimizer as make
    from ..rules import ps_lr_factor

    holder = ParamHolder(_params(optimizer))
    if algorithm == "daso":
        missing = [k for k in ("epochs", "steps_per_epoch") if k not in hyper]
        if missing:
            raise ConfigError(f"algorithm='daso' schedules its phases by epoch: pass "
                              f"{' and '.join(f'{k}=...' for k in missing)} to "
                              "DistributedOptimizer (steps_per_epoch: step() calls per epoch, "
                              "e.g. len(train_loader))")
        opt = make("daso", holder, optimizer, **hyper)
        opt.__class__ = _EpochClosingDASO
        opt._losses = []
        return opt
    if algorithm not in PS_ALGORITHMS:
        return make(algorithm, holder, optimizer, **hyper)
    resolved = _share_torch_optimizer(algorithm, optimizer, hyper)    # shares the SGD's groups
    if (resolved.get("steps_per_epoch") is None and resolved.get("warmup_epochs") is None
            and ps_lr_factor(algorithm, 2, None) is not None):
        resolved["warmup_epochs"] = 0
        log.warning("%s: no steps_per_epoch given to DistributedOptimizer: the paper's lr warm-up "
                    "is off (pass steps_per_epoch=len(train_loader) to keep it)", algorithm)
    roles = st.roles
    first = min(r for r in range(roles.size) if r not in roles.topology.servers)
    if roles.rank == first:           # the server builds the same optimizer, its groups owned
        spec = {k: v for k, v in resolved.items() if k != "optimizer"}
        spec["param_groups"] = [{"params": g["params"], "lr": g["lr"],
                                 "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
        send_spec(roles, spec_of(algorithm, spec, _params(optimizer)))
    st.spec_sent = True
    opt = make(algorithm, holder, **resolved)
    epochs, per_epoch = resolved.get("epochs"), resolved.get("steps_per_epoch")
    if epochs and per_epoch:
        opt.finish_after(int(epochs) * int(per_epoch))
    elif roles.rank == first:
        log.warning("%s under hpcasync.horovod: each worker trains its own copy of the model until "
                    "the run ends; pass epochs= and steps_per_epoch= to DistributedOptimizer so "
                    "that every worker holds the server's final model after its last step (or "
                    "call opt.finish() after training, before evaluating or saving)", algorithm)
    atexit.register(_finish_quietly, opt)        # runs before the PS's own exit hook
    return opt


def _finish_quietly(opt) -> None:
    """At exit, a PS worker finishes (the server then ends the run); the facade's scripts never
    call finish() themselves."""
    if not opt._closed:
        if not opt.started:
            opt.start()
        opt.finish()


def _daso_base():
    from ..daso.optimizer import DASO

    return DASO


class _EpochClosingDASO(_daso_base()):
    """DASO that closes its epoch itself after ``steps_per_epoch`` steps (a Horovod loop does not
    call ``epoch_end``). ``step(loss=...)`` feeds the plateau schedule; without losses the epoch
    is reported as improving by half each time, so the knobs stay where they were set."""

    def step(self, closure=None, *, loss=None):
        result = super().step(closure)
        if loss is not None:
            self._losses.append(float(loss.detach() if torch.is_tensor(loss) else loss))
        if self.schedule.batch == self.batches_per_epoch:
            value = (sum(self._losses) / len(self._losses) if self._losses
                     else math.ldexp(1.0, -self.schedule.epoch))
            self._losses = []
            self.epoch_end(value)
        return result
