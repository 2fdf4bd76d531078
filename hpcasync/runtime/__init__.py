"""Runtimes: who talks to whom. Each algorithm's runtime module is named by its entry in
:mod:`hpcasync.registry`.

A runtime module provides ``run(ctx: RunContext) -> RunResult`` and may provide
``add_arguments(parser)`` (its own option group) and ``validate(cfg)`` (checks that need no MPI).
The synchronous families' ``run`` is the one loop of :mod:`hpcasync.runtime.driver` over their
:class:`~hpcasync.runtime.driver.Family`.
Modules are imported lazily, and the options come from torch-free modules (``Algorithm.arguments``),
so ``hpcasync --help`` and option errors stay fast.
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


def argument_checks(cfg) -> None:
    """The torch-free checks of ``cfg.algorithm``'s options: ``--compress`` and ``--powersgd-*``
    (:func:`hpcasync.ssgd.options.check_compress`), then ``validate_options(cfg)`` of its
    arguments module when it has one (the runtime's ``validate`` makes them again, with the
    rest)."""
    from ..ssgd.options import check_compress

    check_compress(cfg)
    module = importlib.import_module(registry.argument_modules()[cfg.algorithm])
    if hasattr(module, "validate_options"):
        module.validate_options(cfg)


def argument_modules():
    """Each distinct module that adds CLI options once (:func:`hpcasync.registry.argument_modules`:
    the built-in families' are torch-free)."""
    return [importlib.import_module(m) for m in dict.fromkeys(registry.argument_modules().values())]
