"""``algorithm="auto"``: measured per size class, the same on every rank, kept across runs; and
the direct MPI path it takes (one MPI_Allreduce, cached numpy views) gives exact results."""
from __future__ import annotations

import json
import os

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
    monkeypatch.setattr(tune, "_memory", {})
    yield path
    COMM.Barrier()


def _window_used(comm) -> bool:
    engine = comm_cache(comm).get("shm_allreduce")
    return isinstance(engine, ShmAllreduce) and engine.cap > 0


def test_size_classes():
    assert [tune.size_class(b) for b in (1, 4096, 4097, 3 << 20, 1 << 30)] == \
        [4096, 4096, 8192, 4 << 20, 64 << 20]


@multi
@pytest.mark.parametrize("t_mpi, t_shm, shm", [(1.2, 1.0, True), (1.19, 1.0, False),
                                               (0.5, 1.0, False)])
def test_the_window_only_where_measured_at_least_1_2x_faster(tune_file, monkeypatch,
                                                             t_mpi, t_shm, shm):
    monkeypatch.setattr(tune, "measure", lambda comm, nbytes, wire: (t_mpi, t_shm))
    comm = COMM.Dup()
    try:
        x = allreduce(comm, torch.ones(100_000))
        assert torch.equal(x, torch.full((100_000,), float(SIZE)))
        assert _window_used(comm) == shm
        assert comm_cache(comm)["auto_shm"] == {(512 << 10, False): shm}
    finally:
        comm.Free()
    if RANK == 0:
        (rec,) = json.loads(open(tune_file).read()).values()
        assert rec["shm"] == shm and rec["mpi_s"] == t_mpi


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

    def no_measuring(*a):
        raise AssertionError("measured again although the file has the decision")
    monkeypatch.setattr(tune, "measure", no_measuring)
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
        with pytest.raises(ConfigError, match="HPCASYNC_ALLREDUCE must be mpi or shm"):
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
                        lambda comm, nbytes, wire: (1.0, 0.5) if node == 0 else (1.0, 2.0))
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
