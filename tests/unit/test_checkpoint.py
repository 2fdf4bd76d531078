"""Checkpoints: exact round trip, every damaged file refused with CheckpointError (one line naming
the file), latest picks the newest intact one, pruning. (The agreed preemption stop, which needs
ranks: tests/mpi/test_checkpoint.py.)"""
import os

import pytest
import torch

from hpcasync.checkpoint import (FORMAT, CheckpointManager, checkpoint_name, latest_checkpoint,
                                 load_checkpoint, read_checkpoint, save_checkpoint)
from hpcasync.errors import CheckpointError

HEADER = {"algorithm": "ssgd", "model": "lenet", "world_size": 4}


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"conv.weight": torch.randn(6, 1, 5, 5, generator=g),
                  "fc.bias": torch.randn(10, generator=g).to(torch.bfloat16),
                  "steps": torch.tensor(7, dtype=torch.int64)},
        "optimizer": {"state": {0: {"momentum_buffer": torch.randn(4, generator=g)}},
                      "param_groups": [{"lr": 0.05, "momentum": 0.9, "params": [0]}]},
        "rng": torch.get_rng_state(), "epoch": 3, "step": 1234, "loss": float("nan"),
        "name": "run-α", "flags": [True, None, (1, "a")],
    }


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        raw = (lambda t: t.reshape(-1).view(torch.uint8))       # bitwise, NaN included
        assert torch.equal(raw(a), raw(b))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


def saved(tmp_path, name="ckpt.pt", **kw):
    path = tmp_path / name
    save_checkpoint(path, make_state(), epoch=3, step=1234, **{**HEADER, **kw})
    return path


def test_round_trip_bitwise_and_plain_torch_load(tmp_path):
    path = saved(tmp_path)
    header, state = read_checkpoint(path, expect=HEADER)
    assert_same(state, make_state())
    assert {k: header[k] for k in ("format", "version", "epoch", "step")} == \
        {"format": FORMAT, "version": 1, "epoch": 3, "step": 1234}
    raw = torch.load(path, weights_only=True)          # readable without hpcasync
    assert_same(raw["payload"], make_state())
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]     # no temp file left behind


def test_save_refuses_non_plain_objects_and_writes_nothing(tmp_path):
    import numpy as np

    for bad, what in [({"w": np.zeros(3)}, "ndarray"), ({"m": torch.nn.Linear(2, 2)}, "Linear"),
                      ({"f": lambda x: x}, "function"), ({(1, 2): 3}, "dict key")]:
        with pytest.raises(CheckpointError, match=what):
            save_checkpoint(tmp_path / "x.pt", bad)
    assert list(tmp_path.iterdir()) == []
    # numpy scalars that subclass float are stored as plain floats
    save_checkpoint(tmp_path / "y.pt", {"lr": np.float64(0.5)})
    assert type(load_checkpoint(tmp_path / "y.pt")["lr"]) is float


def test_missing_empty_and_truncated_files(tmp_path):
    with pytest.raises(CheckpointError, match=r"nope\.pt: no such file"):
        load_checkpoint(tmp_path / "nope.pt")
    data = saved(tmp_path).read_bytes()
    cut = tmp_path / "cut.pt"
    for n in [0, 1, 30, len(data) // 2, len(data) - 22, len(data) - 1]:
        cut.write_bytes(data[:n])
        with pytest.raises(CheckpointError, match=r"^checkpoint .*cut\.pt: (empty|truncated)"):
            load_checkpoint(cut)


def test_flipped_bytes_never_load_wrong_data(tmp_path):
    path = saved(tmp_path)
    data = path.read_bytes()
    # a byte inside the first tensor's data, found by its value
    first = make_state()["model"]["conv.weight"].numpy().tobytes()[:16]
    at = data.index(first) + 5
    bad = tmp_path / "bad.pt"
    bad.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:])
    with pytest.raises(CheckpointError, match=r"bad\.pt: corrupt \(checksum mismatch\)"):
        load_checkpoint(bad)
    # any single flipped byte: either a one-line CheckpointError or exactly the saved content
    # (bytes torch never reads, such as zip alignment padding); every offset i with i % 13 < 4
    # (the offsets the 4 ranks of the MPI suite used to share)
    errors = 0
    for i in (i for i in range(len(data)) if i % 13 < 4):
        bad.write_bytes(data[:i] + bytes([data[i] ^ 0xA5]) + data[i + 1:])
        try:
            _, state = read_checkpoint(bad)
        except CheckpointError as exc:
            assert "\n" not in str(exc) and "bad.pt" in str(exc)
            errors += 1
        else:
            assert_same(state, make_state())
    assert errors > 0


