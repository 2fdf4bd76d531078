"""Data set registry: name -> normalised (train, test) :class:`ArrayDataset` pair.

Names (:data:`DATASETS`):

* ``fashion-mnist`` -- Zalando's Fashion-MNIST (Xiao, Rasul, Vollgraf, 2017), 60000/10000 1×28×28.
* ``fashion-mnist-mini`` -- the first 6000 train and first 1000 test examples of the real
  Fashion-MNIST, shipped in ``hpcasync/data/builtin/`` (MIT licence, Zalando SE; see its README).
* ``mnist`` -- LeCun's MNIST, 60000/10000 1×28×28 (same IDX file names as Fashion-MNIST).
* ``cifar10`` -- Krizhevsky's CIFAR-10, 50000/10000 3×32×32, python or binary batches.

Example::

    train, test = load_dataset("fashion-mnist", train_limit=6000)
    train.images.shape, train.labels.dtype, train.input_shape   # (6000,1,28,28), int64, (1,28,28)
    train, test = load_dataset("my_data:rows")                  # my_data.py in the working dir

Design: docs/design/data.md#data-sets (where the files are looked for, user data, the built-in
mini set, normalisation).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from hpcasync.data.cifar import find_cifar10_dir, read_cifar10_dir
from hpcasync.data.idx import read_idx_pair, write_idx
from hpcasync.errors import ConfigError, DataError

log = logging.getLogger(__name__)

__all__ = ["ArrayDataset", "DATASETS", "NORMALIZATION", "BUILTIN_DIR", "DEFAULT_ROOT", "ENV_VAR",
           "IDX_FILES", "load_dataset", "normalize_images", "make_mini_set"]

DATASETS = ("fashion-mnist", "fashion-mnist-mini", "mnist", "cifar10")
ENV_VAR = "HPCASYNC_DATA_DIR"
DEFAULT_ROOT = Path("/usr/share/datasets")
BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"

#: name -> (per-channel mean, per-channel std) of the training pixels scaled to [0, 1].
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "fashion-mnist-mini": ((0.2860,), (0.3530,)),   # same constants: it is the same distribution
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}

#: split -> (images file, labels file) of the IDX layout, without ".gz".
IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}

_SUBDIRS = {
    "fashion-mnist": ("", "fashion-mnist"),
    "mnist": ("", "mnist"),
    "cifar10": ("", "cifar-10-batches-py", "cifar-10-batches-bin", "cifar10",
                "cifar10/cifar-10-batches-py", "cifar10/cifar-10-batches-bin"),
}
_DEBIAN_DIRS = {"fashion-mnist": "fashion-mnist", "mnist": "mnist", "cifar10": "cifar10"}


class ArrayDataset:
    """A whole data set in memory: ``images`` float32 N×C×H×W (normalised; a user data set's
    items may have any shape: N×...), ``labels`` int64 N.

    Args:
        images: float32 tensor N×C×H×W (the zoo's image sets) or N×... (one row per example).
        labels: int64 tensor N, values in ``0 .. num_classes-1``.
        num_classes: number of classes (default 10).
        name: data set name, for messages.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, num_classes: int = 10,
                 name: str = "dataset"):
        if images.dim() < 1 or images.dtype != torch.float32:
            raise DataError(f"{name}: images must be a float32 N×... tensor, got "
                            f"{images.dtype} {tuple(images.shape)}")
        if labels.dim() != 1 or labels.dtype != torch.int64 or labels.shape[0] != images.shape[0]:
            raise DataError(f"{name}: labels must be an int64 vector of {images.shape[0]} entries, "
                            f"got {labels.dtype} {tuple(labels.shape)}")
        self.images, self.labels = images, labels
        self.num_classes, self.name = int(num_classes), name

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.images.shape[1:])

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index):
        return self.images[index], self.labels[index]

    def subset(self, n: int) -> "ArrayDataset":
        """The first ``min(n, len(self))`` examples (views, no copy); n must be >= 1."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"subset size must be a positive integer, got {n!r}")
        return ArrayDataset(self.images[:n], self.labels[:n], num_classes=self.num_classes,
                            name=self.name)

    def __repr__(self) -> str:
        return f"ArrayDataset({self.name!r}, n={len(self)}, input_shape={self.input_shape})"


def normalize_images(images_u8: np.ndarray, mean, std) -> torch.Tensor:
    """uint8 N×C×H×W (or N×H×W, taken as C = 1) -> float32 ``(x/255 - mean_c) / std_c``."""
    arr = np.asarray(images_u8)
    if arr.ndim == 3:
        arr = arr[:, None]
    out = torch.from_numpy(arr.astype(np.float32))   # a fresh, writable copy
    out.div_(255.0)
    c = out.shape[1]
    if len(mean) != c or len(std) != c:
        raise DataError(f"normalisation constants for {len(mean)} channels, images have {c}")
    out.sub_(torch.tensor(mean, dtype=torch.float32).view(1, c, 1, 1))
    out.div_(torch.tensor(std, dtype=torch.float32).view(1, c, 1, 1))
    return out


def _to_dataset(images_u8, labels_u8, name: str, limit: int | None) -> ArrayDataset:
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"{name}: example limit must be a positive integer, got {limit!r}")
        if limit > len(labels_u8):
            log.info("%s: limit %d exceeds the %d examples available; using all", name, limit,
                     len(labels_u8))
        images_u8, labels_u8 = images_u8[:limit], labels_u8[:limit]
    mean, std = NORMALIZATION[name]
    labels = torch.from_numpy(np.asarray(labels_u8, dtype=np.int64))
    return ArrayDataset(normalize_images(images_u8, mean, std), labels, num_classes=10, name=name)


def _idx_path(directory: Path, stem: str) -> Path:
    gz = directory / f"{stem}.gz"
    return gz if gz.is_file() or not (directory / stem).is_file() else directory / stem


def _has_idx(directory: Path) -> bool:
    return all(_idx_path(directory, stem).is_file() for pair in IDX_FILES.values() for stem in pair)


def _read_idx_dir(directory: Path, name: str, train_limit, test_limit):
    out = []
    for split, limit in (("train", train_limit), ("test", test_limit)):
        img, lab = (_idx_path(directory, stem) for stem in IDX_FILES[split])
        images, labels = read_idx_pair(img, lab)
        out.append(_to_dataset(images, labels, name, limit))
    return tuple(out)


def _candidates(name: str, roots: list[Path]) -> list[Path]:
    return [root / sub if sub else root for root in roots for sub in _SUBDIRS[name]]


def _find(name: str, dirs: list[Path]):
    if name == "cifar10":
        return find_cifar10_dir(dirs)
    for d in dirs:
        if _has_idx(d):
            return d, "idx"
    return None


def load_dataset(name: str, *, data_dir: str | os.PathLike | None = None,
                 train_limit: int | None = None, test_limit: int | None = None,
                 ) -> tuple[ArrayDataset, ArrayDataset]:
    """Load a registered data set as normalised ``(train, test)``.

    Args:
        name: one of :data:`DATASETS`, or a user factory ``MODULE:FACTORY`` (see
            :func:`hpcasync.data.user.user_dataset`; ``data_dir`` does not apply to it).
        data_dir: directory holding the files (or the data set's sub-directory); default None =
            ``$HPCASYNC_DATA_DIR``, then ``/usr/share/datasets/<name>``, then (Fashion-MNIST only)
            the built-in mini set with a warning.
        train_limit, test_limit: keep only the first n examples of each split (default all).

    Raises:
        ConfigError: unknown name or bad limit; a user factory that does not import, raises or
            returns no pair of Datasets. DataError: files missing or malformed; bad user items.
    """
    from hpcasync.plugins import is_spec

    if is_spec(name):
        from hpcasync.data.user import user_dataset

        return user_dataset(name, train_limit=train_limit, test_limit=test_limit)
    directory, kind = locate_dataset(name, data_dir=data_dir)
    if kind == "builtin":
        return _read_idx_dir(BUILTIN_DIR, name, train_limit, test_limit)
    log.info("loading %s from %s", name, directory)
    if kind == "idx":
        return _read_idx_dir(directory, name, train_limit, test_limit)
    (xtr, ytr), (xte, yte) = read_cifar10_dir(directory, kind)
    return _to_dataset(xtr, ytr, name, train_limit), _to_dataset(xte, yte, name, test_limit)


def locate_dataset(name: str, *, data_dir: str | os.PathLike | None = None,
                   warn: bool = True) -> tuple[Path, str]:
    """Find a data set's files without reading them: ``(directory, kind)`` with kind ``idx``,
    ``builtin`` or a CIFAR kind. Cheap enough to run before MPI starts (the driver's pre-check).
    A user factory ``MODULE:FACTORY`` is imported (not called): ``(directory of its module file,
    "plugin")``.

    Raises:
        ConfigError: unknown name; a user factory that does not import. DataError: files missing
            (the message says what was looked for).
    """
    from hpcasync.plugins import is_spec

    if is_spec(name):
        from hpcasync.plugins import spec_record

        file = spec_record(name, "--dataset")["file"]
        return (Path(file).parent if file else Path.cwd()), "plugin"
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)} "
                          "(or a user factory MODULE:FACTORY)")
    if name == "fashion-mnist-mini":
        return BUILTIN_DIR, "builtin"
    if data_dir is not None:
        roots = [Path(data_dir)]
    else:
        env = os.environ.get(ENV_VAR)
        roots = ([Path(env)] if env else []) + [DEFAULT_ROOT / _DEBIAN_DIRS[name]]
    found = _find(name, _candidates(name, roots))
    if found is not None:
        return found
    if name == "fashion-mnist" and data_dir is None:
        if warn:
            log.warning("Fashion-MNIST not found in %s; using the built-in real subset "
                        "(first 6000 train / 1000 test examples, %s). For the full set run "
                        "`apt-get install dataset-fashion-mnist` or set %s.",
                        " or ".join(str(r) for r in roots), BUILTIN_DIR, ENV_VAR)
        return BUILTIN_DIR, "builtin"
    what = ("data_batch_1..5 + test_batch (or the .bin batches)" if name == "cifar10"
            else "train-/t10k-images-idx3-ubyte + -labels-idx1-ubyte (.gz or raw)")
    subs = ", ".join(s + "/" for s in _SUBDIRS[name] if s)
    raise DataError(f"{name} not found: no {what} in {' or '.join(str(r) for r in roots)} "
                    f"(nor in their sub-directories {subs})")


def make_mini_set(src_dir: str | os.PathLike, dst_dir: str | os.PathLike = BUILTIN_DIR, *,
                  n_train: int = 6000, n_test: int = 1000) -> list[Path]:
    """Write the first ``n_train`` / ``n_test`` examples of an IDX data set as reproducible gz IDX
    files; this is how ``hpcasync/data/builtin`` was made from Debian's Fashion-MNIST::

        make_mini_set("/usr/share/datasets/fashion-mnist")
    """
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    written = []
    for split, n in (("train", n_train), ("test", n_test)):
        img, lab = (_idx_path(src, stem) for stem in IDX_FILES[split])
        images, labels = read_idx_pair(img, lab)
        if n > len(labels):
            raise DataError(f"{img}: has {len(labels)} examples, fewer than the {n} requested")
        for stem, arr in zip(IDX_FILES[split], (images[:n], labels[:n])):
            written.append(write_idx(dst / f"{stem}.gz", arr))
    return written
