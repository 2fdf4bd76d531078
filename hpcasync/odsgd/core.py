"""OD-SGD's round as pure functions over flat tensors, shared by the MPI runtime
(:mod:`hpcasync.odsgd.runtime`) and the simulator (Xu et al., arXiv 2005.06728).

State: the global model (:class:`GlobalState`: W_t, W_{t−1}, momentum buffer v; identical on every
worker) and one :class:`WorkerState` per worker (the weights W^l_t its last gradient was computed on,
its dc-adaptive mean square). One round t, given each worker's g_t^k computed on its W^l_t::

    local:   W^l_{t+1,k} = LocalOpt(W_t, g_t^k / N)      (local_update; sgd / dc / dc-adaptive, with
                                                     Δ = W_t − W_{t−1} "last-step" or W_t − W^l_t "gap")
    global:  ḡ_t = (1/N) Σ_k g_t^k ;  W_{t−1} ← W_t ;  v ← γ·v + ḡ_t + wd·W_t ;  W_{t+1} = W_t − η·v
                                                    (global_update)

Example (the simulator's loop, N virtual workers)::

    hp = ODSGDHyper(lr=0.05, momentum=0.9, local_opt="dc-adaptive", lr_local=0.5)
    glob = GlobalState.create(theta0)
    workers = [WorkerState.create(theta0.clone(), hp) for _ in range(N)]
    for t in range(T):
        grads = [grad_fn(k, ws.local) for k, ws in enumerate(workers)]
        simulate_round(glob, workers, grads, hp=hp, warmup=t < hp.warmup_iters)
    # glob.W is the model to evaluate

Design: docs/design/odsgd.md#round-as-pure-functions (staleness, warm-up rounds, param groups).
Differences from the paper: :class:`~hpcasync.odsgd.ODSGD`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError
from ..rules.base import check_choice, check_int, check_real
from .steps import (DELTA_MODES, LOCAL_MODES, delta_gap, delta_last_step, global_step,
                           local_step)

__all__ = ["ODSGDHyper", "GlobalState", "WorkerState", "local_update", "global_update",
           "simulate_round", "group_ranges"]


@dataclass(frozen=True, kw_only=True)
class ODSGDHyper:
    """OD-SGD hyperparameters: global momentum SGD (lr, momentum, weight_decay), the local optimizer
    (local_opt, lr_local, lam = λ / λ₀ (None: the mode's default), delta, ms_momentum, eps) and
    warmup_iters (steps of plain SSGD first)."""
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    local_opt: str = "dc-adaptive"
    lr_local: float = 0.5
    lam: float | None = None
    delta: str = "last-step"
    ms_momentum: float = 0.0
    eps: float = 1e-7
    warmup_iters: int = 200

    def __post_init__(self):
        check_real("lr", self.lr, low=0.0, low_open=True)
        check_real("momentum", self.momentum, low=0.0, high=1.0, high_open=True)
        check_real("weight_decay", self.weight_decay, low=0.0)
        check_choice("local optimizer", self.local_opt, LOCAL_MODES)
        check_real("lr_local", self.lr_local, low=0.0)
        if self.lam is not None:
            check_real("lambda", self.lam, low=0.0)
        check_choice("delta", self.delta, DELTA_MODES)
        check_real("ms_momentum", self.ms_momentum, low=0.0, high=1.0, high_open=True)
        check_real("eps", self.eps, low=0.0, low_open=True)
        check_int("warmup_iters", self.warmup_iters, low=0)


@dataclass
class GlobalState:
    """The global model W_t, the previous one W_{t−1} (for Δ) and the momentum buffer v."""
    W: Tensor
    W_prev: Tensor
    buf: Tensor

    @classmethod
    def create(cls, theta0: Tensor) -> "GlobalState":
        return cls(theta0.clone(), theta0.clone(), torch.zeros_like(theta0))


@dataclass
class WorkerState:
    """One worker's side: ``local`` = the weights its last gradient was computed on (in the
    runtime, the model's own flat parameters), ``ms`` = its dc-adaptive mean square."""
    local: Tensor
    ms: Tensor | None = None

    @classmethod
    def create(cls, local: Tensor, hp: ODSGDHyper) -> "WorkerState":
        return cls(local, torch.zeros_like(local) if hp.local_opt == "dc-adaptive" else None)


def group_ranges(offsets, sizes, index, hypers) -> list[tuple[int, int, ODSGDHyper | None]]:
    """θ as ``(start, end, hp)`` ranges: parameter k (at ``offsets[k]``, ``sizes[k]`` elements) in
    group ``index[k]`` steps with ``hypers[index[k]]``; index −1 or a None hyper (lr 0) is held
    (hp None). Adjacent parameters of one group share a range."""
    out: list[tuple[int, int, ODSGDHyper | None]] = []
    last = None
    for start, size, gi in zip(offsets, sizes, index):
        if not size:
            continue
        key = -1 if gi < 0 or hypers[gi] is None else gi
        if out and key == last and out[-1][1] == start:
            out[-1] = (out[-1][0], start + size, out[-1][2])
        else:
            out.append((start, start + size, None if key < 0 else hypers[key]))
        last = key
    return out


def local_update(glob: GlobalState, ws: WorkerState, g: Tensor, *, hp: ODSGDHyper,
                 num_workers: int, groups=None) -> Tensor:
    """W^l_{t+1} = LocalOpt(W_t, g_t/N) at N = ``num_workers`` (the authors' rescale), written
    into ``ws.local`` (Δ from ``ws.local`` = W^l_t before the write, for ``gap``); updates
    ``ws.ms``. ``groups``: :func:`group_ranges` (None: ``hp`` over all of θ). Returns
    ``ws.local``."""
    check_int("num_workers", num_workers, low=1)
    if groups is None:
        return _local_range(glob.W, glob.W_prev, ws.local, ws.ms, g, hp, num_workers)
    for a, b, h in groups:
        if h is None:
            ws.local[a:b].copy_(glob.W[a:b])
        else:
            _local_range(glob.W[a:b], glob.W_prev[a:b], ws.local[a:b],
                         None if ws.ms is None else ws.ms[a:b], g[a:b], h, num_workers)
    return ws.local


def _local_range(W, W_prev, local, ms, g, hp: ODSGDHyper, num_workers: int) -> Tensor:
    delta = None
    if hp.local_opt != "sgd":
        delta = (delta_last_step(W, W_prev) if hp.delta == "last-step" else delta_gap(W, local))
    return local_step(W, g, mode=hp.local_opt, lr_local=hp.lr_local,
                      grad_scale=1.0 / num_workers, wd=hp.weight_decay,
                      lam=hp.lam, delta=delta, ms=ms, ms_momentum=hp.ms_momentum, eps=hp.eps,
                      out=local)


def global_update(glob: GlobalState, g_mean: Tensor, *, hp: ODSGDHyper, groups=None) -> None:
    """Complete a round: W_{t−1} ← W_t, then the momentum-SGD step on the mean gradient
    (``groups``: per range, see :func:`group_ranges`)."""
    glob.W_prev.copy_(glob.W)
    if groups is None:
        global_step(glob.W, g_mean, glob.buf, lr=hp.lr, momentum=hp.momentum,
                    wd=hp.weight_decay)
        return
    for a, b, h in groups:
        if h is not None:
            global_step(glob.W[a:b], g_mean[a:b], glob.buf[a:b], lr=h.lr, momentum=h.momentum,
                        wd=h.weight_decay)


def simulate_round(glob: GlobalState, workers: list[WorkerState], grads: list[Tensor], *,
                   hp: ODSGDHyper, warmup: bool = False) -> None:
    """One round for N virtual workers in one process (the simulator's step).

    ``grads[k]`` must have been computed on ``workers[k].local``. Afterwards ``glob`` holds W_{t+1}
    and each ``workers[k].local`` the weights worker k computes its next gradient on:
    LocalOpt(W_t, g_k), or W_{t+1} itself in a warm-up round (plain SSGD).
    """
    if len(grads) != len(workers) or not grads:
        raise ConfigError(f"simulate_round: {len(grads)} gradients for {len(workers)} workers")
    if not warmup:
        for ws, g in zip(workers, grads):
            local_update(glob, ws, g, hp=hp, num_workers=len(workers))
    g_mean = torch.stack(grads).sum(0).div_(len(grads))
    global_update(glob, g_mean, hp=hp)
    if warmup:
        for ws in workers:
            ws.local.copy_(glob.W)
