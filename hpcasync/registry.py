"""The algorithms, in one table: every list of names in hpcasync derives from it.

Each entry says the algorithm's family (the package that runs it), its runtime module, its update
rule (the parameter-server family), its defaults and the CLI options it owns. The front door
(``hpcasync.algorithms()``), the CLI, the rules (``hpcasync.rules.RULES``), the parameter server
and the simulator ask this module when they are used, so adding an algorithm is one entry::

    from hpcasync import registry
    registry.register(registry.ps_algorithm("asgd-copy", "hpcasync.rules.asgd:ASGD"))

A low layer: it imports the standard library and :mod:`hpcasync.errors` only (no torch), so
``hpcasync --help`` and option errors stay fast.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .errors import ConfigError

#: the packages that run an algorithm (``hpcasync.<family>``)
FAMILIES = ("ssgd", "daso", "odsgd", "ps")
#: the learning rate ``--lr`` means when an entry gives no ``default_lr``
DEFAULT_LR = 0.05


class Option(NamedTuple):
    """A CLI option an algorithm owns: ``--DEST`` (underscores as dashes), the rule's keyword
    ``hyper`` it sets, its ``type`` (int, float, str; bool: a flag) and its ``help``. The family's
    ``arguments`` module adds it to the parser (:func:`add_options`)."""
    dest: str
    hyper: str
    type: type = float
    help: str = ""


@dataclass(frozen=True)
class Algorithm:
    """One algorithm.

    Args:
        name: the name users type (``--algorithm``, ``hpcasync.optimizer(name, ...)``).
        family: one of :data:`FAMILIES`.
        runtime: the CLI's runtime module (``run(ctx)``, optional ``add_arguments``/``validate``).
        arguments: the module whose ``add_arguments(parser)`` adds the family's CLI options
            without importing torch (so a command line is parsed, and a bad option said, in a
            fraction of a second on every rank), and may provide ``validate_options(cfg)``, its
            torch-free checks; None: the runtime module's ``add_arguments``.
        rule: the parameter-server family's update rule, ``"module:Class"`` (imported when built).
        optimizer: the ``ssgd`` family's optimizer class, ``"module:Class"`` (a subclass of
            :class:`hpcasync.ssgd.DistributedOptimizer`, imported when built): its
            :class:`Option` s reach it as keywords, through its ``cli_keywords`` classmethod.
        rule_kwargs: keyword arguments the name fixes on the rule, as pairs (``(("mode",
            "adaptive"),)``: dcasgd-a is DCASGD with adaptive λ).
        momentum_rule: the momentum is the algorithm's own (``--momentum`` and an SGD's momentum
            are its hyperparameter; ``--ps-momentum`` does not apply) and the lr follows the
            SMEGA2 paper's schedule.
        user_optimizer: it runs the user's torch optimizer (``--optimizer``, a required
            ``optimizer`` argument of ``hpcasync.optimizer``).
        horovod_backend: ``--backend horovod`` applies.
        simulated: ``hpcasync sim`` runs it.
        options: the CLI options only this algorithm takes, each an :class:`Option` (or a
            ``(dest, hyperparameter)`` pair, for an option some ``arguments`` module adds
            itself); another algorithm given one is a ConfigError.
        default_lr: the lr ``--lr`` means when not given (None: :data:`DEFAULT_LR`).
        summary: one line for tables and help.
    """
    name: str
    family: str
    runtime: str
    rule: str | None = None
    optimizer: str | None = None
    rule_kwargs: tuple[tuple[str, object], ...] = ()
    momentum_rule: bool = False
    user_optimizer: bool = False
    horovod_backend: bool = False
    simulated: bool = False
    options: tuple[tuple, ...] = ()
    default_lr: float | None = None
    summary: str = ""
    arguments: str | None = None

    @property
    def is_ps(self) -> bool:
        return self.family == "ps"


def ps_algorithm(name: str, rule: str, summary: str = "", **fields) -> Algorithm:
    """An entry of the parameter-server family: run by ``hpcasync.ps.runtime`` and simulated."""
    return Algorithm(name, "ps", "hpcasync.ps.runtime", rule=rule, simulated=True,
                     summary=summary, arguments="hpcasync.ps.options", **fields)


def sync_method(name: str, optimizer: str, summary: str = "", **fields) -> Algorithm:
    """An entry of the ``ssgd`` family (local SGD, SlowMo, DiLoCo and their kin): its optimizer
    class ``"module:Class"`` runs the user's torch optimizer, under ``hpcasync.ssgd.runtime``."""
    fields.setdefault("user_optimizer", True)
    return Algorithm(name, "ssgd", "hpcasync.ssgd.runtime", optimizer=optimizer, summary=summary,
                     arguments="hpcasync.ssgd.options", **fields)


