"""Data layer: IDX and CIFAR readers (real formats, synthetic files), the registry, the built-in
Fashion-MNIST subset, sharding. No collectives: every rank runs each test on its own."""
from __future__ import annotations

import gzip
import io
import logging
import os
import pickle
import pickletools
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import hpcasync.data.datasets as ds
from hpcasync.data import (ArrayDataset, EpochShards, Sharder, batches, epoch_permutation, load_dataset,
                           num_batches, read_idx, read_idx_pair, safe_unpickle, shard_indices,
                           write_idx)
from hpcasync.data.cifar import read_bin_batch, read_pickle_batch
from hpcasync.data.sharding import mix_seed
from hpcasync.errors import ConfigError, DataError

FASHION = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(not (FASHION / "train-images-idx3-ubyte.gz").is_file(),
                                   reason="Debian dataset-fashion-mnist not installed")


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


# ----------------------------------------------------------------------------------------- IDX
@pytest.mark.parametrize("dtype", ["u1", "i1", "i2", "i4", "f4", "f8"])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip(tmp_path, dtype, suffix):
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal((3, 4, 5)) * 100).astype(dtype)
    path = write_idx(tmp_path / f"a{suffix}", arr)
    back = read_idx(path)
    assert back.dtype == np.dtype(dtype).newbyteorder("=") and back.shape == arr.shape
    assert np.array_equal(back, arr)


def test_idx_header_bytes_match_spec(tmp_path):
    arr = np.arange(6, dtype=np.uint8).reshape(2, 3)
    raw = write_idx(tmp_path / "a", arr).read_bytes()
    assert raw == b"\x00\x00\x08\x02" + struct.pack(">II", 2, 3) + bytes(range(6))
    big = write_idx(tmp_path / "b", np.array([1, 256], dtype=np.int32)).read_bytes()
    assert big == b"\x00\x00\x0c\x01" + struct.pack(">I", 2) + struct.pack(">ii", 1, 256)


def test_idx_gzip_detected_by_content_not_name(tmp_path):
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    raw = write_idx(tmp_path / "raw", arr).read_bytes()
    (tmp_path / "raw-named.gz").write_bytes(raw)
    (tmp_path / "gz-named-raw").write_bytes(gzip.compress(raw))
    assert np.array_equal(read_idx(tmp_path / "raw-named.gz"), arr)
    assert np.array_equal(read_idx(tmp_path / "gz-named-raw"), arr)


def _pair(tmp_path, n_img=5, n_lab=5, size=(28, 28), labels=None):
    img = write_idx(tmp_path / "img.gz", np.zeros((n_img, *size), np.uint8))
    lab = write_idx(tmp_path / "lab.gz", np.asarray(labels if labels is not None
                                                    else np.arange(n_lab) % 10, np.uint8))
    return img, lab


def test_idx_pair_ok(tmp_path):
    images, labels = read_idx_pair(*_pair(tmp_path))
    assert images.shape == (5, 28, 28) and labels.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("case, needle", [
    ("missing", "missing data file"),
    ("magic", "not an IDX file"),
    ("type", "unknown element type 0x07"),
    ("short_header", "truncated IDX header"),
    ("truncated", "truncated: header says shape (5, 28, 28)"),
    ("trailing", "3 unexpected bytes"),
    ("bad_gzip", "corrupt or truncated gzip"),
    ("ndim", "expected a 3-dimensional IDX array"),
])
def test_idx_corruptions(tmp_path, case, needle):
    img, lab = _pair(tmp_path)
    raw = gzip.decompress(img.read_bytes())
    target = img
    if case == "missing":
        img.unlink()
    elif case == "magic":
        img.write_bytes(b"\x01\x00" + raw[2:])
    elif case == "type":
        img.write_bytes(raw[:2] + b"\x07" + raw[3:])
    elif case == "short_header":
        img.write_bytes(raw[:9])
    elif case == "truncated":
        img.write_bytes(gzip.compress(raw[:-1]))
    elif case == "trailing":
        img.write_bytes(raw + b"xyz")
    elif case == "bad_gzip":
        img.write_bytes(img.read_bytes()[:-10])
    elif case == "ndim":
        write_idx(img, np.zeros((5, 784), np.uint8))
    with pytest.raises(DataError) as info:
        read_idx_pair(img, lab)
    msg = one_line(info)
    assert needle in msg and str(target) in msg


