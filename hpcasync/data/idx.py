"""IDX files (the MNIST / Fashion-MNIST container), gzip-compressed or raw, strictly validated.

Format (LeCun et al., "The MNIST database"; Zalando's Fashion-MNIST uses it unchanged)::

    bytes 0-1   0x00 0x00                      magic, part 1
    byte  2     element type: 0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32,
                0x0E float64
    byte  3     number of dimensions d
    4 .. 4+4d   d dimension sizes, big-endian uint32
    rest        prod(dims) elements, big-endian, row-major

A file is read whole (``gzip.decompress`` when it starts with the gzip magic ``1f 8b``, whatever its
name) and viewed with ``numpy.frombuffer``, so the 47 MB Fashion-MNIST train images load in a
fraction of a second. Every defect is a :class:`~hpcasync.errors.DataError` whose one-line
message names the file: missing file, corrupt gzip, wrong magic, unknown type, truncated header or
data, trailing bytes, wrong number of dimensions, wrong image size, image/label count mismatch.

Example::

    images, labels = read_idx_pair("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz")
    images.shape, labels.shape            # (60000, 28, 28), (60000,)
"""
from __future__ import annotations

import gzip
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from hpcasync.errors import DataError

__all__ = ["IDX_TYPES", "parse_idx", "read_idx", "read_idx_pair", "write_idx", "read_bytes"]

#: IDX type code -> numpy dtype (big-endian as stored).
IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


def read_bytes(path: str | os.PathLike) -> bytes:
    """Read ``path``, gunzipped if it starts with ``1f 8b``; missing/unreadable: DataError."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"missing data file {path}") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, expected a data file") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise DataError(f"{path}: corrupt or truncated gzip stream ({exc})") from None
    return raw


def parse_idx(buf: bytes, *, source: str = "<bytes>", ndim: int | None = None) -> np.ndarray:
    """Decode one IDX byte string into a native-endian, read-only numpy array.

    Args:
        buf: the decompressed file content.
        source: the file name used in error messages.
        ndim: when given, the number of dimensions the file must have.
    """
    if len(buf) < 4:
        raise DataError(f"{source}: truncated IDX header ({len(buf)} bytes, need at least 4)")
    zero, code, nd = buf[:2], buf[2], buf[3]
    if zero != b"\x00\x00":
        raise DataError(f"{source}: not an IDX file (magic {buf[:4].hex()}, "
                        "expected 0000<type><ndim>)")
    if code not in IDX_TYPES:
        raise DataError(f"{source}: not an IDX file (unknown element type 0x{code:02x} in magic "
                        f"{buf[:4].hex()})")
    if nd == 0:
        raise DataError(f"{source}: IDX header declares 0 dimensions")
    header = 4 + 4 * nd
    if len(buf) < header:
        raise DataError(f"{source}: truncated IDX header ({len(buf)} bytes, need {header} for "
                        f"{nd} dimensions)")
    dims = struct.unpack(f">{nd}I", buf[4:header])
    if ndim is not None and nd != ndim:
        raise DataError(f"{source}: expected a {ndim}-dimensional IDX array, found {nd} "
                        f"dimensions {dims}")
    dtype = IDX_TYPES[code]
    need = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    have = len(buf) - header
    if have < need:
        raise DataError(f"{source}: truncated: header says shape {dims} ({need} data bytes) but "
                        f"only {have} bytes follow")
    if have > need:
        raise DataError(f"{source}: {have - need} unexpected bytes after the data of shape {dims}")
    arr = np.frombuffer(buf, dtype=dtype, count=need // dtype.itemsize, offset=header)
    if not dtype.isnative and dtype.itemsize > 1:
        arr = arr.astype(dtype.newbyteorder("="))
    return arr.reshape(dims)


def read_idx(path: str | os.PathLike, *, ndim: int | None = None) -> np.ndarray:
    """Read an IDX file (gz or raw) into a numpy array; see :func:`parse_idx`."""
    return parse_idx(read_bytes(path), source=str(path), ndim=ndim)


def read_idx_pair(images_path: str | os.PathLike, labels_path: str | os.PathLike, *,
                  image_size: tuple[int, int] | None = (28, 28), num_classes: int | None = 10,
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Read an image file (IDX3, uint8) and its label file (IDX1, uint8) and check they agree.

    Args:
        images_path, labels_path: the two files, gz or raw.
        image_size: required (rows, cols); ``None`` accepts any (default (28, 28)).
        num_classes: labels must lie in ``0 .. num_classes-1``; ``None`` skips the check
            (default 10).

    Returns:
        ``(images N×rows×cols uint8, labels N uint8)``, both read-only views of the file bytes.
    """
    images = read_idx(images_path, ndim=3)
    labels = read_idx(labels_path, ndim=1)
    for arr, path in ((images, images_path), (labels, labels_path)):
        if arr.dtype != np.uint8:
            raise DataError(f"{path}: expected unsigned byte (0x08) elements, found {arr.dtype}")
    if image_size is not None and tuple(images.shape[1:]) != tuple(image_size):
        raise DataError(f"{images_path}: images are {images.shape[1]}x{images.shape[2]}, expected "
                        f"{image_size[0]}x{image_size[1]}")
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"{images_path} has {images.shape[0]} images but {labels_path} has "
                        f"{labels.shape[0]} labels")
    if num_classes is not None and labels.size and int(labels.max()) >= num_classes:
        raise DataError(f"{labels_path}: label {int(labels.max())} outside 0..{num_classes - 1}")
    return images, labels


def write_idx(path: str | os.PathLike, array: np.ndarray, *, compresslevel: int = 9) -> Path:
    """Write ``array`` as an IDX file; gzip-compressed (with a zero mtime, so the bytes are
    reproducible) when ``path`` ends in ``.gz``. Written to a temp file, then renamed."""
    path = Path(path)
    array = np.asarray(array)
    codes = {dt.newbyteorder("="): code for code, dt in IDX_TYPES.items()}
    code = codes.get(array.dtype.newbyteorder("="))
    if code is None:
        raise DataError(f"{path}: IDX cannot store dtype {array.dtype}")
    if not 1 <= array.ndim <= 255:
        raise DataError(f"{path}: IDX cannot store a {array.ndim}-dimensional array")
    data = (struct.pack(">BBBB", 0, 0, code, array.ndim)
            + struct.pack(f">{array.ndim}I", *array.shape)
            + np.ascontiguousarray(array, dtype=IDX_TYPES[code]).tobytes())
    if path.suffix == ".gz":
        data = gzip.compress(data, compresslevel=compresslevel, mtime=0)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path
