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
from ..errors import ConfigError

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
    """The torch-free checks of ``cfg.algorithm``'s options: an option another algorithm owns
    (:func:`hpcasync.registry.option_owners`, whatever the family: a plugin's option given to a
    built-in one is refused, not ignored), ``--compress`` and ``--powersgd-*``
    (:func:`hpcasync.ssgd.options.check_compress`), then ``validate_options(cfg)`` of its
    arguments module when it has one (the runtime's ``validate`` makes them again, with the
    rest)."""
    from ..ssgd.options import check_compress

    for option, owners in registry.option_owners().items():
        if cfg.options.get(option) is not None and cfg.algorithm not in owners:
            raise ConfigError(f"--{option.replace('_', '-')} applies to {', '.join(owners)}, not "
                              f"{cfg.algorithm}")
    family = registry.get(cfg.algorithm).family
    for option, (owner, default) in family_options().items():
        if owner != family and cfg.options.get(option, default) != default:
            names = registry.by_family(owner)
            who = ", ".join(names) if len(names) <= 4 else f"the {owner} family's algorithms"
            raise ConfigError(f"--{option.replace('_', '-')} applies to {who}, not "
                              f"{cfg.algorithm}")
    if family != "ps" and getattr(cfg, "ps_rank", 0) != 0:
        raise ConfigError(f"--ps-rank applies to the ps family's algorithms, not {cfg.algorithm} "
                          "(it has no server)")
    check_compress(cfg)
    module = importlib.import_module(registry.argument_modules()[cfg.algorithm])
    if hasattr(module, "validate_options"):
        module.validate_options(cfg)


def family_options() -> dict:
    """``dest -> (family, default)`` of the options one family owns: those named after it
    (``--daso-*``, ``--odsgd-*``, ``--ps-*``, ``--ssgd-*``) and those its arguments module lists
    in ``FAMILY_OPTIONS`` (``--link-delay-us-per-mb``, the ssgd family's). Another family's
    algorithm would ignore them, so :func:`argument_checks` refuses one given to it. From the
    arguments modules' parsers (torch-free)."""
    import argparse

    out, families = {}, {}
    for name, module in registry.argument_modules().items():
        families.setdefault(module, set()).add(registry.get(name).family)
    for name, fams in families.items():
        module = importlib.import_module(name)
        parser = argparse.ArgumentParser(add_help=False)
        module.add_arguments(parser)
        own = getattr(module, "FAMILY_OPTIONS", ())
        for action in parser._actions:      # noqa: SLF001 - argparse has no public accessor
            prefix = action.dest.split("_")[0]
            if prefix in registry.FAMILIES:
                out[action.dest] = (prefix, action.default)
            elif action.dest in own and len(fams) == 1:
                out[action.dest] = (next(iter(fams)), action.default)
    return out


def argument_modules():
    """Each distinct module that adds CLI options once (:func:`hpcasync.registry.argument_modules`:
    the built-in families' are torch-free)."""
    return [importlib.import_module(m) for m in dict.fromkeys(registry.argument_modules().values())]
