"""Runtimes: who talks to whom. Each algorithm name maps to the module that runs it.

A runtime module provides ``run(ctx: RunContext) -> RunResult`` and may provide
``add_arguments(parser)`` (its own option group) and ``validate(cfg)`` (checks that need no MPI).
Modules are imported lazily so ``hpcasync --help`` and option errors stay fast.
"""
from __future__ import annotations

import importlib

RUNTIMES: dict[str, str] = {
    "ssgd": "hpcasync.ssgd.runtime",
    "daso": "hpcasync.daso.runtime",
    "odsgd": "hpcasync.odsgd.runtime",
    **{name: "hpcasync.ps.runtime" for name in ("asgd", "dcasgd", "dcasgd-a", "lcasgd", "shat",
                                                "shat-root", "ensemble", "asp", "smega2", "dana",
                                                "nag")},
}


def algorithms() -> tuple[str, ...]:
    return tuple(RUNTIMES)


def runtime_module(name: str):
    return importlib.import_module(RUNTIMES[name])


def runtime_modules():
    """Each distinct runtime module once (several algorithm names may share one)."""
    seen = []
    for mod in dict.fromkeys(RUNTIMES.values()):
        seen.append(importlib.import_module(mod))
    return seen
