"""PowerSGD: SSGD's gradient averaged as a rank-r approximation (Vogels, Karimireddy, Jaggi,
NeurIPS 2019), with error feedback and warm start, as PyTorch's DDP communication hook
``powerSGD_hook`` computes it (same options, same defaults, the same floats on the same inputs).

Each step, with N ranks and the flat gradient g of this rank:

1. error feedback: g ← g + e (e: what this rank's last compressed step left out, zero at first);
2. each matrix-shaped gradient M (n × m: a weight, a conv kernel viewed as n × rest) that is worth
   compressing — (n + m)·r·``min_compression_rate`` < n·m, with r = min(n, m, ``rank``) — gets
   P ← M·Q, with Q the last step's (warm start, re-orthonormalized) or, the first time, a seeded
   normal draw, orthonormalized; the other gradients (vectors, small matrices) go uncompressed;
3. one allreduce sums the uncompressed gradients (then ÷ N), one sums every P; each P is
   orthonormalized (Gram-Schmidt for r ≤ 2, QR above); Q ← Mᵀ·P; one allreduce sums every Q
   (then ÷ N); M ← P·Qᵀ, the same on every rank;
4. e ← (g before step 2) − (the averaged result), over the whole buffer.

Before ``start_iter`` steps the gradient is averaged plainly (divided by N, then summed, as the
hook's warm-up). One step sends Σ(n + m)·r floats for the compressed matrices instead of Σ n·m.

Where this follows the hook exactly, and where it does not:

- one "bucket": the whole flat gradient (the hook works per DDP bucket; with one bucket — a model
  below DDP's first bucket, or ``bucket_cap_mb`` above its size — the two draw, compress and sum
  the same tensors in the same order). Q's first draw: ``torch.manual_seed`` of one integer from
  ``numpy.random.RandomState(seed)``, then ``torch.randn`` per matrix in parameter order;
- the error memory covers the uncompressed gradients too (the hook's: their error is
  g_i + e_i − mean, which sums to zero over ranks);
- reduced after backward, not overlapped with it (``overlap=True`` is a one-line error);
- a parameter with ``requires_grad=False`` goes uncompressed (DDP leaves it out altogether);
- an all-zero column of P (a layer with no gradient on any rank) divides by zero, giving NaN,
  as the hook does with ``orthogonalization_epsilon=0``: set ``epsilon`` (e.g. 1e-8) if a layer
  may get no gradient;
- the error memory is this rank's own: :meth:`PowerSGD.state_dict` carries it with a mark of the
  process that wrote it, and :meth:`PowerSGD.load_state_dict` takes it back only in that process
  (a rollback of ``hpcasync.elastic``); a state from another rank (the sync after a death, a
  checkpoint written by rank 0) leaves this rank's memory as it is, or zero in a new process —
  a resumed or grown-back run is not a bitwise replay (said once in the log), where every other
  part of the state (step count, P, Q, the random generator) is the same on every rank and is
  taken.

Example (a user's own loop)::

    opt = hpcasync.optimizer("ssgd", model, torch.optim.SGD(model.parameters(), lr=0.1),
                             compress=hpcasync.PowerSGD(rank=4, start_iter=10))

Design: docs/design/ssgd.md, "PowerSGD".
"""
from __future__ import annotations

import logging
import os
import socket

import torch

from ..comm import allreduce
from ..errors import ConfigError
from ..runtime.elastic import LOCAL_KEY

log = logging.getLogger("hpcasync")

__all__ = ["PowerSGD", "orthonormalize_", "worth_compressing"]

#: DDP's default buckets: the first (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), the others
FIRST_BUCKET_BYTES, DEFAULT_BUCKET_MB = 2**20, 25


def worth_compressing(n: int, m: int, rank: int, min_rate: float) -> bool:
    """An n × m matrix is sent as P (n × r) and Q (m × r) when that is ``min_rate`` times
    smaller than the matrix itself."""
    return (n + m) * rank * min_rate < n * m


