"""User code for ``hpcasync train``: models, data sets, losses and optimizers named by a spec.

A *spec* is ``MODULE:FACTORY``: a dotted module name or the path of a ``.py`` file, then a callable
attribute of it; the zoo names stay as shortcuts. Every problem is a one-line ConfigError naming
the spec, before MPI starts.

Example, ``my_models.py`` in the working directory::

    from torch import nn

    def wide_mlp(input_shape, num_classes):
        width = 1
        for s in input_shape:
            width *= s
        return nn.Sequential(nn.Flatten(), nn.Linear(width, 512), nn.ReLU(),
                             nn.Linear(512, num_classes))

and then::

    mpiexec -n 4 hpcasync train --model my_models:wide_mlp --dataset fashion-mnist
    mpiexec -n 4 hpcasync train --model path/to/my_models.py:wide_mlp --optimizer adam --lr 1e-3

Design: docs/design/plugins.md#plugins (the spec, each option's contract, the errors).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError

log = logging.getLogger("hpcasync")

__all__ = ["LOSSES", "OPTIMIZERS", "is_spec", "parse_spec", "load_factory", "spec_record",
           "user_model", "make_loss", "make_optimizer", "check_run"]
# the data set side of the contract (reading a user's Datasets) is hpcasync.data.user

#: --loss names -> torch functional losses (batch mean).
LOSSES: dict[str, Callable] = {"cross_entropy": F.cross_entropy, "nll": F.nll_loss}
#: --optimizer names -> torch optimizer classes.
OPTIMIZERS: dict[str, type] = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam,
                               "adamw": torch.optim.AdamW, "rmsprop": torch.optim.RMSprop}

SPEC_FORM = "MODULE:FACTORY (pkg.module:factory or path/file.py:factory)"

# spec -> {"spec", "module", "file", "sha256"} of the module it was imported from
_RECORDS: dict[str, dict[str, Any]] = {}


def is_spec(value: Any) -> bool:
    """True when ``value`` names user code (holds a ``:``) rather than a built-in name."""
    return isinstance(value, str) and ":" in value


def _is_file(module: str) -> bool:
    return module.endswith(".py") or "/" in module or os.sep in module


def parse_spec(spec: str, what: str) -> tuple[str, str]:
    """``(module, factory)`` of ``spec``, checked for form only (nothing is imported).

    Raises:
        ConfigError: not of the form :data:`SPEC_FORM`.
    """
    module, _, attr = spec.rpartition(":")
    bad = None
    if not module or not attr:
        bad = "expected " + SPEC_FORM
    elif not all(part.isidentifier() for part in attr.split(".")):
        bad = f"factory {attr!r} is not a (dotted) Python name"
    elif not _is_file(module) and not all(part.isidentifier() for part in module.split(".")):
        bad = f"module {module!r} is neither a dotted module name nor a path to a .py file"
    if bad:
        raise ConfigError(f"{what} {spec}: {bad}")
    return module, attr


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    """``Type: message (at file:line)`` of an exception, on one line."""
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})"
    msg = _one_line(str(exc))
    return f"{type(exc).__name__}{': ' + msg if msg else ''}{where}"


def _file_module(path_text: str, spec: str, what: str):
    path = Path(path_text).expanduser()
    path = (path if path.is_absolute() else Path.cwd() / path).resolve()
    if not path.is_file():
        raise ConfigError(f"{what} {spec}: no such file {path}")
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:10]
    name = f"_hpcasync_plugin_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    ispec = importlib.util.spec_from_file_location(name, path)
    if ispec is None or ispec.loader is None:
        raise ConfigError(f"{what} {spec}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(ispec)
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))          # so the file can import its siblings
    sys.modules[name] = module                     # dataclasses, pickling look it up there
    try:
        ispec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _import(module: str, spec: str, what: str):
    try:
        if _is_file(module):
            return _file_module(module, spec, what)
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.insert(0, cwd)                 # as `python -m` does
        return importlib.import_module(module)
    except ConfigError:
        raise
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise ConfigError(f"{what} {spec}: no module named {exc.name!r} (looked in the "
                              f"working directory {os.getcwd()} and on sys.path)") from None
        raise ConfigError(f"{what} {spec}: importing {module} failed: {_describe(exc)}") from None
    except SyntaxError as exc:
        raise ConfigError(f"{what} {spec}: syntax error in {exc.filename}, line {exc.lineno}: "
                          f"{exc.msg}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module: any failure is bad input
        raise ConfigError(f"{what} {spec}: importing {module} raised {_describe(exc)}") from None


def _file_of(module) -> str | None:
    path = getattr(module, "__file__", None)
    return str(Path(path).resolve()) if path else None


def load_factory(spec: str, what: str) -> Callable:
    """Import ``spec``'s module and return its factory (imports are cached).

    Args:
        spec: ``MODULE:FACTORY`` (:data:`SPEC_FORM`).
        what: the option it came from, for messages (``--model``, ``--dataset``, ...).

    Raises:
        ConfigError: bad form, no such module or file, an import that fails (syntax error,
            exception), no such attribute, not callable.
    """
    module_name, attr = parse_spec(spec, what)
    module = _import(module_name, spec, what)
    file = _file_of(module)
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{what} {spec}: {module_name} ({file or 'no file'}) has no "
                              f"attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(f"{what} {spec}: {attr} is {_kind(obj)}, not callable")
    if spec not in _RECORDS:
        sha = None
        if file is not None and Path(file).is_file():
            sha = hashlib.sha256(Path(file).read_bytes()).hexdigest()
        _RECORDS[spec] = {"spec": spec, "module": module.__name__, "file": file, "sha256": sha}
    return obj


def spec_record(spec: str, what: str) -> dict[str, Any]:
    """``{"spec", "module", "file", "sha256"}``: where ``spec``'s code came from (the file's
    SHA-256 as it was when first imported), for the metrics stream."""
    load_factory(spec, what)
    return dict(_RECORDS[spec])


def _call(factory: Callable, spec: str, what: str, *args, **kwargs):
    try:
        return factory(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's code: any failure is bad input
        raise ConfigError(f"{what} {spec}: the factory raised {_describe(exc)}") from None


# -- models ----------------------------------------------------------------------------------------

def user_model(spec: str, input_shape, num_classes: int) -> nn.Module:
    """``factory(tuple(input_shape), num_classes)`` of a ``--model`` spec, checked to be a Module.

    Raises:
        ConfigError: import problems (:func:`load_factory`), the factory raised, not an nn.Module.
    """
    try:
        shape = tuple(input_shape)
    except TypeError:
        shape = None
    if shape is None or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                for s in shape):
        raise ConfigError(f"--model {spec}: input shape must be a tuple of integers >= 0, "
                          f"got {input_shape!r}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"--model {spec}: number of classes must be a positive integer, "
                          f"got {num_classes!r}")
    factory = load_factory(spec, "--model")
    model = _call(factory, spec, "--model", shape, num_classes)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec}: the factory returned {_kind(model)}, "
                          "not a torch.nn.Module")
    return model


# -- data sets -------------------------------------------------------------------------------------

def _a(word: str) -> str:
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return _a(f"{str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}")
    return _a(type(value).__name__)


def make_loss(spec: str = "cross_entropy") -> Callable:
    """The training loss ``loss(output, target) -> scalar tensor`` named by ``--loss``.

    Raises:
        ConfigError: unknown name, import problems, the factory raised or returned no callable.
    """
    if spec in LOSSES:
        return LOSSES[spec]
    if not is_spec(spec):
        raise ConfigError(f"--loss {spec!r} is not one of: {', '.join(LOSSES)} (or a "
                          f"{SPEC_FORM})")
    fn = _call(load_factory(spec, "--loss"), spec, "--loss")
    if not callable(fn):
        raise ConfigError(f"--loss {spec}: the factory returned {_kind(fn)}, not a "
                          "callable loss(output, target)")
    return fn


def make_optimizer(spec: str, params, *, lr: float, momentum: float,
                   weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer named by ``--optimizer`` over ``params``.

    A name gets those of ``lr``, ``momentum``, ``weight_decay`` its torch class accepts (Adam and
    AdamW take no momentum; AdamW gets ``--weight-decay``, default 0, not torch's 0.01); a spec's
    factory gets all three as keywords.

    Raises:
        ConfigError: unknown name, import problems, the constructor/factory raised or returned no
            torch.optim.Optimizer.
    """
    given = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
    if spec in OPTIMIZERS:
        cls = OPTIMIZERS[spec]
        accepted = inspect.signature(cls).parameters
        kwargs = {k: v for k, v in given.items() if k in accepted}
        try:
            return cls(params, **kwargs)
        except Exception as exc:  # noqa: BLE001 - e.g. an out-of-range value
            raise ConfigError(f"--optimizer {spec}: torch.optim.{cls.__name__} raised "
                              f"{_describe(exc)}") from None
    if not is_spec(spec):
        raise ConfigError(f"--optimizer {spec!r} is not one of: {', '.join(OPTIMIZERS)} (or a "
                          f"{SPEC_FORM})")
    opt = _call(load_factory(spec, "--optimizer"), spec, "--optimizer", params, **given)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(f"--optimizer {spec}: the factory returned {_kind(opt)}, not "
                          "a torch.optim.Optimizer")
    return opt


