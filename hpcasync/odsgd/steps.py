"""OD-SGD's pure parts: the workers' local optimizers and the global momentum step (Xu et al.,
"OD-SGD: One-step Delay Stochastic Gradient Descent for Distributed Training", arXiv 2005.06728).
The pipeline itself (one round in flight, warm-up rounds) is the runtime's job.

The global model is synchronous: round t averages all N gradients and applies momentum SGD::

    ḡ = mean_k g_k ;  d = ḡ + wd·W_t ;  v ← γ·v + d ;  W_{t+1} = W_t − η·v        (global_step)

While round t is in flight, worker k computes its next gradient on LOCAL weights built from the last
global weights W_t it holds and its own gradient g_t, which enters scaled to ĝ = g/N at N workers
(``local_step`` with ``grad_scale=1/N``)::

    sgd:          W^l = W_t − η_l·(ĝ + wd·W_t)
    dc:           W^l = W_t − η_l·(ĝ + wd·W_t + λ·ĝ⊙ĝ⊙Δ)                 (λ default 0.04)
    dc-adaptive:  MS ← m·MS + (1−m)·ĝ⊙ĝ ;  W^l = W_t − η_l·(ĝ + wd·W_t + λ₀/√(MS+ε)·ĝ⊙ĝ⊙Δ)
                                                            (λ₀ default 2, m 0, ε 1e-7)

Example (N = 8 workers)::

    W_local = local_step(W, g, mode="dc-adaptive", lr_local=0.5, grad_scale=1 / 8,
                         delta=W - W_prev, ms=ms, ms_momentum=0.0)
    global_step(W, g_mean, buf, lr=0.1, momentum=0.95)          # when the round completes

Differences from the paper: the dc-adaptive MS is updated with the current gradient before λ is
computed and starts at zero (as in DC-ASGD-a, dcasgd.py).

Design: docs/design/odsgd.md#local-and-global-steps (the 1/N, converting older settings, Δ, the
reference settings).
"""
from __future__ import annotations

from torch import Tensor

from ..errors import ConfigError
from ..rules.asgd import asgd_update
from ..rules.base import check_choice, check_real
from ..rules.dcasgd import dcasgd_adaptive_lambda

LOCAL_MODES = ("sgd", "dc", "dc-adaptive")
DELTA_MODES = ("last-step", "gap")
DEFAULT_LAMBDA = {"sgd": 0.0, "dc": 0.04, "dc-adaptive": 2.0}


def local_step(W: Tensor, g: Tensor, *, mode: str = "sgd", lr_local: float, grad_scale: float = 1.0,
               wd: float = 0.0, lam: float | None = None, delta: Tensor | None = None,
               ms: Tensor | None = None, ms_momentum: float = 0.0, eps: float = 1e-7,
               out: Tensor | None = None) -> Tensor:
    """The local weights W^l (``W`` and ``g`` are not modified; ``ms`` is updated in place for
    ``dc-adaptive``). Returns ``out`` (filled) or a new tensor.

    Args:
        W: the last global weights the worker holds, W_t.
        g: its gradient g_t.
        mode: ``"sgd"`` (default), ``"dc"`` or ``"dc-adaptive"``.
        lr_local: η_l.
        grad_scale: ĝ = grad_scale·g (OD-SGD passes 1/N; 1 leaves g as it is).
        wd: weight decay (on W, not scaled).
        lam: λ (dc, default 0.04) or λ₀ (dc-adaptive, default 2.0).
        delta: Δ (dc modes; docs/design/odsgd.md#local-and-global-steps).
        ms: the worker's mean-square buffer (dc-adaptive; zeros at the start).
        ms_momentum, eps: m (default 0, the authors') and ε of dc-adaptive.
        out: optional destination tensor (may not alias ``W``, ``g`` or ``delta``).
    """
    check_choice("local optimizer", mode, LOCAL_MODES)
    check_real("lr_local", lr_local, low=0.0)
    check_real("grad_scale", grad_scale, low=0.0, low_open=True)
    lam = DEFAULT_LAMBDA[mode] if lam is None else lam
    if grad_scale != 1.0:
        g = g.mul(grad_scale)
    d = g.add(W, alpha=wd) if wd != 0 else g.clone()
    if mode != "sgd":
        if delta is None:
            raise ConfigError(f"local optimizer {mode} needs delta (W_t - W_t-1 or W_t - W^l_t)")
        if mode == "dc-adaptive":
            if ms is None:
                raise ConfigError("local optimizer dc-adaptive needs its mean-square buffer ms")
            lam = dcasgd_adaptive_lambda(ms, g, lam0=lam, ms_momentum=ms_momentum, eps=eps)
        d.add_(delta.mul(g).mul_(g).mul_(lam))
    if out is None:
        return W.sub(d, alpha=lr_local)
    return out.copy_(W).sub_(d, alpha=lr_local)


def global_step(W: Tensor, g_mean: Tensor, momentum_buf: Tensor | None = None, *, lr: float,
                momentum: float = 0.0, wd: float = 0.0, nesterov: bool = False) -> None:
    """The round's global momentum-SGD step on the mean gradient, in place on ``W`` and
    ``momentum_buf`` (PyTorch ``SGD`` semantics, dampening 0)."""
    asgd_update(W, g_mean, momentum_buf, lr=lr, momentum=momentum, weight_decay=wd,
                nesterov=nesterov)


def delta_last_step(W_t: Tensor, W_prev: Tensor) -> Tensor:
    """Δ = W_t − W_{t−1} (``last-step``, default)."""
    return W_t.sub(W_prev)


def delta_gap(W_t: Tensor, W_local: Tensor) -> Tensor:
    """Δ = W_t − W^l_t (``gap``)."""
    return W_t.sub(W_local)
