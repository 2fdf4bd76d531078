"""``op=hvd.Adasum``: Horovod's adaptive summation, in ``allreduce`` and ``DistributedOptimizer``.

Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021)
combines two vectors as ::

    adasum(a, b) = (1 - a·b / (2|a|²)) · a  +  (1 - a·b / (2|b|²)) · b

(the sum when a ⟂ b, the average when a = b), and N = 2^k ranks by a binary tree over rank order:
level 1 combines ranks (0, 1), (2, 3), ...; level 2 combines those pairs' results, and so on. Every
tensor is combined on its own: a grouped allreduce (or a DistributedOptimizer's parameters) uses one
dot product and two norms per tensor, as Horovod's fused buffer does. A coefficient whose squared
norm is below ``sqrt(DBL_MIN)`` is 1 (Horovod's guard against a zero vector)::

    y = hvd.allreduce(x, op=hvd.Adasum)                     # 2, 4, 8, ... ranks
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Adasum)

Horovod's rules kept: a number of ranks that is not a power of two raises its
``NotImplementedError`` (before anything is sent); an integer tensor its "Unsupported data type"
``HorovodInternalError``; a process set other than the global one its ``NotImplementedError``;
``prescale_factor`` scales the input and ``postscale_factor`` the result (Adasum is homogeneous of
degree one, so both simply multiply it). ``DistributedOptimizer(op=hvd.Adasum)`` is Horovod's
``_DistributedAdasumOptimizer``: ``step()`` runs the user's optimizer on each parameter alone, takes
the parameter's change (delta = new − old), Adasum-combines the deltas across ranks and sets each
parameter to old + combined delta; ``synchronize()`` does nothing and ``skip_synchronize()``
raises, as there. On one rank Horovod builds its plain optimizer (whose Adasum of one gradient is
the gradient): so does the facade.

How it is computed (:func:`adasum_`): Horovod's vector-halving, distance-doubling pattern. At level
d = 1, 2, 4, ... each rank swaps half of the slice it holds with rank ``r ^ d`` (the rank with bit d
clear keeps the first half), so it holds, for its half-slice, both operands of that level's pair;
the per-tensor partial dot products and norms are summed over the 2d ranks that share the pair
(one allgather of 3 doubles per tensor, summed in rank order), and each rank combines its
half-slice. The doubling phase sends the slices back up. Each element is combined by exactly one
rank per level, so every rank ends with the same bits. Arithmetic: dot products, norms and the
combination in float64, rounded to the tensor's dtype after each level (Horovod: float32 products
summed in double for float32; float32 arithmetic for float16), so results agree with Horovod's to
the dtype's rounding. Differences from Horovod: the exchange runs when the collective is submitted
(its rounds depend on each other, so there is no single nonblocking MPI call to return early
from); bfloat16 is accepted (Horovod's CPU build refuses the dtype altogether); a non-power-of-two
size is refused at ``DistributedOptimizer(op=hvd.Adasum)`` rather than at the first backward.
"""
from __future__ import annotations

import itertools
import math
import sys

import numpy as np
import torch

from ..errors import ConfigError
from ..optim import unique_params
from . import agree as _agree
from . import timeline
from .agree import HorovodInternalError
from .collectives import (OWN_OPS, Adasum, _agree_allreduce, _comm, _deliver, _handle, _host,
                          _scale, _Work, synchronize)

#: a squared norm below this leaves its vector's coefficient at 1 (Horovod: sqrt(DBL_MIN))
TINY = math.sqrt(sys.float_info.min)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TAG = 0x4164            # point-to-point tag of the halving/doubling exchanges
_NOT_POW2 = "Running Adasum with non-power of 2 ranks is not supported yet."


# -- the math --------------------------------------------------------------------------------------

def coefficients(dot, aa, bb):
    """``(ca, cb)`` with ``adasum(a, b) = ca·a + cb·b``, from ``a·b``, ``|a|²``, ``|b|²`` (floats
    or float64 tensors, elementwise)."""
    dot, aa, bb = (torch.as_tensor(x, dtype=torch.float64) for x in (dot, aa, bb))
    ca = torch.where(aa >= TINY, 1.0 - dot / (2.0 * aa.clamp_min(TINY)), torch.ones_like(aa))
    cb = torch.where(bb >= TINY, 1.0 - dot / (2.0 * bb.clamp_min(TINY)), torch.ones_like(bb))
    return ca, cb


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# -- the collective ----------------------------------------------------------------------------------