# -- the pre-MPI trial -----------------------------------------------------------------------------

def check_run(model: str, dataset, *, loss: str = "cross_entropy", loss_fn: Callable | None = None,
              optimizer: str | None = "sgd", lr: float = 0.05, momentum: float = 0.9,
              weight_decay: float = 0.0) -> nn.Module:
    """Try a model on the data, on the CPU, before any rank waits on another: build it
    (``build_model``), run a forward pass on the first two training items, check the output is
    (2, num_classes), the loss a differentiable scalar, and that the optimizer can be built.
    Returns the trial model (thrown away by the driver). Consumes torch's global random numbers.

    ``optimizer=None`` leaves the optimizer out: the driver passes it for the algorithms with their
    own update rule, which never build one (``--optimizer`` must stay ``sgd`` there, and
    ``TrainConfig.validate`` already holds lr, momentum and weight decay to the ranges torch's SGD
    accepts). Building a torch optimizer imports ``torch._dynamo`` (``Optimizer.add_param_group``
    is wrapped in ``torch._disable_dynamo``): 2-3.5 CPU-s on every rank of every such job.

    Raises:
        ConfigError: naming the option (and spec) at fault.
    """
    from .models import build_model

    nc = dataset.num_classes
    try:
        net = build_model(model, dataset.input_shape, nc)
    except ConfigError as exc:
        if is_spec(model):
            raise
        raise ConfigError(f"--model {model} with --dataset {dataset.name}: {exc}") from None
    if not any(p.requires_grad for p in net.parameters()):
        raise ConfigError(f"--model {model}: the model has no trainable parameters")
    b = min(2, len(dataset))
    x, y = dataset.images[:b], dataset.labels[:b]
    net.train()
    try:
        out = net(x)
    except Exception as exc:  # noqa: BLE001 - the user's model
        raise ConfigError(f"--model {model}: a forward pass on {b} items of shape "
                          f"{tuple(x.shape)} raised {_describe(exc)}") from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (b, nc):
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else _kind(out)
        raise ConfigError(f"--model {model}: on a batch of {b} items of shape {tuple(x.shape)} "
                          f"the output has {got}, expected ({b}, {nc}) = (batch, num_classes; "
                          "the largest label + 1)")
    fn = make_loss(loss) if loss_fn is None else loss_fn
    try:
        value = fn(out, y)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"--loss {loss}: loss(output, target) on the model's output raised "
                          f"{_describe(exc)}") from None
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        raise ConfigError(f"--loss {loss}: loss(output, target) returned {_kind(value)}, not a "
                          "scalar floating tensor")
    if not value.requires_grad:
        raise ConfigError(f"--loss {loss}: the loss carries no gradient to the model (is it "
                          "computed from the output with torch operations?)")
    if optimizer is not None:           # built to check it, then dropped
        make_optimizer(optimizer, net.parameters(), lr=lr, momentum=momentum,
                       weight_decay=weight_decay)
    return net
