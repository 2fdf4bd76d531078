"""Parameter-server update rules: pure tensor math, no MPI. The MPI parameter server and the
simulator drive the same rule objects (see base.py for the protocol).

``RULES`` maps a name to a factory; ``make_rule`` checks the hyperparameters and builds one::

    rule = make_rule("dcasgd-a", theta0, num_workers=4, lr=0.1)

=========== ==================================================================
name        rule
=========== ==================================================================
asgd        ASGD (optional shared momentum)                  asgd.py
dcasgd      DC-ASGD-c, constant λ                            dcasgd.py
dcasgd-a    DC-ASGD-a, adaptive λ                            dcasgd.py
lcasgd      LC-ASGD, loss-prediction compensation            lcasgd.py
shat        SHAT, α = 1 − (n/c)/ln n                         shat.py
shat-root   SHAT-root, α = 1 − (n/c)/√n                      shat.py
ensemble    SHAT with α = 0 (independent workers)            shat.py
asp         SHAT with α = 1 (= ASGD)                         shat.py
smega2      SMEGA2, one momentum buffer, look-ahead reply    smega2.py
dana        DANA-Zero, N momentum buffers, look-ahead reply  dana.py
nag         NAG-ASGD, shared Nesterov buffer                 nag.py
=========== ==================================================================

OD-SGD is synchronous at the PS; its pure parts are functions in odsgd.py.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import Tensor

from ..errors import ConfigError
from .asgd import ASGD, asgd_update
from .base import PushMeta, Reply, Rule, smega2_lr, step_decay_lr, warmup_lr
from .dana import DANAZero
from .dcasgd import DCASGD
from .lcasgd import LCASGD
from .nag import NAG
from .shat import SHAT, shat_alpha
from .smega2 import SMEGA2, smega2_estimate

RULES: dict[str, functools.partial] = {
    "asgd": functools.partial(ASGD),
    "dcasgd": functools.partial(DCASGD, mode="constant"),
    "dcasgd-a": functools.partial(DCASGD, mode="adaptive"),
    "lcasgd": functools.partial(LCASGD),
    "shat": functools.partial(SHAT, alpha_mode="log"),
    "shat-root": functools.partial(SHAT, alpha_mode="root"),
    "ensemble": functools.partial(SHAT, alpha_mode="ensemble"),
    "asp": functools.partial(SHAT, alpha_mode="asp"),
    "smega2": functools.partial(SMEGA2),
    "dana": functools.partial(DANAZero),
    "nag": functools.partial(NAG),
}


#: rules whose momentum is the algorithm (``momentum`` is theirs; the others' is an option)
MOMENTUM_RULES = ("smega2", "dana", "nag")


def ps_lr_factor(name: str, num_workers: int, warmup_epochs: float | None = None):
    """The paper default learning-rate schedule of rule ``name`` as ``factor(epoch_float)`` of the
    base lr (the server's lr for a push = the pushing worker's lr × factor), or None (constant).

    smega2, dana, nag: the SMEGA2 paper's schedule (:func:`smega2_lr`: linear warm-up from lr/N
    over ``warmup_epochs`` (default 5), ×0.1 at epochs 80 and 120), which its simulator gives
    every algorithm it compares. The others: constant, or a linear warm-up from lr/N when
    ``warmup_epochs`` > 0.
    """
    if name in MOMENTUM_RULES:
        warm = 5.0 if warmup_epochs is None else warmup_epochs
        return functools.partial(_smega2_factor, num_workers=num_workers, warmup_epochs=warm)
    if not warmup_epochs:
        return None
    return functools.partial(_warmup_factor, num_workers=num_workers, warmup_epochs=warmup_epochs)


def _smega2_factor(epoch_float: float, *, num_workers: int, warmup_epochs: float) -> float:
    return smega2_lr(epoch_float, base_lr=1.0, num_workers=num_workers,
                     warmup_epochs=warmup_epochs)


def _warmup_factor(epoch_float: float, *, num_workers: int, warmup_epochs: float) -> float:
    return warmup_lr(1.0, epoch_float, warmup_epochs, 1.0 / num_workers)


def rule_hyperparameters(name: str) -> dict[str, Any]:
    """The hyperparameters rule ``name`` accepts, with their defaults (``inspect.Parameter.empty``
    for required ones such as ``lr``)."""
    factory = _factory(name)
    params = inspect.signature(factory.func).parameters
    return {k: p.default for k, p in params.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and k not in factory.keywords}


def make_rule(name: str, theta0: Tensor, num_workers: int, **hyper: Any) -> Rule:
    """Build rule ``name``; an unknown rule, an unknown or fixed hyperparameter, or a bad value
    raises ConfigError naming it."""
    accepted = rule_hyperparameters(name)
    fixed = _factory(name).keywords
    for key in hyper:
        if key in fixed:
            raise ConfigError(f"rule {name!r} fixes {key}={fixed[key]!r}; do not pass {key}")
        if key not in accepted:
            raise ConfigError(f"unknown hyperparameter {key!r} for rule {name!r} "
                              f"(accepted: {', '.join(sorted(accepted))})")
    missing = [k for k, d in accepted.items() if d is inspect.Parameter.empty and k not in hyper]
    if missing:
        raise ConfigError(f"rule {name!r} needs {', '.join(missing)}")
    return RULES[name](theta0, num_workers, **hyper)


def _factory(name: str) -> functools.partial:
    if name not in RULES:
        raise ConfigError(f"unknown rule {name!r} (choose from {', '.join(RULES)})")
    return RULES[name]


__all__ = ["RULES", "MOMENTUM_RULES", "make_rule", "ps_lr_factor", "rule_hyperparameters", "PushMeta", "Reply", "Rule", "ASGD",
           "DCASGD", "LCASGD", "SHAT", "SMEGA2", "DANAZero", "NAG", "asgd_update", "shat_alpha",
           "smega2_estimate", "smega2_lr", "step_decay_lr", "warmup_lr"]
