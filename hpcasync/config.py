"""One config object for every run, validated before MPI starts.

Common options live in :class:`TrainConfig`; each runtime adds its own argument group (see
``hpcasync.registry``) whose values arrive in ``TrainConfig.options``. A config file
(``--config run.toml`` or ``.json``) gives defaults that the command line overrides.

``--model``, ``--dataset``, ``--loss`` and ``--optimizer`` take a built-in name or user code,
``MODULE:FACTORY`` (:mod:`hpcasync.plugins`); here a spec is only checked for form, the driver's
pre-check imports it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from . import registry
from .errors import ConfigError

DATASETS = ("fashion-mnist", "fashion-mnist-mini", "mnist", "cifar10")
MODELS = ("mlp", "lenet", "resnet20")
LOSSES = ("cross_entropy", "nll")
OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop")
#: the algorithms that train with --optimizer (the others have their own update rules); live
OPTIMIZER_ALGORITHMS = registry.LiveNames(registry.user_optimizer_names)
DEFAULT_LR = registry.DEFAULT_LR
#: the algorithms that grow back after a death (--grow-back; hpcasync.runtime.join, and
#: hpcasync.ps.growth for the parameter server's); a live view
GROW_ALGORITHMS = registry.LiveNames(lambda: (*registry.by_family("ssgd"), "odsgd", "daso",
                                              *registry.ps_names()))
#: per-algorithm exceptions to DEFAULT_LR for ``--lr`` left unset (``default_lr`` of the registry's
#: entries: nag 0.02, why there); a live view
ALGORITHM_LR = registry.LiveMapping(registry.algorithm_lrs)


def default_lr(algorithm: str) -> float:
    """The learning rate ``--lr`` means when it is not given: 0.05, nag 0.02."""
    return registry.default_lr(algorithm)


@dataclass
class TrainConfig:
    algorithm: str = "ssgd"
    backend: str = "mpi"                 # ssgd/daso: own MPI collectives or "horovod"
    dataset: str = "fashion-mnist"       # a name of DATASETS or a user factory MODULE:FACTORY
    data_dir: str | None = None
    train_limit: int | None = None       # use the first N training images (quick runs, tests)
    test_limit: int | None = None
    model: str = "lenet"                 # a name of MODELS or a user factory MODULE:FACTORY
    loss: str = "cross_entropy"          # a name of LOSSES or MODULE:FACTORY
    optimizer: str = "sgd"               # a name of OPTIMIZERS or MODULE:FACTORY (ssgd, daso)
    epochs: int = 2
    batch_size: int = 32                 # per worker
    lr: float | None = None              # None: DEFAULT_LR for the algorithm (see default_lr)
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    metrics: str | None = None           # JSONL path (rank 0 writes)
    tensorboard: str | None = None       # TensorBoard directory: the stream's numbers (same writer)
    ranks_per_node: int | None = None
    device: str = "auto"
    ps_rank: int = 0
    threads: int = 0                     # torch intra-op threads per rank; 0 = cores / ranks on node
    progress: str = "auto"               # auto (bar on a TTY) | on | off
    log_every: int = 0                   # batches between log lines (0 = per epoch only)
    checkpoint_dir: str | None = None
    resume: str | None = None            # None | "auto" | path
    checkpoint_every: int = 0            # steps between periodic checkpoints (0: epoch ends only)
    checkpoint_keep: int = 3             # the newest checkpoints kept in checkpoint_dir
    divergence_factor: float = 10.0      # stop when the smoothed loss > factor x its best (0: off)
    options: dict[str, Any] = field(default_factory=dict)   # the runtime's own options

    def __post_init__(self) -> None:
        if self.lr is None:
            self.lr = default_lr(self.algorithm)

    def validate(self, algorithms: tuple[str, ...]) -> "TrainConfig":
        _choice("--algorithm", self.algorithm, algorithms)
        _choice("--backend", self.backend, ("mpi", "horovod"))
        _name_or_spec("--dataset", self.dataset, DATASETS)
        _name_or_spec("--model", self.model, MODELS)
        _name_or_spec("--loss", self.loss, LOSSES)
        _name_or_spec("--optimizer", self.optimizer, OPTIMIZERS)
        if self.optimizer != "sgd" and self.algorithm not in OPTIMIZER_ALGORITHMS:
            raise ConfigError(f"--optimizer applies to {', '.join(OPTIMIZER_ALGORITHMS)} only; "
                              f"{self.algorithm} has its own update rule (leave --optimizer sgd)")
        grow = [f"--{k.replace('_', '-')}" for k in ("grow_back", "max_ranks", "min_ranks")
                if self.options.get(k)]
        if grow and self.algorithm not in GROW_ALGORITHMS:    # (hpcasync.runtime.join)
            raise ConfigError(f"{', '.join(grow)} applies to {', '.join(GROW_ALGORITHMS)} only; "
                              f"{self.algorithm} does not grow back yet (docs/design/growth.md)")
        _choice("--device", self.device, ("auto", "cpu", "cuda"))
        _choice("--progress", self.progress, ("auto", "on", "off"))
        _positive("--epochs", self.epochs)
        _positive("--batch-size", self.batch_size)
        _finite_nonneg("--lr", self.lr, strict=True)
        _finite_nonneg("--weight-decay", self.weight_decay)
        if not (0.0 <= self.momentum < 1.0):
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        for name, value in (("--train-limit", self.train_limit), ("--test-limit", self.test_limit),
                            ("--ranks-per-node", self.ranks_per_node)):
            if value is not None:
                _positive(name, value)
        if self.ps_rank < 0:
            raise ConfigError(f"--ps-rank must be >= 0, got {self.ps_rank}")
        if self.threads < 0 or self.log_every < 0 or self.checkpoint_every < 0:
            raise ConfigError("--threads, --log-every and --checkpoint-every must be >= 0")
        _positive("--checkpoint-keep", self.checkpoint_keep)
        from .runtime.divergence import check_factor

        check_factor(self.divergence_factor)
        if self.resume is not None and self.resume != "auto" and not Path(self.resume).is_file():
            raise ConfigError(f"--resume {self.resume}: no such checkpoint file")
        if self.resume == "auto" and self.checkpoint_dir is None:
            raise ConfigError("--resume auto needs --checkpoint-dir")
        if self.checkpoint_dir is not None:
            _writable_dir("--checkpoint-dir", self.checkpoint_dir)
        if self.data_dir is not None and not Path(self.data_dir).is_dir():
            raise ConfigError(f"--data-dir {self.data_dir}: no such directory")
        if self.metrics is not None:
            parent = Path(self.metrics).resolve().parent
            if not parent.is_dir():
                raise ConfigError(f"--metrics {self.metrics}: directory {parent} does not exist")
            if not os.access(parent, os.W_OK):
                raise ConfigError(f"--metrics {self.metrics}: directory {parent} is not writable")
        if self.tensorboard is not None:
            if Path(self.tensorboard).exists() and not Path(self.tensorboard).is_dir():
                raise ConfigError(f"--tensorboard {self.tensorboard} is not a directory")
            from .metrics import require_tensorboard

            require_tensorboard("--tensorboard")
        if self.backend == "horovod" and self.algorithm not in registry.horovod_names():
            raise ConfigError(f"--backend horovod applies to {' and '.join(registry.horovod_names())}, "
                              f"not {self.algorithm}")
        return self

    def to_record(self) -> dict[str, Any]:
        return asdict(self)


def _writable_dir(flag: str, path) -> None:
    """``path`` is a directory this process can write into, made if missing (so that the first
    checkpoint, an epoch into the run, does not end it with a traceback); else one line."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path} is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".hpcasync-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None