def test_idx_pair_mismatches(tmp_path):
    with pytest.raises(DataError) as info:
        read_idx_pair(*_pair(tmp_path, n_img=5, n_lab=4))
    assert "has 5 images but" in one_line(info) and "has 4 labels" in str(info.value)
    with pytest.raises(DataError, match="images are 32x32, expected 28x28"):
        read_idx_pair(*_pair(tmp_path, size=(32, 32)))
    with pytest.raises(DataError, match="label 12 outside 0..9"):
        read_idx_pair(*_pair(tmp_path, labels=[0, 1, 12, 3, 4]))
    img, lab = _pair(tmp_path)
    write_idx(lab, np.zeros(5, np.int32))
    with pytest.raises(DataError, match="expected unsigned byte"):
        read_idx_pair(img, lab)


# --------------------------------------------------------------------------------------- CIFAR
def _binstring(b: bytes) -> bytes:
    return (b"U" + bytes([len(b)]) + b) if len(b) < 256 else (b"T" + struct.pack("<i", len(b)) + b)


def py2_cifar_pickle(data: np.ndarray, labels: list[int]) -> bytes:
    """The byte stream Python 2's cPickle (protocol 2) writes for a CIFAR-10 batch dict."""
    def ints(xs):
        return b"](" + b"".join(b"J" + struct.pack("<i", x) for x in xs) + b"e"
    n = data.shape[0]
    array = (b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + _binstring(b"b")
             + b"\x87R(K\x01J" + struct.pack("<i", n) + b"J" + struct.pack("<i", 3072) + b"\x86"
             + b"cnumpy\ndtype\n" + _binstring(b"u1") + b"K\x00K\x01\x87R"
             + b"(K\x03" + _binstring(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
             + b"\x89" + _binstring(data.tobytes()) + b"tb")
    names = b"](" + b"".join(_binstring(f"img_{i}.png".encode()) for i in range(n)) + b"e"
    return (b"\x80\x02}(" + _binstring(b"batch_label") + _binstring(b"training batch 1 of 5")
            + _binstring(b"labels") + ints(labels) + _binstring(b"data") + array
            + _binstring(b"filenames") + names + b"u.")


def _cifar_content(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 3072), dtype=np.uint8), rng.integers(0, 10, n).tolist()


def test_py2_pickle_stream_is_what_the_standard_unpickler_reads():
    data, labels = _cifar_content(3, 0)
    stream = py2_cifar_pickle(data, labels)
    pickletools.dis(stream, out=io.StringIO())                   # well-formed opcodes
    trusted = pickle.loads(stream, encoding="latin1")            # our own bytes: safe here
    ours = safe_unpickle(stream)
    assert set(ours) == set(trusted) == {"batch_label", "labels", "data", "filenames"}
    assert np.array_equal(ours["data"], trusted["data"]) and ours["data"].dtype == np.uint8
    assert ours["labels"] == trusted["labels"] == labels


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_python3_pickles_load(tmp_path, protocol):
    data, labels = _cifar_content(4, protocol)
    path = tmp_path / "batch"
    path.write_bytes(pickle.dumps({b"data": data, b"labels": labels, b"batch_label": b"x"},
                                  protocol=protocol))
    images, lab = read_pickle_batch(path)
    assert np.array_equal(images, data.reshape(4, 3, 32, 32)) and lab.tolist() == labels


def _write_cifar_dirs(root: Path, n: int):
    """The same synthetic content written as cifar-10-batches-py and cifar-10-batches-bin."""
    py, binary = root / "cifar-10-batches-py", root / "cifar-10-batches-bin"
    py.mkdir(parents=True)
    binary.mkdir(parents=True)
    expected = {}
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        data, labels = _cifar_content(n, 100 + i)
        (py / name).write_bytes(py2_cifar_pickle(data, labels))
        rec = np.concatenate([np.asarray(labels, np.uint8)[:, None], data], axis=1)
        (binary / f"{name}.bin").write_bytes(rec.tobytes())
        expected[name] = (data, labels)
    return py, binary, expected


