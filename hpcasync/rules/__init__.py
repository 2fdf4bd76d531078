"""Parameter-server update rules: pure tensor math, no MPI. The MPI parameter server and the
simulator drive the same rule objects (see base.py for the protocol).

``RULES`` maps a name to a factory (a live view of :mod:`hpcasync.registry`, whose entries name
the rule classes below); ``make_rule`` checks the hyperparameters and builds one::

    rule = make_rule("dcasgd-a", theta0, num_workers=4, lr=0.1)

Design: docs/design/rules.md#the-rules (the table of rules; each rule's section follows it).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import Tensor

from .. import registry
from ..errors import ConfigError
from .asgd import ASGD, asgd_update
from .base import PushMeta, Reply, Rule, smega2_lr, step_decay_lr, warmup_lr
from .dana import DANAZero
from .dcasgd import DCASGD
from .delay_adaptive import DelayAdaptiveASGD
from .lcasgd import LCASGD
from .nag import NAG
from .rennala import Rennala
from .ringmaster import Ringmaster
from .shat import SHAT, shat_alpha
from .smega2 import SMEGA2, smega2_estimate


def _rule_factories() -> dict[str, functools.partial]:
    """name -> ``partial(RuleClass, **fixed)`` of every registered parameter-server algorithm."""
    return {name: _partial(name) for name in registry.ps_names()}


def _partial(name: str) -> functools.partial:
    alg = registry.get(name)
    return functools.partial(registry.resolve(alg.rule), **dict(alg.rule_kwargs))


#: name -> rule factory (``partial(RuleClass, **fixed)``), a live view of :mod:`hpcasync.registry`
RULES = registry.LiveMapping(_rule_factories)
#: rules whose momentum is the algorithm (``momentum`` is theirs; the others' is an option)
MOMENTUM_RULES = registry.LiveNames(registry.momentum_rules)


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
    return _factory(name)(theta0, num_workers, **hyper)


def _factory(name: str) -> functools.partial:
    if registry.find(name) is None or not registry.get(name).is_ps:
        raise ConfigError(f"unknown rule {name!r} (choose from {', '.join(registry.ps_names())})")
    return _partial(name)


__all__ = ["RULES", "MOMENTUM_RULES", "make_rule", "ps_lr_factor", "rule_hyperparameters", "PushMeta", "Reply", "Rule", "ASGD",
           "DCASGD", "DelayAdaptiveASGD", "LCASGD", "SHAT", "SMEGA2", "DANAZero", "NAG", "Rennala",
           "Ringmaster",
           "asgd_update", "shat_alpha",
           "smega2_estimate", "smega2_lr", "step_decay_lr", "warmup_lr"]
