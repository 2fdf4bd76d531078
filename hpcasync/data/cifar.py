"""CIFAR-10 readers for both official layouts, without ever executing pickled code.

Both official layouts (``cifar-10-batches-py``, ``cifar-10-batches-bin``) give ``(N, 3, 32, 32)``
uint8 images. A python batch is unpickled by :class:`CifarUnpickler`, which resolves globals from a
fixed table of stand-ins instead of importing anything: an executable pickle is refused.

Example::

    (x, y), (x_test, y_test) = read_cifar10_dir("/data/cifar-10-batches-py")
    x.shape, y.shape                       # (50000, 3, 32, 32) uint8, (50000,) uint8

Design: docs/design/data.md#cifar-10 (the layouts, which pickle globals are accepted and why).
"""
from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import numpy as np

from hpcasync.data.idx import read_bytes
from hpcasync.errors import DataError

__all__ = ["CifarUnpickler", "safe_unpickle", "read_pickle_batch", "read_bin_batch",
           "read_cifar10_dir", "find_cifar10_dir", "TRAIN_BATCHES", "TEST_BATCH",
           "RECORD_BYTES", "IMAGE_BYTES"]

TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
IMAGE_BYTES = 3 * 32 * 32
RECORD_BYTES = 1 + IMAGE_BYTES


_SAFE_DTYPES = frozenset("b1 i1 u1 i2 u2 i4 u4 i8 u8 f2 f4 f8".split())
_NDARRAY = object()  # ``numpy.ndarray`` resolves to this sentinel: only _reconstruct accepts it


def _refuse(msg: str):
    raise pickle.UnpicklingError(msg)


class _DtypeStub:
    """Stands in for ``numpy.dtype(spec, align, copy)`` + its ``__setstate__``: only plain numeric
    dtypes, no objects, no structured or sub-array types."""

    def __init__(self, spec, align=False, copy=True):
        spec = spec.decode("latin1") if isinstance(spec, bytes) else spec
        if not isinstance(spec, str) or spec.lstrip("<>|=") not in _SAFE_DTYPES:
            _refuse(f"unsupported array dtype {spec!r}")
        self.dtype = np.dtype(spec)

    def __setstate__(self, state):
        if not isinstance(state, tuple) or len(state) < 5:
            _refuse("malformed dtype state")
        endian = state[1].decode("latin1") if isinstance(state[1], bytes) else state[1]
        if state[2] is not None or state[3] is not None or state[4] is not None:
            _refuse("structured or sub-array dtype")
        if endian in ("<", ">"):
            self.dtype = self.dtype.newbyteorder(endian)
        elif endian not in ("|", "="):
            _refuse(f"bad byte order {endian!r}")


class _ArrayStub:
    """Stands in for ``_reconstruct(ndarray, shape, code)`` + ``ndarray.__setstate__``: the pixel
    bytes are viewed with ``numpy.frombuffer``; NumPy's own pickle hooks never see them."""

    def __init__(self, subtype, shape, code):
        if subtype is not _NDARRAY:
            _refuse("_reconstruct of something other than numpy.ndarray")
        self.array = None

    def __setstate__(self, state):
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            _refuse("malformed ndarray state")
        shape, dt, fortran, raw = state[-4:]
        self.array = _from_bytes(raw, dt, shape, "F" if fortran else "C")


def _from_bytes(raw, dt, shape, order):
    if not isinstance(dt, _DtypeStub):
        _refuse("array without a plain numeric dtype")
    if isinstance(raw, str):
        raw = raw.encode("latin1")  # Python 2 str read with encoding="latin1"
    if not isinstance(raw, (bytes, bytearray)):
        _refuse("array data is not a byte string")
    if isinstance(shape, int):
        shape = (shape,)
    if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
        _refuse("malformed array shape")
    if len(raw) != int(np.prod(shape, dtype=np.int64)) * dt.dtype.itemsize:
        _refuse(f"array data of {len(raw)} bytes does not fit shape {shape}")
    if order not in ("C", "F"):
        _refuse(f"bad array order {order!r}")
    return np.frombuffer(bytes(raw), dtype=dt.dtype).reshape(shape, order=order)


def _latin1_encode(text, encoding="latin1", errors="strict"):
    """The one use of ``_codecs.encode`` in a Python 3 protocol-2 pickle: ``str`` -> ``bytes``."""
    if not isinstance(text, str) or not isinstance(encoding, str) \
            or encoding.lower().replace("_", "-") not in ("latin1", "latin-1"):
        _refuse("_codecs.encode other than str -> latin-1 bytes")
    return text.encode("latin1", "strict")


_ALLOWED: dict[tuple[str, str], object] = {
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): _DtypeStub,
    ("numpy.core.multiarray", "_reconstruct"): _ArrayStub,
    ("numpy._core.multiarray", "_reconstruct"): _ArrayStub,
    ("numpy.core.numeric", "_frombuffer"): _from_bytes,
    ("numpy._core.numeric", "_frombuffer"): _from_bytes,
    ("_codecs", "encode"): _latin1_encode,
}


class CifarUnpickler(pickle.Unpickler):
    """An unpickler whose ``find_class`` knows only what a CIFAR batch needs
    (docs/design/data.md#cifar-10).

    Allowed names resolve to local stand-ins, not to NumPy: the arrays are rebuilt with
    ``numpy.frombuffer`` from validated (shape, plain numeric dtype, bytes) after loading. Any other
    global -- ``os.system``, ``builtins.eval``, ``subprocess.Popen`` -- raises
    :class:`~hpcasync.errors.DataError` before anything is called; so do persistent ids.
    """

    def __init__(self, file, *, source: str = "<pickle>"):
        super().__init__(file, encoding="latin1")
        self.source = source

    def find_class(self, module, name):
        obj = _ALLOWED.get((module, name))
        if obj is None:
            raise DataError(f"refusing to load {self.source}: executable pickle (it references "
                            f"{module}.{name}, which a CIFAR batch never needs)")
        return obj

    def persistent_load(self, pid):
        raise DataError(f"refusing to load {self.source}: executable pickle (persistent id)")


