"""SHAT: scale- and heterogeneity-aware asynchronous training (Ko & Kim, Applied Sciences 2022).

PS: plain asynchronous SGD, plus a counter c_k per worker of the updates made by OTHER workers since
worker k's last push. On push(i, g)::

    c_k ← c_k + 1 for every active k ≠ i
    θ ← θ − η·(g + wd·θ)            (optional shared momentum: as asgd.py)
    reply (θ, c_i) ; c_i ← 0

Worker i, on the reply (its gradient g, its copy w)::

    w ← w − η·g                      (local step)
    w ← (1 − α_i)·w + α_i·θ,   α_i = 1 − s_i / log n,   s_i = n / c_i

Example::

    rule = SHAT(theta0, num_workers=4, lr=0.1)
    reply = rule.on_push(1, grad, PushMeta(version=3))
    rule.on_reply(local, reply, grad)           # worker 1, in place

Design: docs/design/rules.md#shat (the α modes, reply scalars, sharding, checkpoints of the
workers' own models). Differences from the paper: :class:`SHAT`.
"""
from __future__ import annotations

import math

from torch import Tensor

from ..errors import CheckpointError
from .asgd import asgd_update
from .base import PushMeta, Reply, Rule, check_choice, check_real, need, sub_scaled_

ALPHA_MODES = ("log", "root", "ensemble", "asp")


def shat_alpha(n: int, c: int, mode: str = "log") -> float:
    """α for a worker that saw ``c`` foreign updates among ``n`` workers.

    ``log``: 1 − (n/c)/ln n ; ``root``: 1 − (n/c)/√n ; both clamped to [0, 1], with α = 1 when
    c = 0 or n = 1. ``ensemble``: 0. ``asp``: 1.
    """
    if mode == "ensemble":
        return 0.0
    if mode == "asp":
        return 1.0
    if mode not in ("log", "root"):
        raise ValueError(f"unknown alpha mode {mode!r}")
    if c <= 0 or n <= 1:
        return 1.0
    scale = math.log(n) if mode == "log" else math.sqrt(n)
    return min(1.0, max(0.0, 1.0 - (n / c) / scale))


def shat_worker_step(local: Tensor, grad: Tensor | None, theta: Tensor, *, lr: float | Tensor,
                     alpha: float, keep: Tensor | None = None) -> None:
    """Worker side in place: ``w ← w − η·g`` then ``w ← (1−α)·w + α·θ``.

    α = 1 copies θ (bitwise); α = 0 never reads θ; ``grad=None`` skips the local step. ``lr`` a
    float or a per-element tensor (param groups); ``keep``: indices of elements left bitwise
    as they are (no param group: the mix would round them).
    """
    if alpha == 1.0:
        local.copy_(theta)
        return
    kept = local.index_select(0, keep) if keep is not None and alpha != 0.0 else None
    if grad is not None:
        sub_scaled_(local, grad, lr)
    if alpha != 0.0:
        local.mul_(1.0 - alpha).add_(theta, alpha=alpha)
    if kept is not None:
        local.index_copy_(0, keep, kept)


class SHAT(Rule):
    """SHAT (and ENSEMBLE / ASP / SHAT-root through ``alpha_mode``).

    Args:
        theta0, num_workers, lr, weight_decay: see :class:`~hpcasync.rules.base.Rule`.
        alpha_mode: ``"log"`` (default), ``"root"``, ``"ensemble"`` or ``"asp"``.
        momentum: γ of one shared server-side momentum buffer (default 0).

    Differences from the paper (Decisions of the spec, each an option or a documented guard):
    * momentum / weight decay are applied on the server side only (the local step is ``w −
      η·g``);
    * the worker does a local step before mixing (the paper's derivation implies it);
    * natural log; α clamped to [0, 1]; c_i = 0 → α = 1; n = 1 → α = 1 (plain SGD); ``"root"``
      uses √n. The guards apply to ``log``/``root``; ``ensemble`` and ``asp`` are fixed α.
    * n is the number of active (not retired) workers; a retired worker's counter is dropped.
    * With α = 1 the worker copies θ exactly (no arithmetic), with α = 0 it never reads θ; the
      initial reply (``grad=None``) always copies θ, so every worker starts from the PS's model.
    """

    name = "shat"
    reply_scalars = 3

    def __init__(self, theta0: Tensor, num_workers: int, *, lr: float, weight_decay: float = 0.0,
                 alpha_mode: str = "log", momentum: float = 0.0):
        super().__init__(theta0, num_workers, lr=lr, weight_decay=weight_decay)
        self.alpha_mode = check_choice("alpha_mode", alpha_mode, ALPHA_MODES)
        self.momentum = check_real("momentum", momentum, low=0.0, high=1.0, high_open=True)
        self.name = {"log": "shat", "root": "shat-root"}.get(self.alpha_mode, self.alpha_mode)
        self._buf = self._theta.new_zeros(self._theta.shape) if self.momentum else None
        self._counts = [0] * self.num_workers
        self._sent_count = 0

    @property
    def keeps_local(self) -> bool:
        """True when a worker's model is its own (mixed with θ by α < 1), not a copy of a reply:
        checkpoints must carry it (docs/design/rules.md#shat)."""
        return self.alpha_mode != "asp"

    @property
    def counts(self) -> list[int]:
        """c_k for every worker (0 for retired ones)."""
        return list(self._counts)

    def _update(self, worker: int, grad: Tensor, meta: PushMeta) -> None:
        counts, alive = self._counts, self._alive
        for k in range(self.num_workers):
            if k != worker and alive[k]:
                counts[k] += 1
        asgd_update(self._theta, grad, self._momentum_buffer(), lr=self.coef(),
                    momentum=self.momentum, weight_decay=self.wd)
        self._sent_count, counts[worker] = counts[worker], 0

    def _make_reply(self, worker: int, *, pushed: bool) -> Reply:
        c = self._sent_count if pushed else 0
        lrs = self.lr if isinstance(self.lr, tuple) else (self.lr,)
        return Reply(self._theta, self._version, (float(c), float(self.num_active), *lrs))

    def set_groups(self, index, groups=None) -> None:
        """As :meth:`Rule.set_groups`; the reply then carries every group's η."""
        super().set_groups(index, groups)
        self.reply_scalars = 2 + self.groups

    def _join(self, worker: int) -> None:
        self._counts[worker] = 0

    def _leave(self, worker: int) -> None:
        self._counts[worker] = 0

    def alpha(self, reply: Reply) -> float:
        c, n = reply.scalars[:2]
        return shat_alpha(int(n), int(c), self.alpha_mode)

    def on_reply(self, local: Tensor, reply: Reply, grad: Tensor | None) -> None:
        """Worker side: local step with the pushed ``grad``, then mix with the reply's θ.
        ``grad=None`` (the initial reply) copies θ."""
        if grad is None:
            local.copy_(reply.params)
            return
        lrs = tuple(reply.scalars[2:])
        lr = lrs[0] if self._index is None else self.spread(lrs)
        shat_worker_step(local, grad, reply.params, lr=lr, alpha=self.alpha(reply),
                         keep=self._frozen)

    def _state(self) -> dict:
        d = super()._state()
        d["counts"] = list(self._counts)
        if self._buf is not None:
            d["momentum_buf"] = self._buf
        return d

    def _summary(self) -> dict:
        return {"shat_counts": [int(c) for c in self._counts]}

    def _load(self, d: dict) -> None:
        counts = need(d, "counts")
        if len(counts) != self.num_workers:
            raise CheckpointError("rule state 'counts' does not list every worker")
        self._counts = [int(c) for c in counts]
        self._load_buffer(d)
