"""Comm layer: flat buffers, flat/shm/hierarchical allreduce, nonblocking handles, 16-bit ops.

Runs on any number of ranks; tests that need 4 (2 virtual nodes x 2) skip on every rank otherwise.
References are float64 numpy sums of every rank's data, regenerated on each rank from its seed.
"""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcasync.comm import (ShmAllreduce, allreduce, hierarchical_allreduce, iallreduce,
                           ihierarchical_allreduce)
from hpcasync.comm import ops
from hpcasync.comm.compress import decode, encode
from hpcasync.comm.shm import partition
from hpcasync.errors import ConfigError, TopologyError
from hpcasync.launch import MPICH, OPEN_MPI
from hpcasync.topology import Topology
from tests.mpi_util import COMM, RANK, SIZE, VENDOR

SIZES = [1, 7, 1023, 100003]
ALGORITHMS = ["mpi", "shm"]
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}   # unit roundoff


def data(numel: int, rank: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * seed + rank))


def reference(numel: int, seed: int = 0, average: bool = False) -> np.ndarray:
    total = np.sum([data(numel, r, seed).double().numpy() for r in range(SIZE)], axis=0)
    return total / SIZE if average else total


def abs_sum(numel: int, seed: int = 0) -> np.ndarray:
    return np.sum([np.abs(data(numel, r, seed).double().numpy()) for r in range(SIZE)], axis=0)


def same_on_every_rank(t: torch.Tensor) -> bool:
    mine = t.contiguous().view(torch.uint8).numpy().tobytes()
    return all(x == mine for x in COMM.allgather(mine))


def four_ranks():
    return pytest.mark.skipif(SIZE != 4, reason="needs 4 ranks (2 virtual nodes x 2)")