def test_cifar_both_formats(tmp_path):
    n = 7
    py, binary, expected = _write_cifar_dirs(tmp_path, n)
    tr_py, te_py = load_dataset("cifar10", data_dir=tmp_path)           # finds the py layout
    tr_bin, te_bin = load_dataset("cifar10", data_dir=binary)
    assert len(tr_py) == 5 * n and len(te_py) == n and tr_py.input_shape == (3, 32, 32)
    assert torch.equal(tr_py.images, tr_bin.images) and torch.equal(te_py.labels, te_bin.labels)
    # reference: channel planes R, G, B of 32x32 each, normalised per channel
    train_u8 = np.concatenate([expected[f"data_batch_{k}"][0] for k in range(1, 6)])
    mean, std = ds.NORMALIZATION["cifar10"]
    ref = (train_u8.reshape(-1, 3, 32, 32).astype(np.float32) / np.float32(255)
           - np.array(mean, np.float32)[:, None, None]) / np.array(std, np.float32)[:, None, None]
    assert np.allclose(tr_py.images.numpy(), ref, atol=1e-6)
    labels = sum((expected[f"data_batch_{k}"][1] for k in range(1, 6)), [])
    assert tr_py.labels.tolist() == labels and tr_py.labels.dtype == torch.int64
    lim_tr, lim_te = load_dataset("cifar10", data_dir=py, train_limit=3, test_limit=2)
    assert torch.equal(lim_tr.images, tr_py.images[:3]) and len(lim_te) == 2


class _Payload:
    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return (self.func, (self.arg,))


@pytest.mark.parametrize("func", [os.system, eval, "subprocess"])
def test_malicious_pickle_is_refused(tmp_path, func):
    marker = tmp_path / "pwned"
    if func == "subprocess":
        import subprocess
        func = subprocess.getoutput
    arg = f"touch {marker}" if func is not eval else f"open({str(marker)!r}, 'w')"
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({"data": _Payload(func, arg), "labels": [0]}, protocol=2))
    with pytest.raises(DataError) as info:
        read_pickle_batch(path)
    msg = one_line(info)
    assert msg.startswith(f"refusing to load {path}") and "executable pickle" in msg
    assert not marker.exists()


def test_pickle_cannot_smuggle_object_arrays_or_bad_codecs(tmp_path):
    with pytest.raises(DataError, match="unsupported array dtype"):
        safe_unpickle(pickle.dumps({"data": np.array([1, None], dtype=object)}, protocol=2))
    evil = b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x05\x00\x00\x00rot13\x86R."
    with pytest.raises(DataError, match="corrupt or unsupported pickle"):
        safe_unpickle(evil)
    with pytest.raises(DataError, match="corrupt or unsupported pickle"):
        safe_unpickle(b"\x80\x02}(")


def test_cifar_malformed_batches(tmp_path):
    data, labels = _cifar_content(2, 0)
    p = tmp_path / "b"
    p.write_bytes(pickle.dumps({"data": data, "labels": labels[:1]}))
    with pytest.raises(DataError, match="2 images but 1 labels"):
        read_pickle_batch(p)
    p.write_bytes(pickle.dumps({"data": data[:, :100], "labels": labels}))
    with pytest.raises(DataError, match="must be a uint8 array"):
        read_pickle_batch(p)
    p.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(DataError, match="not a CIFAR batch"):
        read_pickle_batch(p)
    b = tmp_path / "b.bin"
    b.write_bytes(bytes(3073 + 5))
    with pytest.raises(DataError, match="not a positive multiple of the 3073-byte"):
        read_bin_batch(b)
    b.write_bytes(bytes([10]) + bytes(3072))
    with pytest.raises(DataError, match="label 10 outside 0..9"):
        read_bin_batch(b)


# ------------------------------------------------------------------------------------ registry
def _synthetic_mnist(directory: Path, n_train=20, n_test=10):
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        img = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        lab = rng.integers(0, 10, n).astype(np.uint8)
        stem_i, stem_l = ds.IDX_FILES[split]
        write_idx(directory / f"{stem_i}.gz", img)
        write_idx(directory / stem_l, lab)                     # raw file works too
        arrays[split] = (img, lab)
    return arrays


def test_registry_env_dir_and_normalisation(tmp_path, monkeypatch):
    arrays = _synthetic_mnist(tmp_path / "mnist")
    monkeypatch.setenv(ds.ENV_VAR, str(tmp_path))
    train, test = load_dataset("mnist")
    img, lab = arrays["train"]
    ref = (img.astype(np.float32) / np.float32(255) - np.float32(0.1307)) / np.float32(0.3081)
    assert np.allclose(train.images.numpy()[:, 0], ref, atol=1e-6)
    assert train.labels.tolist() == lab.tolist() and len(test) == 10
    assert train.input_shape == (1, 28, 28) and train.num_classes == 10
    sub = train.subset(4)
    assert len(sub) == 4 and torch.equal(sub.images, train.images[:4])
    assert len(train.subset(10_000)) == 20
    with pytest.raises(ConfigError):
        train.subset(0)


