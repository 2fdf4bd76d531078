"""``algorithm="auto"``: measured per size class, the same on every rank, kept across runs; and
the direct MPI path it takes (one MPI_Allreduce, cached numpy views) gives exact results."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from hpcasync.comm import allreduce, iallreduce
from hpcasync.comm import direct, tune
from hpcasync.comm.cache import comm_cache
from hpcasync.comm.shm import ShmAllreduce
from hpcasync.errors import ConfigError
from tests.mpi_util import COMM, RANK, SIZE

multi = pytest.mark.skipif(SIZE == 1, reason="auto's window needs 2+ ranks")


@pytest.fixture
def tune_file(tmp_path, monkeypatch):
    """One decision file for every rank (rank 0's tmp path), cleared of forced choices."""
    path = COMM.bcast(str(tmp_path / "auto.json") if RANK == 0 else None, root=0)
    monkeypatch.setenv("HPCASYNC_TUNE_FILE", path)
    monkeypatch.delenv("HPCASYNC_ALLREDUCE", raising=False)
    monkeypatch.setenv("HPCASYNC_TUNE_RECHECK", "1")     # the suite's default is 0 (conftest)
    monkeypatch.setattr(tune, "_memory", {})
    yield path
    COMM.Barrier()


def _window_used(comm) -> bool:
    engine = comm_cache(comm).get("shm_allreduce")
    return isinstance(engine, ShmAllreduce) and engine.cap > 0


def test_size_classes():
    assert [tune.size_class(b) for b in (1, 4096, 4097, 3 << 20, 1 << 30)] == \
        [4096, 4096, 8192, 4 << 20, 64 << 20]


def _m(ratio: float, low: float, high: float, rounds: int = 8) -> tune.Measurement:
    return tune.Measurement(mpi_s=ratio * 1e-3, shm_s=1e-3, ratio=ratio, low=low, high=high,
                            rounds=rounds)


@multi
@pytest.mark.parametrize("first, second, shm", [
    (_m(1.5, 1.2, 1.8), _m(1.4, 1.1, 1.7), True),       # clear twice: the window
    (_m(1.5, 1.2, 1.8), _m(1.1, 0.9, 1.3), False),      # not confirmed: MPI
    (_m(1.1, 1.01, 1.19), None, False),                 # faster, but not beyond the spread
    (_m(1.08, 1.05, 1.11), None, False),                # beyond the spread, but a near tie
    (_m(0.5, 0.4, 0.6), None, False)])
def test_the_window_only_where_clearly_faster_twice(tune_file, monkeypatch, first, second, shm):
    calls = []

    def measured(comm, nbytes, wire, **kw):
        calls.append(kw)
        return first if len(calls) == 1 else second
    monkeypatch.setattr(tune, "measure", measured)
    comm = COMM.Dup()
    try:
        x = allreduce(comm, torch.ones(100_000))
        assert torch.equal(x, torch.full((100_000,), float(SIZE)))
        assert _window_used(comm) == shm
        assert comm_cache(comm)["auto_shm"] == {(512 << 10, False): shm}
    finally:
        comm.Free()
    assert len(calls) == (2 if second is not None else 1)   # a window verdict is measured again
    if RANK == 0:
        (rec,) = json.loads(open(tune_file).read()).values()
        assert rec["shm"] == shm and rec["ratio"] == first.ratio and rec["low"] == first.low
        assert rec["confirmed"] == shm and ("second" in rec) == (second is not None)


def _plant(path: str, comm, nbytes: int, **record) -> str:
    """Rank 0 writes a cached choice for ``nbytes`` on ``comm`` (every rank: its key)."""
    key = tune._key(comm, tune.size_class(nbytes), torch.float32)
    if RANK == 0:
        rec = {"shm": True, "mpi_s": 3e-3, "shm_s": 1e-3, "time": time.time(), "load": 0.0,
               "measured": "planted", **record}
        with open(path, "w") as f:
            json.dump({key: rec}, f)
    comm.Barrier()
    return key


@multi
@pytest.mark.parametrize("check, keep", [(0.7, False), (1.3, True)])
def test_a_wrong_cached_window_choice_is_corrected_at_first_use(tune_file, monkeypatch, check,
                                                                keep):
    """A planted window choice: the short check at its first use (paired rounds, not adaptive)
    finds the window 0.7x MPI -> measured again (MPI clearly) and the file rewritten; 1.3x: kept
    without a full measurement."""
    calls = []

    def measured(comm, nbytes, wire, **kw):
        calls.append(kw)
        if kw.get("adaptive") is False:
            return _m(check, check - 0.1, check + 0.1, tune.CHECK_ROUNDS)
        return _m(0.6, 0.5, 0.7)
    monkeypatch.setattr(tune, "measure", measured)
    comm = COMM.Dup()
    try:
        _plant(tune_file, comm, 300_000 * 4)
        allreduce(comm, torch.ones(300_000))
        assert comm_cache(comm)["auto_shm"][(2 << 20, False)] == keep
        assert calls[0] == {"rounds": tune.CHECK_ROUNDS, "adaptive": False}
        assert len(calls) == (1 if keep else 2)
    finally:
        comm.Free()
    if RANK == 0:
        (rec,) = json.loads(open(tune_file).read()).values()
        assert rec["shm"] == keep and (rec["measured"] == "planted") == keep


@multi
def test_a_checkpoint_pins_the_choices_of_the_run_that_wrote_it(tune_file, monkeypatch, tmp_path):
    """A resume must sum as the run it continues did (SSGD's bitwise resume), even where a
    re-measurement would now choose otherwise: the checkpoint carries the choices, reading it pins
    them. Here the writing run measured the window; the file and a new measurement now say MPI."""
    from hpcasync.checkpoint import read_checkpoint, save_checkpoint
    calls = []

    def measured(verdict):
        def measure(comm, nbytes, wire, **kw):
            calls.append(kw)
            return verdict
        return measure
    path = COMM.bcast(str(tmp_path / "c.pt") if RANK == 0 else None, root=0)
    monkeypatch.setattr(tune, "measure", measured(_m(1.5, 1.2, 1.8)))
    comm = COMM.Dup()
    try:
        allreduce(comm, torch.ones(100_000))
        key = tune._key(comm, 512 << 10, torch.float32)
        assert _window_used(comm) and tune.in_use() == {key: True}
        if RANK == 0:
            save_checkpoint(path, {"w": torch.ones(1)})
        comm.Barrier()
    finally:
        comm.Free()

    def next_run(read: bool) -> bool:          # as a new process: nothing in memory
        monkeypatch.setattr(tune, "_memory", {})
        monkeypatch.setattr(tune, "measure", measured(_m(0.5, 0.4, 0.6)))
        _plant(tune_file, COMM, 100_000 * 4, shm=False)      # the file now says MPI
        calls.clear()
        if read:
            header, _ = read_checkpoint(path)
            assert header["allreduce_auto"] == {key: True}
        c = COMM.Dup()
        try:
            allreduce(c, torch.ones(100_000))
            return _window_used(c)
        finally:
            c.Free()
    assert next_run(read=False) is False            # the file's choice...
    assert next_run(read=True) is True and calls == []   # ...unless a checkpoint pins it: no check


@multi
@pytest.mark.parametrize("why", ["old", "busy"])
def test_a_stale_cached_choice_is_measured_again(tune_file, monkeypatch, why):
    monkeypatch.setattr(tune, "measure", lambda comm, nbytes, wire, **kw: _m(0.6, 0.5, 0.7))
    comm = COMM.Dup()
    try:
        busy = 2.0 * ((os.cpu_count() or 1) + SIZE + os.getloadavg()[0])  # twice now's and more
        stale = ({"time": time.time() - (tune.MAX_AGE_DAYS + 1) * 86400} if why == "old"
                 else {"load": busy})
        _plant(tune_file, comm, 300_000 * 4, shm=False, **stale)
        allreduce(comm, torch.ones(300_000))
    finally:
        comm.Free()
    if RANK == 0:
        (rec,) = json.loads(open(tune_file).read()).values()
        assert rec["measured"] != "planted" and rec["ratio"] == 0.6


@multi
def test_real_measurement_agrees_on_every_rank_and_is_reused(tune_file, monkeypatch):
    comm = COMM.Dup()
    try:
        x = allreduce(comm, torch.ones(300_000), average=True)
        assert torch.equal(x, torch.ones(300_000))
        chosen = comm_cache(comm)["auto_shm"][(2 << 20, False)]
    finally:
        comm.Free()
    assert COMM.allgather(chosen) == [chosen] * SIZE

    def no_measuring(*a, **kw):
        raise AssertionError("measured again although the file has the decision")
    monkeypatch.setattr(tune, "measure", no_measuring)
    monkeypatch.setenv("HPCASYNC_TUNE_RECHECK", "0")    # (a cached window is re-checked: above)
    monkeypatch.setattr(tune, "_memory", {})            # a new process: only the file is left
    comm = COMM.Dup()
    try:
        allreduce(comm, torch.ones(300_000))
        assert comm_cache(comm)["auto_shm"][(2 << 20, False)] == chosen
    finally:
        comm.Free()


@multi
@pytest.mark.parametrize("forced", ["mpi", "shm"])
def test_forced_choice(tune_file, monkeypatch, forced):
    monkeypatch.setenv("HPCASYNC_ALLREDUCE", forced)
    comm = COMM.Dup()
    try:
        h = iallreduce(comm, torch.ones(50_000))
        assert torch.equal(h.wait(), torch.full((50_000,), float(SIZE)))
        assert _window_used(comm) == (forced == "shm")
    finally:
        comm.Free()
    assert not os.path.exists(tune_file)                 # a forced choice is not a measurement


@multi
def test_bad_forced_choice_is_a_config_error(tune_file, monkeypatch):
    monkeypatch.setenv("HPCASYNC_ALLREDUCE", "nccl")
    comm = COMM.Dup()
    try:
        with pytest.raises(ConfigError, match="HPCASYNC_ALLREDUCE=.*: use mpi or shm"):
            allreduce(comm, torch.ones(50_000), algorithm="auto", bucket_bytes=1 << 20)
    finally:
        comm.Free()


def test_direct_path_equals_the_general_mpi_path_and_never_mixes_buffers(tune_file, monkeypatch):
    """The direct path (cached views) vs algorithm="mpi" (the step machinery): bitwise equal,
    for many live buffers of one size (more than the view cache holds), freed and re-made ones,
    averages of floats and of integers."""
    monkeypatch.setenv("HPCASYNC_ALLREDUCE", "mpi")
    comm = COMM.Dup()
    try:
        gen = torch.Generator().manual_seed(7 + RANK)
        for _ in range(3):
            xs = [torch.randn(1000, generator=gen) for _ in range(direct.VIEW_SLOTS + 3)]
            refs = [allreduce(comm, x.clone(), average=True, algorithm="mpi") for x in xs]
            outs = [allreduce(comm, x, average=True) for x in xs]
            assert all(torch.equal(a, b) for a, b in zip(outs, refs))
            del xs, outs                                  # addresses may be reused next round
        k = torch.arange(10, dtype=torch.int64) * (RANK + 1)
        ref = allreduce(comm, k.clone(), average=True, algorithm="mpi")
        assert torch.equal(allreduce(comm, k, average=True), ref)
        assert len(direct._views) <= direct.VIEW_SLOTS
        assert comm.handle in direct._decisions
        handle = comm.handle
    finally:
        comm.Free()
    assert handle not in direct._decisions                # freeing the comm forgets it


def test_a_cached_call_sees_what_changes_under_the_same_tensor_object(tune_file, monkeypatch):
    """The direct path caches a whole call per tensor object (``direct._calls``). Each change that
    keeps the object but changes what it holds -- ``set_`` to other memory, ``resize_`` (same
    address, fewer bytes), ``.data =`` a view of another dtype -- must reach MPI as the tensor is
    now: the result equals the step machinery's (``algorithm="mpi"``) bitwise; ``transpose_``
    (same address and bytes) gets the general path's error, not a reduction of the old layout."""
    monkeypatch.setenv("HPCASYNC_ALLREDUCE", "mpi")
    comm = COMM.Dup()
    try:
        def same(t, average=False):
            ref = allreduce(comm, t.clone(), average=average, algorithm="mpi")
            out = allreduce(comm, t, average=average)
            assert out.dtype == ref.dtype and torch.equal(out, ref), (out, ref)

        t = torch.arange(16, dtype=torch.float32) + RANK
        same(t)
        same(t)                                          # a repeat: the cached call
        assert id(t) in direct._calls
        t.set_(torch.arange(16, dtype=torch.float32) * (RANK + 2))   # other memory, same object
        same(t)
        t.resize_(8)                                     # same address, fewer bytes
        rest = torch.empty(0).set_(t.untyped_storage(), 8, (8,))    # the storage beyond it
        before = rest.clone()
        same(t)
        assert torch.equal(rest, before)                 # nothing past the tensor is reduced
        t.data = t.data.view(torch.int32)                # same memory and bytes, another dtype
        t.bitwise_and_(0x1F).add_(RANK + 1).mul_(1 << 23)    # as float32 bits: normal numbers
        assert t.data_ptr() == direct._calls[id(t)][2]
        same(t, average=True)                            # integer average: floor division
        m = (torch.arange(16, dtype=torch.float32) * (RANK + 1)).reshape(4, 4)
        same(m)
        m.t_()                                           # same address and bytes, transposed
        with pytest.raises(ConfigError, match="contiguous"):     # as the general path does
            allreduce(comm, m)
        assert len(direct._calls) <= direct.VIEW_SLOTS
    finally:
        comm.Free()
    assert not direct._calls                             # freeing a communicator forgets calls


@pytest.mark.skipif(SIZE != 4, reason="needs 2 virtual nodes of 2 ranks")
@pytest.mark.timeout(60)
def test_nodes_that_decide_differently_still_agree_in_the_hierarchical_allreduce(tune_file,
                                                                                  monkeypatch):
    """Each node's communicator measures alone: node 0 finds the window faster, node 1 MPI. The
    hierarchical allreduce must still take one path on both (else stage 2's chunks differ: under
    MPICH "Message truncated", CI, 2026-11-23): the window only where every node chose it."""
    from hpcasync.comm import hierarchical_allreduce, ihierarchical_allreduce
    from hpcasync.topology import Topology

    monkeypatch.setenv("HPCASYNC_TUNE_FILE", "none")      # no file shared between the nodes
    topo = Topology.build(ranks_per_node=2)
    node = RANK // 2
    monkeypatch.setattr(tune, "measure",
                        lambda comm, nbytes, wire, **kw: _m(2.0, 1.8, 2.2) if node == 0
                        else _m(0.5, 0.4, 0.6))
    try:
        x = torch.arange(300_001, dtype=torch.float32) * (RANK + 1)
        hierarchical_allreduce(topo, x, average=True)
        assert torch.equal(x, torch.arange(300_001, dtype=torch.float32) * 2.5)
        assert comm_cache(topo.local)["auto_shm"][(2 << 20, False)] == (node == 0)
        h = ihierarchical_allreduce(topo, torch.ones(70_000) * RANK, name="h")
        assert torch.equal(h.wait(), torch.full((70_000,), 6.0))
        assert COMM.allgather(_window_used(topo.local)) == [False] * 4
    finally:
        topo.free()


@pytest.mark.rank0
@pytest.mark.timeout(120)
def test_tune_command_measures_shows_and_clears(tmp_path):
    from tests.mpi_util import clean_env, run_cli, run_mpi

    env = clean_env(HPCASYNC_TUNE_FILE=str(tmp_path / "auto.json"))
    r = run_mpi(2, ["tune", "measure", "--sizes", "4K", "1M"], env=env, timeout=90)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "KiB" in line
            or line.startswith("| ") and "MiB" in line]
    assert [row.split("|")[5].strip() for row in rows] == ["4 KiB", "1 MiB"], r.stdout
    shown = run_cli(["tune", "show"], env=env)
    assert shown.returncode == 0 and "2 choice(s)" in shown.stdout, shown.stdout + shown.stderr
    info = run_mpi(2, ["info"], env=env, timeout=60)
    assert info.returncode == 0 and "1 MiB" in info.stdout, info.stdout + info.stderr
    cleared = run_cli(["tune", "clear"], env=env)
    assert "removed 2 choice(s)" in cleared.stdout, cleared.stdout + cleared.stderr
    assert "0 choice(s)" in run_cli(["tune", "show"], env=env).stdout