def orthonormalize_(batch: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalize the columns of each matrix of ``batch`` (b × n × r, r ≤ n), in place:
    Gram-Schmidt column by column for r ≤ 2 or 16-bit floats (``epsilon`` added to each norm),
    else a QR factorization's Q."""
    b, _, r = batch.shape
    if r > 2 and batch.dtype not in (torch.float16, torch.bfloat16):
        torch.linalg.qr(batch, out=(batch, batch.new_empty(b, r, r)))
        return batch
    for i in range(r):
        col = batch[:, :, i:i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        col /= norm if epsilon == 0 else norm + epsilon
        if i + 1 < r:
            rest = batch[:, :, i + 1:]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    return batch


class PowerSGD:
    """The compression's options and state (one per optimizer; module doc).

    Args:
        rank: r, the rank of each approximation (the hook's ``matrix_approximation_rank``, 1).
        start_iter: plain averaging for this many steps first (``start_powerSGD_iter``, 1000;
            > 1 with error feedback or warm start, as the hook requires).
        min_compression_rate: compress a matrix only when it shrinks at least this many times
            (``min_compression_rate``, 2).
        error_feedback: keep and re-add what compression left out (``use_error_feedback``).
        warm_start: start each step's power iteration from the last Q (``warm_start``).
        epsilon: added to each norm when orthonormalizing (``orthogonalization_epsilon``, 0).
        seed: seeds Q's first draw (``random_seed``, 0).
        bucket_cap_mb: DDP's ``bucket_cap_mb``: which matrices share a seed of Q's draws, nothing
            else. None (default): DDP's default buckets, 1 MiB first, then 25 MiB; a number: that
            size for every bucket (as DDP given ``bucket_cap_mb``).

    Attributes: ``iter`` (steps seen), ``sent_numel`` / ``dense_numel`` (elements this rank
    sent in the last step, and what plain averaging would have sent).
    """

    def __init__(self, rank: int = 1, start_iter: int = 1000, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, warm_start: bool = True, epsilon: float = 0.0,
                 seed: int = 0, bucket_cap_mb: float | None = None):
        for name, value, low in (("rank", rank, 1), ("start_iter", start_iter, 0),
                                 ("seed", seed, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"PowerSGD {name} must be an integer >= {low}, got {value!r}")
        if (not isinstance(min_compression_rate, (int, float)) or isinstance(min_compression_rate, bool)
                or not 0 <= min_compression_rate < float("inf")):
            raise ConfigError(f"PowerSGD min_compression_rate must be a finite number >= 0, got "
                              f"{min_compression_rate!r}")
        if bucket_cap_mb is not None and (
                not isinstance(bucket_cap_mb, (int, float)) or isinstance(bucket_cap_mb, bool)
                or not 0 < bucket_cap_mb < float("inf")):
            raise ConfigError(f"PowerSGD bucket_cap_mb must be a number > 0, got "
                              f"{bucket_cap_mb!r}")
        if not isinstance(epsilon, (int, float)) or not 0 <= epsilon < float("inf"):
            raise ConfigError(f"PowerSGD epsilon must be a finite number >= 0, got {epsilon!r}")
        if (error_feedback or warm_start) and start_iter <= 1:
            raise ConfigError(f"PowerSGD start_iter must be > 1 with error feedback or warm "
                              f"start (its state is made at the first compressed step), got "
                              f"{start_iter}")
        import numpy as np

        self.rank, self.start_iter = rank, start_iter
        self.min_compression_rate, self.epsilon, self.seed = min_compression_rate, epsilon, seed
        self.error_feedback, self.warm_start = bool(error_feedback), bool(warm_start)
        self.bucket_cap_mb = bucket_cap_mb
        self.bucket_bytes = int((bucket_cap_mb or DEFAULT_BUCKET_MB) * 2**20)
        self.first_bucket_bytes = FIRST_BUCKET_BYTES if bucket_cap_mb is None else self.bucket_bytes
        self.rng = np.random.RandomState(seed)
        #: parameter indices in the order of the matrices, cut into DDP's buckets (:meth:`fix_order`)
        self.order: list[int] | None = None
        self.buckets: list[list[int]] = []
        self.iter = 0
        self.error: torch.Tensor | None = None
        self.p: torch.Tensor | None = None
        self.q: torch.Tensor | None = None
        self.sent_numel = self.dense_numel = 0
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{id(self)}"
        self._told = False
        self._foreign = False       # the loaded state's error memory was another rank's

    def options(self) -> dict:
        return {"rank": self.rank, "start_iter": self.start_iter,
                "min_compression_rate": self.min_compression_rate,
                "error_feedback": self.error_feedback, "warm_start": self.warm_start,
                "epsilon": self.epsilon, "seed": self.seed, "bucket_cap_mb": self.bucket_cap_mb}

    # -- the step --------------------------------------------------------------------------------
    def reduce(self, comm, grads: torch.Tensor, views: list[torch.Tensor],
               compressible: list[bool], presence: torch.Tensor | None = None,
               ready: list[int] | None = None) -> None:
        """Average ``grads`` (the flat gradient; ``views`` its per-parameter views in order)
        over ``comm`` in place, compressed where ``compressible`` and worth it. ``presence``
        (one float per parameter, the slice just before ``grads`` in one buffer) is summed
        along, uncompressed. ``ready``: the parameters in the order their gradients came this
        step; rank 0's at the first step fixes the order of Q's draws (:meth:`fix_order`)."""
        n_ranks = comm.Get_size()
        if self.order is None:
            self.fix_order(comm, ready or [], [v.numel() * v.element_size() for v in views])
        self.dense_numel = grads.numel() + (0 if presence is None else presence.numel())
        if self.iter < self.start_iter:
            span = grads if presence is None else _joined(presence, grads)
            span.div_(n_ranks)
            allreduce(comm, span)
            self.sent_numel = span.numel()
            self.iter += 1
            return
        if self.error_feedback:
            if self._foreign and not self._told:
                self._told = True
                log.info("PowerSGD: this rank keeps its own error-feedback memory (%s) instead "
                         "of another rank's: the run is not a bitwise replay",
                         "zero: a new process" if self.error is None else "its last step's")
            self._foreign = False
            if self.error is None or self.error.shape != grads.shape:
                self.error = torch.zeros_like(grads)
            else:
                grads.add_(self.error)
            before = grads.clone()
        mats, plain, shapes, bucket_of = [], [], [], []
        for b, members in enumerate(self.buckets):
            for k in members:
                view = views[k]
                m = view.view(view.shape[0], -1) if view.dim() > 1 else None
                r = 0 if m is None else min(*m.shape, self.rank)
                if compressible[k] and m is not None and worth_compressing(
                        *m.shape, r, self.min_compression_rate):
                    mats.append(m.unsqueeze(0))
                    shapes.append((*m.shape, r))
                    bucket_of.append(b)
                else:
                    plain.append(view)
        p_numel = sum(n * r for n, _, r in shapes)
        q_numel = sum(m * r for _, m, r in shapes)
        fresh = not self.warm_start or self.p is None or self.p.numel() != p_numel
        if fresh:
            self.p = grads.new_empty(p_numel)
            self.q = grads.new_empty(q_numel)
        ps, qs, i, j = [], [], 0, 0
        for n, m, r in shapes:
            ps.append(self.p[i:i + n * r].view(1, n, r))
            qs.append(self.q[j:j + m * r].view(1, m, r))
            i, j = i + n * r, j + m * r
        if fresh:       # one seed per bucket, a normal draw per matrix (the hook's order)
            for b in range(len(self.buckets)):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.rng.randint(1_000_000_000))
                    for q in (q for q, c in zip(qs, bucket_of) if c == b):
                        q.copy_(torch.randn(*q.shape, device="cpu", dtype=q.dtype))
                        orthonormalize_(q, self.epsilon)
        else:
            for q in qs:
                orthonormalize_(q, self.epsilon)
        for m, q, p in zip(mats, qs, ps):
            torch.bmm(m, q, out=p)
        lead = [] if presence is None else [presence]
        flat = torch.cat([t.reshape(-1) for t in lead + plain]) if lead or plain \
            else grads.new_empty(0)
        allreduce(comm, flat)
        flat.div_(n_ranks)
        k = 0
        for t in lead + plain:
            t.copy_(flat[k:k + t.numel()].view_as(t))
            k += t.numel()
        if p_numel:
            allreduce(comm, self.p)
        for p in ps:
            orthonormalize_(p, self.epsilon)
        for m, p, q in zip(mats, ps, qs):
            torch.bmm(m.transpose(1, 2), p, out=q)
        if q_numel:
            allreduce(comm, self.q)
        self.q.div_(n_ranks)
        for p, q, m in zip(ps, qs, mats):
            torch.bmm(p, q.transpose(1, 2), out=m)
        if self.error_feedback:
            torch.sub(before, grads, out=self.error)
        if not self.warm_start:
            self.p = self.q = None
        self.sent_numel = flat.numel() + p_numel + q_numel
        self.iter += 1

    def fix_order(self, comm, ready: list[int], sizes: list[int]) -> None:
        """The order of the matrices (and Q's draws), as DDP's buckets after its first step:
        rank 0's gradients in the order they came (``ready``; those that came in none after,
        last first), cut into buckets of ``first_bucket_bytes`` then ``bucket_bytes``
        (``sizes``: each parameter's gradient bytes; one broadcast)."""
        count = len(sizes)
        order = list(dict.fromkeys(k for k in ready if 0 <= k < count))
        order += [k for k in reversed(range(count)) if k not in set(order)]
        order = comm.bcast(order, root=0)
        buckets, size, limit = [[]], 0, self.first_bucket_bytes
        for k in order:
            buckets[-1].append(k)
            size += sizes[k]
            if size >= limit:
                buckets.append([])
                size, limit = 0, self.bucket_bytes
        self.order, self.buckets = order, [b for b in buckets if b]

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Options, step count, P, Q, the random generator (the same on every rank) and this
        rank's error memory with its owner mark (module doc)."""
        _, keys, pos, has_gauss, cached = self.rng.get_state()
        copy = (lambda t: None if t is None else t.detach().clone())
        return {"options": self.options(), "iter": self.iter, "p": copy(self.p),
                "q": copy(self.q), "rng": {"keys": torch.from_numpy(keys.astype("int64")),
                                           "pos": int(pos), "has_gauss": int(has_gauss),
                                           "cached": float(cached)},
                "order": self.order, "buckets": self.buckets,
                LOCAL_KEY: {"error": copy(self.error), "owner": self._owner}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("options", self.options()) != self.options():
            raise ConfigError(f"PowerSGD state of other options {state['options']} loaded into "
                              f"one of {self.options()}")
        import numpy as np

        self.iter = int(state["iter"])
        self.order, self.buckets = state.get("order"), state.get("buckets", [])
        self.p, self.q = self._here(state["p"]), self._here(state["q"])
        r = state["rng"]
        self.rng.set_state(("MT19937", r["keys"].numpy().astype(np.uint32), r["pos"],
                            r["has_gauss"], r["cached"]))
        local = state.get(LOCAL_KEY, {})
        if local.get("owner") == self._owner:
            self.error = self._here(local["error"])
        elif self.error_feedback and self.iter > self.start_iter:
            self._foreign = True        # said at the next compressed step, unless load_local

    def load_local(self, error: torch.Tensor | None) -> None:
        """This rank's own error-feedback memory, kept apart from the shared state (the CLI's
        checkpoints hold every rank's)."""
        self._foreign = False
        if error is not None:
            self.error = self._here(error)

    def _here(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A copy of a loaded tensor on P's device (its own, before P exists)."""
        return None if t is None else t.detach().clone().to(
            self.p.device if self.p is not None else t.device)


def _joined(presence: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """The contiguous span ``[presence, grads]`` (the flat model keeps them adjacent)."""
    if presence.data_ptr() + presence.numel() * presence.element_size() != grads.data_ptr():
        raise AssertionError("presence must lie just before the gradients")
    return torch.as_strided(presence, (presence.numel() + grads.numel(),), (1,))
