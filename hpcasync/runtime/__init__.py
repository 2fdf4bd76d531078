"""Runtimes: who talks to whom. Each algorithm's runtime module is named by its entry in
:mod:`hpcasync.registry`.

A runtime module provides ``run(ctx: RunContext) -> RunResult`` and may provide
``add_arguments(parser)`` (its own option group) and ``validate(cfg)`` (checks that need no MPI).
Modules are imported lazily so ``hpcasync --help`` and option errors stay fast.
"""
from __future__ import annotations

import importlib

from .. import registry

#: name -> runtime module, a live view of the registry
RUNTIMES = registry.LiveMapping(registry.runtimes)


def algorithms() -> tuple[str, ...]:
    return registry.names()


def runtime_module(name: str):
    """The runtime module of algorithm ``name`` (an unknown name: ConfigError naming the choices)."""
    return importlib.import_module(registry.get(name).runtime)


def runtime_modules():
    """Each distinct runtime module once (several algorithm names may share one)."""
    return [importlib.import_module(m) for m in dict.fromkeys(registry.runtimes().values())]