def test_malicious_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    path = tmp_path / "evil.pt"
    torch.save({"header": {"format": FORMAT, "version": 1}, "sha256": "", "payload": Evil()}, path)
    with pytest.raises(CheckpointError, match=r"evil\.pt: refused"):
        load_checkpoint(path)
    assert not marker.exists()


def test_foreign_files_are_named(tmp_path):
    torch.save({"w": torch.zeros(2)}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match=r"plain\.pt: not an hpcasync checkpoint"):
        load_checkpoint(tmp_path / "plain.pt")
    (tmp_path / "text.pt").write_text("hello\n")
    with pytest.raises(CheckpointError, match=r"text\.pt: not a checkpoint file"):
        load_checkpoint(tmp_path / "text.pt")


def test_expect_mismatch(tmp_path):
    path = saved(tmp_path)
    with pytest.raises(CheckpointError, match=r"ckpt\.pt: world_size is 4, this run has 8"):
        load_checkpoint(path, expect={"algorithm": "ssgd", "world_size": 8})
    with pytest.raises(CheckpointError, match=r"algorithm is 'ssgd', this run has 'asgd'"):
        load_checkpoint(path, expect={"algorithm": "asgd"})
    with pytest.raises(CheckpointError, match=r"model is 'lenet', this run has 'mlp'"):
        load_checkpoint(path, expect={"model": "mlp"})


def test_latest_skips_corrupt_newest_and_temp_files(tmp_path, caplog):
    for epoch, step in [(0, 50), (1, 100), (1, 150)]:
        save_checkpoint(tmp_path / checkpoint_name(epoch, step), {"step": step}, step=step)
    newest = tmp_path / checkpoint_name(2, 200)
    save_checkpoint(newest, {"step": 200}, step=200)
    newest.write_bytes(newest.read_bytes()[:-100])                     # truncated
    (tmp_path / f".{checkpoint_name(3, 300)}.abc.tmp").write_bytes(b"partial")   # writer died
    (tmp_path / "ckpt-e0009-s00000900.pt.partial").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("x")
    with caplog.at_level("WARNING", logger="hpcasync"):
        found = latest_checkpoint(tmp_path)
    assert found == tmp_path / "ckpt-e0001-s00000150.pt"
    assert load_checkpoint(found) == {"step": 150}
    assert any("ckpt-e0002-s00000200.pt" in r.getMessage() for r in caplog.records)
    assert latest_checkpoint(tmp_path / "empty-dir") is None


def test_manager_keeps_newest_and_loads_latest(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep=2)
    for i in range(5):
        mgr.save({"i": i, "w": torch.full((3,), float(i))}, epoch=i // 2, step=10 * i, **HEADER)
    assert [p.name for p in mgr.checkpoints()] == [checkpoint_name(2, 40), checkpoint_name(1, 30)]
    path, header, state = mgr.load_latest(expect=HEADER)
    assert path.name == checkpoint_name(2, 40) and header["step"] == 40 and state["i"] == 4
    with pytest.raises(CheckpointError, match="world_size is 4, this run has 2"):
        mgr.load_latest(expect={"world_size": 2})
    assert CheckpointManager(tmp_path / "none").load_latest() is None
    with pytest.raises(CheckpointError, match="keep"):
        CheckpointManager(tmp_path, keep=0)