_RULES, _SSGD = "hpcasync.rules.", "hpcasync.ssgd."
_TABLE: dict[str, Algorithm] = {}


def register(alg: Algorithm) -> Algorithm:
    """Add ``alg`` (tests, plugins); a taken name or a malformed entry is a ConfigError."""
    if not isinstance(alg, Algorithm):
        raise ConfigError(f"register() takes an hpcasync.registry.Algorithm, got {type(alg).__name__}")
    if not alg.name or not isinstance(alg.name, str):
        raise ConfigError(f"an algorithm needs a non-empty name, got {alg.name!r}")
    if alg.name in _TABLE:
        raise ConfigError(f"algorithm {alg.name!r} is already registered; choose another name")
    if alg.family not in FAMILIES:
        raise ConfigError(f"algorithm {alg.name!r}: family {alg.family!r} is not one of: "
                          f"{', '.join(FAMILIES)}")
    if alg.is_ps != (alg.rule is not None):
        raise ConfigError(f"algorithm {alg.name!r}: the ps family, and only it, has an update rule "
                          "(rule='module:Class')")
    if (alg.family == "ssgd") != (alg.optimizer is not None):
        raise ConfigError(f"algorithm {alg.name!r}: the ssgd family, and only it, names its "
                          "optimizer class (optimizer='module:Class')")
    for what in ("rule", "optimizer"):
        value = getattr(alg, what)
        if value is not None and (not isinstance(value, str) or value.count(":") != 1):
            raise ConfigError(f"algorithm {alg.name!r}: {what} {value!r} is not 'module:Class'")
    declared = {p.dest: p for a in _TABLE.values() for p in a.options if isinstance(p, Option)}
    for o in alg.options:
        other = declared.get(o[0])
        if isinstance(o, Option) and other is not None and other.type is not o.type:
            raise ConfigError(f"algorithm {alg.name!r}: option --{o.dest.replace('_', '-')} is "
                              f"already declared with type {other.type.__name__}, not "
                              f"{o.type.__name__}")
    _TABLE[alg.name] = alg
    return alg


def unregister(name: str) -> None:
    """Remove a registered algorithm (tests); an unknown name is a ConfigError."""
    get(name)
    del _TABLE[name]


# -- queries: every derived list calls one of these when it is used --------------------------------

def names() -> tuple[str, ...]:
    """Every algorithm name, in registration order (the 14 built-ins first)."""
    return tuple(_TABLE)