def _materialize(obj, seen: set[int]):
    """Replace the stand-ins in a loaded object tree by the arrays / dtypes they describe."""
    if isinstance(obj, _ArrayStub):
        if obj.array is None:
            _refuse("ndarray without state")
        return obj.array
    if isinstance(obj, _DtypeStub):
        return obj.dtype
    if obj is _NDARRAY:
        _refuse("bare numpy.ndarray reference")
    if isinstance(obj, (dict, list)):
        if id(obj) in seen:
            return obj
        seen.add(id(obj))
        if isinstance(obj, list):
            obj[:] = [_materialize(v, seen) for v in obj]
        else:
            items = [(_materialize(k, seen), _materialize(v, seen)) for k, v in obj.items()]
            obj.clear()
            obj.update(items)
        return obj
    if isinstance(obj, tuple):
        return tuple(_materialize(v, seen) for v in obj)
    return obj


def safe_unpickle(data: bytes, *, source: str = "<pickle>"):
    """Decode ``data`` with :class:`CifarUnpickler`; any failure is a one-line DataError."""
    try:
        return _materialize(CifarUnpickler(io.BytesIO(data), source=source).load(), set())
    except DataError:
        raise
    except RecursionError:
        raise DataError(f"{source}: corrupt pickle (nested too deeply)") from None
    except Exception as exc:  # noqa: BLE001 - a corrupt pickle can raise almost anything
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{source}: corrupt or unsupported pickle ({type(exc).__name__}: {msg})") \
            from None


def _key(d: dict, name: str):
    for k in (name, name.encode()):
        if k in d:
            return d[k]
    raise DataError(f"missing key {name!r}")


def read_pickle_batch(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """One python-version batch -> ``(images N×3×32×32 uint8, labels N uint8)``."""
    path = Path(path)
    obj = safe_unpickle(read_bytes(path), source=str(path))
    if not isinstance(obj, dict):
        raise DataError(f"{path}: not a CIFAR batch (a pickled {type(obj).__name__}, "
                        "expected a dict)")
    try:
        data, labels = _key(obj, "data"), _key(obj, "labels")
    except DataError as exc:
        raise DataError(f"{path}: not a CIFAR batch ({exc})") from None
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != IMAGE_BYTES:
        desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: 'data' must be a uint8 array N×{IMAGE_BYTES}, found {desc}")
    try:
        lab = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError):
        raise DataError(f"{path}: 'labels' is not a list of integers") from None
    if lab.ndim != 1 or lab.shape[0] != data.shape[0]:
        raise DataError(f"{path}: {data.shape[0]} images but {lab.size} labels")
    _check_labels(lab, path)
    return data.reshape(-1, 3, 32, 32), lab.astype(np.uint8)


def read_bin_batch(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """One binary-version batch (records of 1 label byte + 3072 pixel bytes) -> images, labels."""
    path = Path(path)
    raw = read_bytes(path)
    if len(raw) == 0 or len(raw) % RECORD_BYTES:
        raise DataError(f"{path}: size {len(raw)} is not a positive multiple of the "
                        f"{RECORD_BYTES}-byte CIFAR record (truncated?)")
    rec = np.frombuffer(raw, dtype=np.uint8).reshape(-1, RECORD_BYTES)
    labels = rec[:, 0].copy()
    _check_labels(labels, path)
    return rec[:, 1:].reshape(-1, 3, 32, 32), labels


def _check_labels(labels: np.ndarray, path) -> None:
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) > 9):
        bad = int(labels.max()) if int(labels.max()) > 9 else int(labels.min())
        raise DataError(f"{path}: label {bad} outside 0..9")


def find_cifar10_dir(candidates) -> tuple[Path, str] | None:
    """The first of ``candidates`` holding a CIFAR-10 layout, with its kind ("py" or "bin")."""
    for d in candidates:
        d = Path(d)
        if (d / TRAIN_BATCHES[0]).is_file():
            return d, "py"
        if (d / f"{TRAIN_BATCHES[0]}.bin").is_file():
            return d, "bin"
    return None


def read_cifar10_dir(directory: str | os.PathLike, kind: str | None = None,
                     ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Read all five train batches and the test batch of one directory.

    Args:
        directory: holds ``data_batch_1..5`` + ``test_batch`` (python) or the ``.bin`` files.
        kind: "py" or "bin"; detected from the files when None (python version preferred).

    Returns:
        ``((train_images, train_labels), (test_images, test_labels))``, uint8, images N×3×32×32.
    """
    directory = Path(directory)
    if kind is None:
        found = find_cifar10_dir([directory])
        if found is None:
            raise DataError(f"no CIFAR-10 batches in {directory} (expected data_batch_1..5 and "
                            "test_batch, or the same names with .bin)")
        kind = found[1]
    suffix, reader = {"py": ("", read_pickle_batch), "bin": (".bin", read_bin_batch)}[kind]
    train = [reader(directory / f"{name}{suffix}") for name in TRAIN_BATCHES]
    test = reader(directory / f"{TEST_BATCH}{suffix}")
    return ((np.concatenate([b[0] for b in train]), np.concatenate([b[1] for b in train])), test)