def test_registry_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError) as info:
        load_dataset("imagenet")
    assert "fashion-mnist, fashion-mnist-mini, mnist, cifar10" in one_line(info)
    with pytest.raises(DataError) as info:
        load_dataset("fashion-mnist", data_dir=tmp_path / "nowhere")   # explicit dir: no fallback
    assert "fashion-mnist not found" in one_line(info) and "nowhere" in str(info.value)
    monkeypatch.delenv(ds.ENV_VAR, raising=False)
    monkeypatch.setattr(ds, "DEFAULT_ROOT", tmp_path / "none")
    with pytest.raises(DataError, match="cifar10 not found"):
        load_dataset("cifar10")
    with pytest.raises(ConfigError, match="positive integer"):
        load_dataset("fashion-mnist-mini", train_limit=0)


def test_user_factory_spec(tmp_path):
    """A name holding ':' is user code (hpcasync.plugins): (train, test) torch Datasets, stacked
    into ArrayDatasets of any item shape; the limits apply."""
    (tmp_path / "tiny.py").write_text(
        "import torch\nfrom torch.utils.data import TensorDataset\n"
        "def make():\n"
        "    return (TensorDataset(torch.randn(9, 6), torch.arange(9) % 4),\n"
        "            TensorDataset(torch.randn(5, 6), torch.arange(5) % 2))\n")
    train, test = load_dataset(f"{tmp_path}/tiny.py:make", train_limit=6, test_limit=100)
    assert (len(train), len(test), train.input_shape, train.num_classes) == (6, 5, (6,), 4)
    assert isinstance(train, ArrayDataset) and train.labels.tolist() == [0, 1, 2, 3, 0, 1]
    assert ds.locate_dataset(f"{tmp_path}/tiny.py:make") == (tmp_path.resolve(), "plugin")
    with pytest.raises(ConfigError) as info:
        load_dataset(f"{tmp_path}/none.py:make")
    assert "no such file" in one_line(info)


def test_builtin_mini_set():
    train, test = load_dataset("fashion-mnist-mini")
    assert (len(train), len(test)) == (6000, 1000)
    assert train.images.dtype == torch.float32 and train.input_shape == (1, 28, 28)
    assert np.bincount(train.labels.numpy(), minlength=10).tolist() == \
        [560, 643, 608, 612, 584, 594, 590, 617, 590, 602]
    assert sum(p.stat().st_size for p in ds.BUILTIN_DIR.glob("*.gz")) < 5 * 2 ** 20


def test_fallback_to_builtin_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(ds.ENV_VAR, raising=False)
    monkeypatch.setattr(ds, "DEFAULT_ROOT", tmp_path / "none")
    with caplog.at_level(logging.WARNING, logger="hpcasync.data.datasets"):
        train, test = load_dataset("fashion-mnist", train_limit=100)
    assert (len(train), len(test)) == (100, 1000)
    mini, _ = load_dataset("fashion-mnist-mini", train_limit=100)
    assert torch.equal(train.images, mini.images)
    assert "apt-get install dataset-fashion-mnist" in caplog.text and "built-in" in caplog.text


@needs_fashion
def test_real_fashion_mnist(monkeypatch):
    monkeypatch.delenv(ds.ENV_VAR, raising=False)
    start = time.perf_counter()
    train, test = load_dataset("fashion-mnist")
    elapsed = time.perf_counter() - start
    assert (len(train), len(test)) == (60000, 10000)
    assert np.bincount(train.labels.numpy()).tolist() == [6000] * 10      # balanced classes
    assert np.bincount(test.labels.numpy()).tolist() == [1000] * 10
    assert int(train.labels.min()) == 0 and int(train.labels.max()) == 9
    assert abs(train.images.mean().item()) < 1e-3 and abs(train.images.std().item() - 1) < 1e-3
    assert elapsed < 20, elapsed   # ~0.5 s alone; generous for 4 ranks on 2 shared cores
    mini_tr, mini_te = load_dataset("fashion-mnist-mini")   # the head of the real set
    assert torch.equal(mini_tr.images, train.images[:6000])
    assert torch.equal(mini_te.labels, test.labels[:1000])