def get(name: str) -> Algorithm:
    """The entry of ``name``; an unknown name is a ConfigError naming the choices."""
    try:
        return _TABLE[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown algorithm {name!r} (choose from {', '.join(_TABLE)})") from None


def find(name: str) -> Algorithm | None:
    """The entry of ``name``, or None."""
    return _TABLE.get(name) if isinstance(name, str) else None


def by_family(family: str) -> tuple[str, ...]:
    if family not in FAMILIES:
        raise ConfigError(f"unknown family {family!r} (choose from {', '.join(FAMILIES)})")
    return tuple(a.name for a in _TABLE.values() if a.family == family)


def ps_names() -> tuple[str, ...]:
    """The parameter-server algorithms (each has an update rule in ``hpcasync.rules``)."""
    return by_family("ps")


def sync_names() -> tuple[str, ...]:
    """The synchronous algorithms (no server rank)."""
    return tuple(a.name for a in _TABLE.values() if not a.is_ps)


def momentum_rules() -> tuple[str, ...]:
    return tuple(a.name for a in _TABLE.values() if a.momentum_rule)


def user_optimizer_names() -> tuple[str, ...]:
    return tuple(a.name for a in _TABLE.values() if a.user_optimizer)


def horovod_names() -> tuple[str, ...]:
    return tuple(a.name for a in _TABLE.values() if a.horovod_backend)


def simulated_names() -> tuple[str, ...]:
    return tuple(a.name for a in _TABLE.values() if a.simulated)


def runtimes() -> dict[str, str]:
    """name -> runtime module."""
    return {a.name: a.runtime for a in _TABLE.values()}


def argument_modules() -> dict[str, str]:
    """name -> the module whose ``add_arguments`` adds its CLI options (:attr:`Algorithm.arguments`,
    else the runtime module)."""
    return {a.name: a.arguments or a.runtime for a in _TABLE.values()}


def option_owners() -> dict[str, tuple[str, ...]]:
    """CLI option dest -> the algorithms that take it (the others refuse it)."""
    owners: dict[str, tuple[str, ...]] = {}
    for a in _TABLE.values():
        for option in a.options:
            owners[option[0]] = owners.get(option[0], ()) + (a.name,)
    return owners


def resolve(spec: str):
    """The object an entry's ``"module:Class"`` (``rule``, ``optimizer``) names, imported now."""
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def given(name: str, options: Mapping) -> dict:
    """The keywords of ``name``'s options that ``options`` (a config's, by ``dest``) gives:
    ``{hyper: value}``, an option left at None (not given) absent."""
    return {o[1]: options[o[0]] for o in get(name).options if options.get(o[0]) is not None}


def add_options(group, family: str) -> None:
    """Add to ``group`` (an argparse group) the :class:`Option` s of ``family``'s entries, each
    once, its help prefixed with the algorithms that take it."""
    declared: dict[str, Option] = {}
    for a in _TABLE.values():
        for o in a.options:
            if a.family == family and isinstance(o, Option):
                declared.setdefault(o.dest, o)
    owners = option_owners()
    for dest, o in declared.items():
        kind = ({"action": "store_const", "const": True} if o.type is bool else {"type": o.type})
        group.add_argument("--" + dest.replace("_", "-"), default=None, **kind,
                           help=f"{'/'.join(owners[dest])}: {o.help}")


def algorithm_lrs() -> dict[str, float]:
    """The entries whose default lr is not :data:`DEFAULT_LR`."""
    return {a.name: a.default_lr for a in _TABLE.values() if a.default_lr is not None}


def default_lr(name: str) -> float:
    """The lr ``--lr`` means when it is not given (an unknown name: :data:`DEFAULT_LR`; the
    name's own check reports it)."""
    alg = find(name)
    return DEFAULT_LR if alg is None or alg.default_lr is None else alg.default_lr


# -- live views, for modules that expose a constant other code reads ------------------------------

class LiveNames(Sequence):
    """A tuple-like view of ``query()``, read at each use (so a registered name shows)."""

    def __init__(self, query: Callable[[], tuple[str, ...]]):
        self._query = query

    def __getitem__(self, i):
        return self._query()[i]

    def __len__(self) -> int:
        return len(self._query())

    def __contains__(self, name) -> bool:
        return name in self._query()

    def __iter__(self):
        return iter(self._query())

    def __add__(self, other):
        return self._query() + tuple(other)

    def __radd__(self, other):
        return tuple(other) + self._query()

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._query())


class LiveMapping(Mapping):
    """A read-only dict-like view of ``query()``, read at each use."""

    def __init__(self, query: Callable[[], Mapping]):
        self._query = query

    def __getitem__(self, key):
        return self._query()[key]

    def __iter__(self):
        return iter(self._query())

    def __len__(self) -> int:
        return len(self._query())

    def __repr__(self) -> str:
        return repr(dict(self._query()))


# -- the table ------------------------------------------------------------------------------------