def _choice(flag: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{flag} {value!r} is not one of: {', '.join(choices)}")


def _name_or_spec(flag: str, value, choices) -> None:
    """A built-in name, or user code ``MODULE:FACTORY`` checked for form (not imported)."""
    if isinstance(value, str) and ":" in value:
        from .plugins import parse_spec

        parse_spec(value, flag)
    elif value not in choices:
        raise ConfigError(f"{flag} {value!r} is not one of: {', '.join(choices)} "
                          "(or a user factory MODULE:FACTORY)")


def _positive(flag: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{flag} must be a positive integer, got {value!r}")


def _finite_nonneg(flag: str, value, strict: bool = False) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or (strict and value == 0):
        raise ConfigError(f"{flag} must be a finite number {'>' if strict else '>='} 0, got {value!r}")


COMMON_FIELDS = tuple(f.name for f in fields(TrainConfig) if f.name != "options")


def load_config_file(path: str) -> dict[str, Any]:
    """Read a TOML or JSON file of option defaults (keys use - or _)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        text = p.read_text(encoding="utf-8")
        data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: "
                          f"{str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the top level must be a table of options")
    return {k.replace("-", "_"): v for k, v in data.items()}


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """Make the file's values the parser's defaults, refusing keys the parser does not know."""
    values = load_config_file(path)
    known = {a.dest for a in parser._actions}  # noqa: SLF001 - argparse has no public accessor
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"--config {path}: unknown option(s): {', '.join(unknown)}")
    parser.set_defaults(**values)


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    values = vars(ns)
    common = {k: values[k] for k in COMMON_FIELDS if k in values}
    options = {k: v for k, v in values.items() if k not in COMMON_FIELDS
               and k not in ("command", "config", "func")}
    return TrainConfig(**common, options=options)