def _bytes(t: torch.Tensor):
    from mpi4py import MPI

    return [t.view(torch.uint8).numpy(), MPI.BYTE]


def adasum_(comm, flat: torch.Tensor, counts: list[int]) -> None:
    """In place over ``comm`` (a power-of-two size): ``flat`` (1-D, contiguous, CPU; this rank's
    tensors back to back, ``counts[i]`` elements each) becomes the Adasum of every rank's
    ``flat``, tensor by tensor (module doc)."""
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1:
        return
    k = len(counts)
    owner = torch.repeat_interleave(torch.arange(k), torch.tensor(counts, dtype=torch.long))
    lo, hi, steps, d = 0, flat.numel(), [], 1
    while d < n:
        partner, half = r ^ d, (hi - lo) // 2
        left = r & d == 0                       # this rank keeps the first half
        keep, give = ((lo, lo + half), (lo + half, hi)) if left else \
            ((lo + half, hi), (lo, lo + half))
        mine = flat[keep[0]:keep[1]]
        theirs = torch.empty_like(mine)
        comm.Sendrecv(_bytes(flat[give[0]:give[1]]), partner, _TAG, _bytes(theirs), partner, _TAG)
        a, b = (mine, theirs) if left else (theirs, mine)       # (lower ranks', upper ranks')
        a64, b64, ids = a.double(), b.double(), owner[keep[0]:keep[1]]
        part = torch.zeros(3, k, dtype=torch.float64)
        part[0].index_add_(0, ids, a64 * b64)
        part[1].index_add_(0, ids, a64 * a64)
        part[2].index_add_(0, ids, b64 * b64)
        every = np.empty((n, 3, k), dtype=np.float64)
        comm.Allgather(part.numpy(), every)
        block = (r // (2 * d)) * 2 * d          # the 2d ranks that hold slices of this pair
        dot, aa, bb = torch.from_numpy(every[block:block + 2 * d].sum(axis=0))
        ca, cb = coefficients(dot, aa, bb)
        mine.copy_(ca[ids] * a64 + cb[ids] * b64)
        steps.append((keep, give, partner))
        lo, hi, d = keep[0], keep[1], d * 2
    for keep, give, partner in reversed(steps):         # the slices go back up
        comm.Sendrecv(_bytes(flat[keep[0]:keep[1]]), partner, _TAG,
                      _bytes(flat[give[0]:give[1]]), partner, _TAG)


def check_size(n: int) -> None:
    if not is_power_of_two(n):
        raise NotImplementedError(_NOT_POW2)


def _global_only(process_set) -> None:
    if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")


def start(comm, tensors, outs, prescale, postscale, name, process_set, check=True,
          key=None) -> _Work:
    """The facade's allreduce with ``op=Adasum`` (``collectives.OWN_OPS``, so
    ``collectives._start_allreduce`` calls it, with ``key`` its Horovod name):
    agreed like any allreduce (never parked), combined at once; the returned work only delivers
    the results."""
    _global_only(process_set)
    check_size(comm.Get_size())
    key = name if key is None else key
    if check:
        _agree_allreduce(comm, key, name, Adasum, tensors, prescale, postscale)
    if any(t.dtype not in FLOATS for t in tensors):
        raise HorovodInternalError("Unsupported data type")     # every rank: dtypes are agreed
    bufs = [_scale(_host(t), prescale) for t in tensors]

    def finish():
        return [_deliver(_scale(b, postscale), t, out) for b, t, out in zip(bufs, tensors, outs)]
    work = _Work(key, [], finish)
    tl = timeline.ACTIVE
    if tl is not None:
        tl.started(work)
    for dtype in dict.fromkeys(b.dtype for b in bufs):          # one exchange per dtype
        same = [b for b in bufs if b.dtype == dtype]
        flat = torch.cat([b.reshape(-1) for b in same])
        adasum_(comm, flat, [b.numel() for b in same])
        offset = 0
        for b in same:
            b.view(-1).copy_(flat[offset:offset + b.numel()])
            offset += b.numel()
    if tl is not None:
        tl.transferred(work)
    return work


OWN_OPS[Adasum] = start


# -- DistributedOptimizer(op=hvd.Adasum) --------------------------------------------------------------

_SEQ = itertools.count()


class _AdasumOptimizer:
    """Mixed in before the user's optimizer class: Horovod's ``_DistributedAdasumOptimizer``
    (module doc). Not marked ``_hvd_facade``: ``broadcast_optimizer_state``'s zero-gradient step
    runs its ``step()`` (lr 0 on every rank together: a zero delta everywhere)."""

    def _adasum_setup(self, named, compression, passes, comm) -> None:
        self._hvd_names = {id(p): n for n, p in named}
        self._adasum_params = [p for p in _all_params(self) if p.requires_grad]
        self._adasum_comm, self._adasum_compression = comm, compression
        self._adasum_name = f"DistributedOptimizer.adasum.{next(_SEQ)}"
        self.backward_passes_per_step = passes
        self._adasum_counts = [0] * len(self._adasum_params)
        self._adasum_pending = False
        for p in self._adasum_params:
            if p.grad is None:              # Horovod: every trained parameter starts with zeros
                p.grad = torch.zeros_like(p)
        self._adasum_hooks = [p.register_post_accumulate_grad_hook(self._adasum_guard(k))
                              for k, p in enumerate(self._adasum_params)]
        timeline.name_rows(self._adasum_name, [
            f"allreduce.{self._hvd_names.get(id(p), f'noname.{k}')}"
            for k, p in enumerate(self._adasum_params)])

    def _adasum_guard(self, k: int):
        def hook(p):
            self._adasum_counts[k] += 1
            self._adasum_pending = True
            if self._adasum_counts[k] > self.backward_passes_per_step:
                raise AssertionError("Gradients were computed more than "      # Horovod's words
                                     "backward_passes_per_step times before call "
                                     "to step(). Increase backward_passes_per_step to "
                                     "accumulate gradients locally.")
        return hook

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._adasum_counts = [0] * len(self._adasum_counts)

    def synchronize(self) -> None:
        """Nothing to do (Horovod's Adasum optimizer combines parameter deltas in ``step()``)."""

    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum "
                             "optimizer.")

    def _local_step(self, p) -> None:
        """The user's optimizer on ``p`` alone (its groups' other parameters hidden)."""
        stashed = [g["params"] for g in self.param_groups]
        try:
            for g in self.param_groups:
                g["params"] = [p] if any(q is p for q in g["params"]) else []
            super().step()
        finally:
            for g, params in zip(self.param_groups, stashed):
                g["params"] = params

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        starts, wires, ctxs = [], [], []
        with torch.no_grad():
            for p in self._adasum_params:
                start_ = p.detach().clone()
                self._local_step(p)
                wire, ctx = self._adasum_compression.compress(p.detach() - start_)
                starts.append(start_)
                wires.append(wire.contiguous())
                ctxs.append(ctx)
            work = start(self._adasum_comm, wires, wires, 1.0, 1.0, self._adasum_name, None)
            synchronize(_handle(work))
            for p, start_, wire, ctx in zip(self._adasum_params, starts, wires, ctxs):
                p.copy_(start_.add_(self._adasum_compression.decompress(wire, ctx)))
        self._adasum_counts = [0] * len(self._adasum_counts)
        self._adasum_pending = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._adasum_pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        super().zero_grad(set_to_none)


def _all_params(opt) -> list:
    return unique_params(opt.param_groups)


def distributed_optimizer(optimizer, named, compression, passes, process_set, algorithm=None):
    """``DistributedOptimizer(op=hvd.Adasum)`` on more than one rank (``None`` on one rank: the
    caller then builds its plain optimizer, as Horovod does)."""
    if algorithm not in (None, "ssgd"):
        raise ConfigError(f"op=hvd.Adasum combines SSGD's steps (Horovod's Adasum optimizer); "
                          f"algorithm={algorithm!r} reduces in its own way: drop one of them")
    _global_only(process_set)
    comm = _comm(process_set)
    if comm.Get_size() == 1:
        return None
    check_size(comm.Get_size())
    cls = type(type(optimizer).__name__, (_AdasumOptimizer, type(optimizer)),
               {"__module__": __name__, "__doc__": _AdasumOptimizer.__doc__})
    opt = cls.__new__(cls)
    opt.__dict__.update(optimizer.__dict__)        # the same param_groups, state and defaults
    for attr in ("step", "zero_grad"):
        opt.__dict__.pop(attr, None)
    opt._adasum_setup(named, compression, passes, comm)
    return opt