for _alg in (
    Algorithm("ssgd", "ssgd", "hpcasync.ssgd.runtime", user_optimizer=True, horovod_backend=True,
              simulated=True, summary="synchronous SGD: one gradient allreduce per step",
              optimizer=_SSGD + "optimizer:DistributedOptimizer",
              arguments="hpcasync.ssgd.options"),
    Algorithm("daso", "daso", "hpcasync.daso.runtime", user_optimizer=True, horovod_backend=True,
              summary="DASO: node-local sync, delayed global averaging",
              arguments="hpcasync.daso.options"),
    Algorithm("odsgd", "odsgd", "hpcasync.odsgd.runtime",
              summary="OD-SGD: synchronous PS with its own global momentum",
              arguments="hpcasync.odsgd.options"),
    sync_method("localsgd", _SSGD + "localsgd:LocalSGD",
                "post-local SGD: SSGD warm-up, then local steps averaged every H",
                options=(Option("localsgd_period", "period", int,
                                "steps between two averages of the parameters (default 4, "
                                "torch's example)"),
                         Option("localsgd_warmup_steps", "warmup_steps", int,
                                "SSGD steps before the local ones (post-local SGD; default 100, "
                                "torch's example)"))),
    sync_method("slowmo", _SSGD + "slowmo:SlowMo",
                "SlowMo: local SGD with a slow momentum on the averaged displacement",
                options=(Option("slowmo_period", "period", int,
                                "local steps between two syncs (default 48, fairscale's)"),
                         Option("slowmo_momentum", "slow_momentum", float,
                                "the slow momentum beta (default 0.5)"),
                         Option("slowmo_lr", "slow_lr", float, "the slow lr alpha (default 1.0)"))),
    sync_method("diloco", _SSGD + "diloco:DiLoCo",
                "DiLoCo / Streaming DiLoCo: inner steps, outer Nesterov step on the mean "
                "pseudo-gradient",
                options=(Option("diloco_sync_every", "sync_every", int,
                                "inner steps between two syncs of each fragment (H; default 500, "
                                "the paper's)"),
                         Option("diloco_outer_lr", "outer_lr", float,
                                "the outer SGD's lr (default 0.7, the paper's)"),
                         Option("diloco_outer_momentum", "outer_momentum", float,
                                "the outer SGD's Nesterov momentum (default 0.9)"),
                         Option("diloco_fragments", "fragments", int,
                                "Streaming DiLoCo's fragments, runs of the model's top-level "
                                "modules (default 1)"),
                         Option("diloco_sync_delay", "fragment_sync_delay", int,
                                "inner steps between a fragment's pseudo-gradient and its outer "
                                "step (Streaming DiLoCo's tau; default 0)"),
                         Option("diloco_alpha", "fragment_update_alpha", float,
                                "share of the rank's own parameters mixed into the outer result "
                                "(Streaming DiLoCo's alpha; default 0)"),
                         Option("diloco_hierarchical", "hierarchical", bool,
                                "the ranks of a node train one replica with synchronous SGD, "
                                "DiLoCo runs across the nodes (--ranks-per-node sets virtual "
                                "nodes; nodes of equal size; not under --with-ft ulfm)"),
                         Option("diloco_quantize", "quantize", bool,
                                "exchange the outer gradients as FP8 (E4M3, a scale per chunk) "
                                "and average them in float32, as torchft's should_quantize (not "
                                "with --diloco-hierarchical)"))),
    ps_algorithm("asgd", _RULES + "asgd:ASGD", "ASGD (optional shared momentum)"),
    ps_algorithm("dcasgd", _RULES + "dcasgd:DCASGD", "DC-ASGD-c, constant λ",
                 rule_kwargs=(("mode", "constant"),),
                 options=(Option("dc_lambda", "lam", float, "constant λ (0.04)"),)),
    ps_algorithm("dcasgd-a", _RULES + "dcasgd:DCASGD", "DC-ASGD-a, adaptive λ",
                 rule_kwargs=(("mode", "adaptive"),),
                 options=(Option("dc_lambda0", "lam", float, "λ₀ (2.0)"),
                          Option("dc_ms_momentum", "ms_momentum", float,
                                 "mean-square momentum m (0.95)"))),
    ps_algorithm("lcasgd", _RULES + "lcasgd:LCASGD", "LC-ASGD, loss-prediction compensation",
                 options=(Option("lc_predictor", "predictor", str,
                                 "linear (default), ema, lstm, oracle"),
                          Option("lc_lambda", "lam", float, "λ (1.0)"),
                          Option("lc_anchor", "anchor", str, "push (default) or fit"),
                          Option("lc_window", "window", int, "history points K (32)"),
                          Option("lc_max_factor", "max_factor", float, "upper bound of the "
                                 "compensation factor (1.0; inf = unbounded)"))),
    ps_algorithm("shat", _RULES + "shat:SHAT", "SHAT, α = 1 − (n/c)/ln n",
                 rule_kwargs=(("alpha_mode", "log"),)),
    ps_algorithm("shat-root", _RULES + "shat:SHAT", "SHAT-root, α = 1 − (n/c)/√n",
                 rule_kwargs=(("alpha_mode", "root"),)),
    ps_algorithm("ensemble", _RULES + "shat:SHAT", "SHAT with α = 0 (independent workers)",
                 rule_kwargs=(("alpha_mode", "ensemble"),)),
    ps_algorithm("asp", _RULES + "shat:SHAT", "SHAT with α = 1 (= ASGD)",
                 rule_kwargs=(("alpha_mode", "asp"),)),
    ps_algorithm("smega2", _RULES + "smega2:SMEGA2", "SMEGA2, one momentum buffer, look-ahead reply",
                 momentum_rule=True,
                 options=(Option("smega2_estimate", "estimate", str,
                                 "advanced (default) or naive"),)),
    ps_algorithm("dana", _RULES + "dana:DANAZero", "DANA-Zero, N momentum buffers, look-ahead reply",
                 momentum_rule=True),
    # default_lr: NAG-ASGD's one shared Nesterov buffer turns the other workers' in-flight pushes
    # into extra momentum: runs at lr 0.05 can collapse, runs at 0.02 do not (docs/design/rules.md,
    # NAG-ASGD; tests/mpi/test_learning_bars.py). The papers show the same instability at scale
    # (why DANA and SMEGA2 exist).
    ps_algorithm("nag", _RULES + "nag:NAG", "NAG-ASGD, shared Nesterov buffer",
                 momentum_rule=True, default_lr=0.02),
    ps_algorithm("rennala", _RULES + "rennala:Rennala",
                 "Rennala SGD: one step per B gradients fresh at θ, stale ones dropped",
                 options=(Option("rennala_batch", "batch", int,
                                 "fresh gradients per step B (default: the number of workers)"),
                          Option("rennala_stop", "stop_stale", bool,
                                 "when θ steps, stop every computation at the old θ and start it "
                                 "again at the new one (the paper's broadcast; hpcasync sim "
                                 "only)"))),
    ps_algorithm("ringmaster", _RULES + "ringmaster:Ringmaster",
                 "Ringmaster ASGD: gradients with delay >= R dropped",
                 options=(Option("ringmaster_r", "threshold", int,
                                 "the delay R from which a gradient is dropped (default: the "
                                 "number of workers)"),
                          Option("ringmaster_stop", "stop_stale", bool,
                                 "stop a computation as soon as its delay reaches R and start "
                                 "it again at θ (the paper's variant; hpcasync sim only)"))),
    ps_algorithm("asgd-da", _RULES + "delay_adaptive:DelayAdaptiveASGD",
                 "delay-adaptive ASGD: the step at delay δ scaled by min(1, τ_C/δ)",
                 options=(Option("da_tau_c", "tau_c", int,
                                 "the delay τ_C up to which the full lr is used; a gradient at "
                                 "delay δ > τ_C steps with lr·τ_C/δ (default: the number of "
                                 "workers)"),)),
):
    register(_alg)
del _alg