# ------------------------------------------------------------------------------------ sharding
@pytest.mark.parametrize("length, shards", [(103, 4), (100, 3), (8, 8), (7, 1)])
def test_shards_disjoint_equal_and_cover(length, shards):
    parts = [shard_indices(length, shard_index=s, num_shards=shards, seed=5, epoch=2)
             for s in range(shards)]
    assert {len(p) for p in parts} == {length // shards}
    union = torch.cat(parts)
    assert len(set(union.tolist())) == len(union) == shards * (length // shards)
    assert torch.equal(union, epoch_permutation(length, seed=5, epoch=2)[:len(union)])
    assert sorted(epoch_permutation(length, seed=5, epoch=2).tolist()) == list(range(length))


def test_shards_deterministic_and_vary_with_epoch_and_seed():
    a = shard_indices(1000, shard_index=1, num_shards=4, seed=7, epoch=0)
    assert torch.equal(a, shard_indices(1000, shard_index=1, num_shards=4, seed=7, epoch=0))
    assert not torch.equal(a, shard_indices(1000, shard_index=1, num_shards=4, seed=7, epoch=1))
    assert not torch.equal(a, shard_indices(1000, shard_index=1, num_shards=4, seed=8, epoch=0))
    g = torch.Generator().manual_seed(mix_seed(7, 0))           # the documented seeding
    assert torch.equal(a, torch.randperm(1000, generator=g)[250:500])
    seeds = {mix_seed(s, e) for s in range(64) for e in range(200)}
    assert len(seeds) == 64 * 200 and max(seeds) < 2 ** 32        # no collisions, 32-bit seeds


def test_worker_subset_sharding():
    # a PS job of 4 ranks: 3 workers share the data, the PS takes none
    sharders = [Sharder(60, shard_index=w, num_shards=3, seed=1) for w in range(3)]
    idx = [s.indices(0) for s in sharders]
    assert [len(i) for i in idx] == [20, 20, 20] and len(set(torch.cat(idx).tolist())) == 60
    assert {s.num_batches(6) for s in sharders} == {3}


def _tiny_dataset(n=50):
    images = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 1, 2, 2).contiguous()
    return ArrayDataset(images, torch.arange(n) % 10, name="tiny")


def test_batches_content_and_resume():
    data = _tiny_dataset()
    sharder = Sharder(len(data), shard_index=2, num_shards=3, seed=3)
    idx = sharder.indices(4)
    full = list(sharder.batches(data, 4, batch_size=5))
    assert len(full) == num_batches(16, 5) == 3 == sharder.num_batches(5)
    for b, (x, y) in enumerate(full):
        want = idx[b * 5:(b + 1) * 5]
        assert torch.equal(x[:, 0, 0, 0], want.float()) and torch.equal(y, want % 10)
    for start in range(4):
        resumed = list(sharder.batches(data, 4, batch_size=5, start_batch=start))
        assert len(resumed) == 3 - start
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                   for a, b in zip(resumed, full[start:]))
    tail = list(batches(data, idx, 5, drop_last=False))
    assert len(tail) == 4 and len(tail[-1][1]) == 1


def test_sharding_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="shard index"):
        shard_indices(10, shard_index=4, num_shards=4, seed=0, epoch=0)
    with pytest.raises(ConfigError, match="cannot be split into 4 shards"):
        Sharder(3, shard_index=0, num_shards=4)
    with pytest.raises(ConfigError, match="seed"):
        shard_indices(10, shard_index=0, num_shards=1, seed=-1, epoch=0)
    with pytest.raises(ConfigError, match="start batch"):   # raised at the call, not at next()
        batches(_tiny_dataset(), torch.arange(10), 5, start_batch=3)
    with pytest.raises(ConfigError, match="batch size"):
        num_batches(10, 0)


# -- the re-sharding plan after a death (EpochShards) ----------------------------------------------------------------

def test_epoch_shards_match_shard_indices_and_reshard_the_rest_exactly():
    plan = EpochShards(1000, num_shards=4, seed=3, epoch=2)
    for s in range(4):                  # without a failure: the batches every run trains on
        assert torch.equal(plan.shards[s], shard_indices(1000, shard_index=s, num_shards=4,
                                                         seed=3, epoch=2))
    after = plan.reshard(5, num_shards=3, batch_size=16)      # 5 batches of 16 done per shard
    seen = torch.cat([s[:80] for s in plan.shards])
    rest = torch.cat(after.shards)
    assert len(set(seen.tolist()) & set(rest.tolist())) == 0          # nothing trained twice
    assert all(len(s) == (4 * 250 - 4 * 80) // 3 for s in after.shards)   # equal shards
    pool = torch.cat([s[80:] for s in plan.shards])
    assert torch.equal(rest, pool[:len(rest)])                        # in shard order
    assert len(pool) - len(rest) < 3