@pytest.fixture(autouse=True)
def _one_thread():
    """4 ranks share 2 cores here: torch's intra-op threads would only fight each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def topo22():
    topo = Topology.build(ranks_per_node=2)
    yield topo
    topo.free()


# -- 16-bit ops and the raw-bytes trap -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sum16_kernel_is_float32_sum_rounded_once(dtype):
    a, b = (torch.randn(4099, generator=torch.Generator().manual_seed(s)).to(dtype) for s in (1, 2))
    expect = (a.float() + b.float()).to(dtype)
    out = ops.sum16_inplace(a, b.clone())
    assert torch.equal(out.view(torch.int16), expect.view(torch.int16))


def test_16bit_ops_are_custom_and_created_once():
    assert ops.sum_op(torch.float32) == MPI.SUM
    bf, fp = ops.bf16_sum_op(), ops.fp16_sum_op()
    assert bf != MPI.SUM and fp != MPI.SUM and bf != fp
    assert ops.sum_op(torch.bfloat16) is bf and bf.Is_commutative()
    buf = ops.mpi_buffer(torch.zeros(3, dtype=torch.bfloat16))
    assert buf[1] == MPI.INT16_T and buf[0].dtype == np.int16


@pytest.mark.skipif(SIZE < 2, reason="a 1-rank reduction cannot show the trap")
def test_raw_bf16_handed_to_mpi_is_never_a_sum_and_ours_is(monkeypatch):
    """bf16 reaches MPI as raw bytes: Open MPI adds them silently (garbage), MPICH refuses
    (MPI_ERR_OP: MPI_SUM is not defined on MPI_BYTE). Either way no MPI gives the sum; ours does."""
    x = torch.full((64,), 1.5, dtype=torch.bfloat16)
    naive = x.clone()
    try:
        COMM.Allreduce(MPI.IN_PLACE, naive, op=MPI.SUM)        # the trap
        assert VENDOR != MPICH, "MPICH summed raw bytes without an error"
        assert not torch.allclose(naive.float(), torch.full((64,), 1.5 * SIZE), rtol=0.01)
    except MPI.Exception as exc:                               # every rank checks its arguments
        assert VENDOR != OPEN_MPI and exc.Get_error_class() == MPI.ERR_OP, exc
    calls = []
    real = ops.sum16_inplace
    monkeypatch.setattr(ops, "sum16_inplace", lambda a, b: (calls.append(a.numel()), real(a, b))[1])
    ours = x.clone()
    allreduce(COMM, ours, algorithm="mpi")
    assert torch.equal(ours.float(), torch.full((64,), 1.5 * SIZE))
    assert COMM.allreduce(len(calls)) >= 1                     # our op ran somewhere


# -- flat allreduce ------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("average", [False, True])
def test_allreduce_equals_numpy_reference(algorithm, numel, average):
    x = data(numel, RANK)
    out = allreduce(COMM, x, average=average, algorithm=algorithm)
    assert out is x
    np.testing.assert_allclose(x.double().numpy(), reference(numel, average=average),
                               rtol=1e-5, atol=1e-5)
    assert same_on_every_rank(x)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_float64_int64_and_2d_tensors(algorithm):
    x = data(1023, RANK).double().view(31, 33)
    allreduce(COMM, x, average=True, algorithm=algorithm)
    np.testing.assert_allclose(x.view(-1).numpy(), reference(1023, average=True), rtol=1e-12)
    k = torch.arange(5000, dtype=torch.int64) * (RANK + 1)
    allreduce(COMM, k, algorithm=algorithm)
    assert torch.equal(k, torch.arange(5000, dtype=torch.int64) * (SIZE * (SIZE + 1) // 2))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("numel, limits", [
    (1023, [{"bucket_bytes": 4}, {"bucket_bytes": 64}, {"chunk_elems": 7}]),
    (100003, [{"bucket_bytes": 4096}, {"bucket_bytes": 40_000}, {"chunk_elems": 1000},
              {"chunk_elems": 50_000, "bucket_bytes": 1 << 30}]),
])
def test_bucketed_and_chunked_equal_whole(algorithm, numel, limits):
    whole = allreduce(COMM, data(numel, RANK), algorithm=algorithm)
    np.testing.assert_allclose(whole.double().numpy(), reference(numel), rtol=1e-5, atol=1e-5)
    for kwargs in limits:
        x = allreduce(COMM, data(numel, RANK), algorithm=algorithm, **kwargs)
        np.testing.assert_allclose(x.numpy(), whole.numpy(), rtol=1e-6, atol=1e-6,
                                   err_msg=str(kwargs))
        h = iallreduce(COMM, data(numel, RANK), algorithm=algorithm, **kwargs)
        np.testing.assert_allclose(h.wait().numpy(), whole.numpy(), rtol=1e-6, atol=1e-6)


def test_shm_window_pieces_and_one_sync_path_equal_reference():
    if SIZE == 1:
        pytest.skip("the shm engine needs 2+ ranks")
    for engine in (ShmAllreduce(COMM, max_bytes=4096), ShmAllreduce(COMM, small_bytes=0),
                   ShmAllreduce(COMM, small_bytes=1 << 20)):
        try:
            for numel in (7, 1023, 100003):
                x = engine.allreduce(data(numel, RANK, seed=3), average=True)
                np.testing.assert_allclose(x.double().numpy(), reference(numel, 3, True),
                                           rtol=1e-5, atol=1e-5)
                assert same_on_every_rank(x)
        finally:
            engine.free()


# -- nonblocking --------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_iallreduce_handle(algorithm):
    x, y = data(100003, RANK, 1), data(1023, RANK, 2)
    h1 = iallreduce(COMM, x, average=True, algorithm=algorithm, name="grads", step=12)
    h2 = iallreduce(COMM, y, algorithm=algorithm, bucket_bytes=512, name="params", step=13)
    assert (h1.name, h1.step, h2.name, h2.step) == ("grads", 12, "params", 13)
    assert h1.tensor is x and "grads" in repr(h1)
    assert h2.wait() is y
    assert h1.wait() is x and h1.done and h1.test()
    np.testing.assert_allclose(x.double().numpy(), reference(100003, 1, True), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y.double().numpy(), reference(1023, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_iallreduce_progress_at_different_times_does_not_desync(algorithm):
    """Later stages run on a private communicator: ranks may test() a different number of
    times and run their own collectives on the same communicator meanwhile."""
    x = data(100003, RANK, 4)
    h = iallreduce(COMM, x, algorithm=algorithm, name="x")
    for _ in range(3 * RANK):
        h.test()
    assert COMM.allreduce(RANK) == SIZE * (SIZE - 1) // 2
    while not h.test():
        pass
    np.testing.assert_allclose(x.double().numpy(), reference(100003, 4), rtol=1e-5, atol=1e-5)


# -- 16-bit compression --------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("compress", ["bf16", "fp16"])
@pytest.mark.parametrize("average", [False, True])
def test_16bit_allreduce_within_16bit_tolerance(algorithm, compress, average):
    numel = 100003
    x = data(numel, RANK, 5)
    allreduce(COMM, x, average=average, compress=compress, algorithm=algorithm)
    assert x.dtype == torch.float32
    u = UNIT[torch.bfloat16 if compress == "bf16" else torch.float16]
    # N inputs rounded once, N-1 additions rounded once each (+1 for the average's division)
    bound = (SIZE + 2) * u * abs_sum(numel, 5) / (SIZE if average else 1) + 1e-7
    err = np.abs(x.double().numpy() - reference(numel, 5, average))
    assert (err <= bound).all(), f"max excess {np.max(err - bound)}"
    assert same_on_every_rank(x)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_tensors_use_the_16bit_op(algorithm, dtype):
    x = data(20000, RANK, 6).to(dtype)
    allreduce(COMM, x, algorithm=algorithm)
    ref = np.sum([data(20000, r, 6).to(dtype).double().numpy() for r in range(SIZE)], axis=0)
    abs_ref = np.sum([np.abs(data(20000, r, 6).to(dtype).double().numpy()) for r in range(SIZE)], 0)
    assert (np.abs(x.double().numpy() - ref) <= SIZE * UNIT[dtype] * abs_ref + 1e-7).all()


def test_fp16_average_divides_before_and_does_not_overflow():
    big = torch.full((5,), 60000.0)                  # fp16 max is 65504: a sum of 2+ overflows
    allreduce(COMM, big, average=True, compress="fp16", algorithm="mpi")
    assert torch.isfinite(big).all() and torch.allclose(big, torch.full((5,), 60000.0), rtol=1e-3)
    wire = encode(torch.tensor([60000.0, 3.0]), wire_dtype=torch.float16, divisor=4)
    assert wire.dtype == torch.float16 and wire.tolist() == [15000.0, 0.75]
    out = decode(torch.tensor([1.0, 3.0], dtype=torch.bfloat16), torch.empty(2), divisor=3)
    assert torch.equal(out, torch.tensor([1.0, 3.0]) / 3)   # bf16: divided after, in float32


# -- hierarchical -------------------------------------------------------------------------------
@four_ranks()
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("average", [False, True])
def test_hierarchical_2x2_equals_flat(topo22, algorithm, average):
    assert (topo22.num_nodes, topo22.local_size) == (2, 2)
    for numel in SIZES:
        flat = allreduce(COMM, data(numel, RANK, 7), average=average, algorithm="mpi")
        hier = hierarchical_allreduce(topo22, data(numel, RANK, 7), average=average,
                                      algorithm=algorithm)
        np.testing.assert_allclose(hier.numpy(), flat.numpy(), rtol=1e-5, atol=1e-6)
        assert same_on_every_rank(hier)


@four_ranks()
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_hierarchical_nonblocking_chunked_and_bf16(topo22, algorithm):
    ref = reference(100003, 8)
    x = data(100003, RANK, 8)
    h = ihierarchical_allreduce(topo22, x, algorithm=algorithm, chunk_elems=30_000,
                                name="h", step=3)
    for _ in range(2 * RANK):
        h.test()
    assert COMM.allreduce(1) == SIZE
    assert h.wait() is x and h.step == 3
    np.testing.assert_allclose(x.double().numpy(), ref, rtol=1e-5, atol=1e-5)
    y = hierarchical_allreduce(topo22, data(100003, RANK, 8), compress="bf16", algorithm=algorithm)
    assert (np.abs(y.double().numpy() - ref) <= 6 * UNIT[torch.bfloat16] * abs_sum(100003, 8)
            + 1e-7).all()


def test_hierarchical_single_node_and_non_uniform():
    topo = Topology.build()
    try:
        x = hierarchical_allreduce(topo, data(1023, RANK, 9), average=True)
        np.testing.assert_allclose(x.double().numpy(), reference(1023, 9, True), rtol=1e-5,
                                   atol=1e-6)
        with pytest.raises(TopologyError, match="same number of ranks"):
            hierarchical_allreduce(dataclasses.replace(topo, uniform=False), x)
    finally:
        topo.free()


# -- bad input ----------------------------------------------------------------------------------
def test_bad_arguments_raise_config_errors():
    x = torch.zeros(10)
    with pytest.raises(ConfigError, match="compress"):
        allreduce(COMM, x, compress="int8")
    with pytest.raises(ConfigError, match="algorithm"):
        allreduce(COMM, torch.zeros(100_000), algorithm="nccl")
    with pytest.raises(ConfigError, match="contiguous"):
        allreduce(COMM, torch.zeros(4, 4).t())
    with pytest.raises(ConfigError, match="complex64"):
        allreduce(COMM, torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ConfigError, match="bucket_bytes"):
        allreduce(COMM, x, bucket_bytes=0)
    with pytest.raises(ConfigError, match="chunk_elems"):
        iallreduce(COMM, x, chunk_elems=0)
    with pytest.raises(ConfigError, match="floating-point"):
        allreduce(COMM, torch.zeros(3, dtype=torch.int32), compress="bf16")


def test_partition_covers_range_with_aligned_bounds():
    for numel, parts, align in [(0, 4, 16), (1, 4, 16), (100003, 4, 16), (7, 3, 1), (64, 2, 32)]:
        bounds = partition(numel, parts, align=align)
        assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert all(lo % align == 0 for lo, _ in bounds if lo < numel)


# -- benchmark helpers --------------------------------------------------------------------------
def test_bench_sizes_and_table():
    from hpcasync.bench.allreduce import format_table, parse_size, summary

    assert [parse_size(s) for s in ("4K", "64KiB", "1M", "4096")] == [4096, 65536, 1 << 20, 4096]
    with pytest.raises(ConfigError, match="--sizes"):
        parse_size("3")
    rows = [{"bytes": 65536, "iters": 5, "layout": "2×2", "ranks": 4, "memcpy": 1e-6,
             "mpi": 4e-5, "ours": 2e-5, "shm": 2e-5, "hier": 8e-5, "auto": "window",
             "auto_from": "measured now"}]
    table = format_table(rows)
    # cold copy 65.54 GB/s; bound = (3 + 1/4) x 1 us / 2 = 1.6 us; ratios; of bound 0.04 / 0.08
    assert ("| 64 KiB | 5 | 65.54 | 1.6 | 40.0 | 20.0 | window (measured now) | 20.0 | 80.0 |"
            in table)
    assert "| 2.00 | 2.00 | 0.50 | 0.04 | 0.08 |" in table
    assert "met (lowest ours/MPI 2.00 at 64 KiB)" in summary(rows)
    assert "window >= 1.2x MPI at: 64 KiB" in summary(rows)
    assert "where auto chose the window (64 KiB): lowest ours/MPI 2.00" in summary(rows)
    assert "slower than the other method by > 3 % in this run at: no size" in summary(rows)
    rows[0].update(auto="MPI")                       # MPI chosen where the window was 2x faster
    assert "> 3 % in this run at: 64 KiB" in summary(rows)


def test_bench_runs_and_checks_results():
    from hpcasync.bench.allreduce import add_arguments, measure

    if SIZE < 2:
        pytest.skip("the benchmark needs 2+ ranks")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--sizes", "4K", "64K", "--iters", "2"])
    rows = measure(COMM, [4096, 65536], iters=args.iters, budget_bytes=1 << 20)
    assert [r["bytes"] for r in rows] == [4096, 65536]
    assert all(r["mpi"] > 0 and r["ours"] > 0 and r["shm"] > 0 and r["memcpy"] > 0 for r in rows)
    assert all(r["auto"] in ("MPI", "window") for r in rows)
    assert all(r["auto_from"] == "measured now" or r["auto_from"].startswith("cached ")
               for r in rows)


def test_pinned_pool_reuses_buffers_and_never_shares_one():
    from hpcasync.comm.allreduce import PinnedPool

    pool = PinnedPool()
    a = pool.acquire(torch.arange(10.0))
    b = pool.acquire(torch.arange(4.0))                        # a is in use: a second buffer
    assert torch.equal(a, torch.arange(10.0)) and a.data_ptr() != b.data_ptr()
    pool.release(a)
    c = pool.acquire(torch.ones(3, dtype=torch.float64))       # 24 bytes fit in a's 40
    assert c.data_ptr() == a.data_ptr() and torch.equal(c, torch.ones(3, dtype=torch.float64))
