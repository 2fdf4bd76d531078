"""User data sets for ``hpcasync train --dataset MODULE:factory`` (the contract is in
docs/design/plugins.md): the factory's ``(train, test)`` map-style Datasets read once into
in-memory :class:`~hpcasync.data.ArrayDataset` pairs, every problem a one-line error."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..errors import ConfigError, DataError
from ..plugins import _call, _describe, _kind, load_factory

log = logging.getLogger("hpcasync")


def _check_limit(limit, what: str) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"{what} must be a positive integer, got {limit!r}")


def _label(y) -> int | None:
    """The int value of an int-like label, else None."""
    if isinstance(y, (bool, np.bool_)):
        return None
    if isinstance(y, (int, np.integer)):
        return int(y)
    if isinstance(y, torch.Tensor) and y.dim() == 0 and not y.is_floating_point() \
            and not y.is_complex() and y.dtype != torch.bool:
        return int(y.item())
    return None


def _length(value) -> str:
    return f" of length {len(value)}" if isinstance(value, (tuple, list)) else ""


def _read_split(ds, split: str, limit, spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    head = f"--dataset {spec}: {split} set"
    try:
        n = len(ds)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"{head}: len() raised {_describe(exc)}") from None
    if n == 0:
        raise DataError(f"{head} is empty")
    if limit is not None:
        n = min(n, limit)
    tensors = getattr(ds, "tensors", None)
    if (type(ds) is torch.utils.data.TensorDataset and len(tensors) == 2
            and tensors[1].dim() == 1 and tensors[0].dim() >= 1):
        # fast path, same checks: the items are (tensors[0][i], tensors[1][i])
        x, y = tensors[0][:n].detach(), tensors[1][:n].detach()
        if not x.is_floating_point():
            raise DataError(f"{head}, item 0: x must be a floating tensor, got {_kind(x[0])}")
        if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
            raise DataError(f"{head}, item 0: the label must be an int >= 0, got {_kind(y[0])}")
        if n and int(y.min()) < 0:
            i = int(torch.nonzero(y < 0)[0, 0])
            raise DataError(f"{head}, item {i}: the label must be an int >= 0, got {int(y[i])}")
        return x.cpu().to(torch.float32).contiguous(), y.cpu().to(torch.int64).contiguous()
    xs, ys, shape = [], [], None
    for i in range(n):
        try:
            item = ds[i]
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"{head}: reading item {i} raised {_describe(exc)}") from None
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise DataError(f"{head}, item {i}: expected a pair (tensor, int label), got "
                            f"{_kind(item)}{_length(item)}")
        x, y = item
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise DataError(f"{head}, item {i}: x must be a floating tensor, got {_kind(x)}")
        if shape is None:
            shape = x.shape
        elif x.shape != shape:
            raise DataError(f"{head}, item {i}: x has shape {tuple(x.shape)}, item 0 has "
                            f"{tuple(shape)}; every item must have the same shape")
        label = _label(y)
        if label is None or label < 0:
            got = label if label is not None else _kind(y)
            raise DataError(f"{head}, item {i}: the label must be an int >= 0, got {got}")
        xs.append(x.detach().cpu())
        ys.append(label)
    return torch.stack(xs).to(torch.float32), torch.tensor(ys, dtype=torch.int64)


def user_dataset(spec: str, *, train_limit: int | None = None, test_limit: int | None = None):
    """``(train, test)`` :class:`~hpcasync.data.ArrayDataset` pair from a ``--dataset`` spec.

    Calls ``factory()``, reads the first ``train_limit`` / ``test_limit`` items of each set (all
    when None), checks each is ``(floating tensor, int >= 0)`` with one shape throughout, and stacks
    them (float32 images, int64 labels); ``num_classes`` = largest label of both + 1.

    Raises:
        ConfigError: import problems, the factory raised, did not return a pair of map-style
            Datasets, bad limit. DataError: an empty set, a bad item, shapes that differ, a single
            class.
    """
    from .datasets import ArrayDataset

    _check_limit(train_limit, "--train-limit")
    _check_limit(test_limit, "--test-limit")
    factory = load_factory(spec, "--dataset")
    t0 = time.time()
    out = _call(factory, spec, "--dataset")
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ConfigError(f"--dataset {spec}: the factory must return (train, test), got "
                          f"{_kind(out)}{_length(out)}")
    for split, ds in zip(("train", "test"), out):
        if not isinstance(ds, torch.utils.data.Dataset) or isinstance(
                ds, torch.utils.data.IterableDataset) or not hasattr(ds, "__len__"):
            raise ConfigError(f"--dataset {spec}: the {split} set is {_kind(ds)}, not a map-style "
                              "torch.utils.data.Dataset (with __len__ and __getitem__)")
    (xtr, ytr), (xte, yte) = (_read_split(ds, split, limit, spec) for split, ds, limit in
                              zip(("train", "test"), out, (train_limit, test_limit)))
    if xtr.shape[1:] != xte.shape[1:]:
        raise DataError(f"--dataset {spec}: train items have shape {tuple(xtr.shape[1:])}, test "
                        f"items {tuple(xte.shape[1:])}")
    num_classes = int(max(int(ytr.max()), int(yte.max()))) + 1
    if num_classes < 2:
        raise DataError(f"--dataset {spec}: every label is 0; a classifier needs labels of at "
                        "least 2 classes")
    train = ArrayDataset(xtr, ytr, num_classes=num_classes, name=spec)
    test = ArrayDataset(xte, yte, num_classes=num_classes, name=spec)
    log.info("loaded %s: %d train / %d test items of shape %s, %d classes (%.1f s)", spec,
             len(train), len(test), train.input_shape, num_classes, time.time() - t0)
    return train, test


# -- losses and optimizers -------------------------------------------------------------------------

