"""Persistent allreduce (``MPI_Allreduce_init``, :mod:`hpcasync.comm.persistent`): bitwise equal
to ``MPI_Allreduce``, one request per registered span reused step after step, never a stale one,
freed with the communicator and with the buffer; under ULFM a dead peer raises instead of
hanging."""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest
import torch
from mpi4py import MPI

from hpcasync.comm import FlatModel, allreduce, iallreduce, persistent
from hpcasync.errors import ConfigError
from tests.mpi_util import COMM, RANK, REPO, clean_env, mpiexec, need_ulfm

needs_init = pytest.mark.skipif(not persistent.supported(), reason="no MPI_Allreduce_init here")
STEPS = 5
#: elements per span: 1 element to a few MiB (float64: 2^19 + 3 elements = 4 MiB)
SIZES = [1, 7, 1000, 65_537, (1 << 19) + 3]


@pytest.fixture
def comm(monkeypatch):
    """A fresh duplicate on which ``auto`` takes MPI (the path persistent requests replace), with
    the persistent switch on; both restored afterwards."""
    monkeypatch.setenv("HPCASYNC_ALLREDUCE", "mpi")
    persistent.set_enabled(True)
    c = COMM.Dup()
    yield c
    persistent.set_enabled(None)
    c.Free()


def _reference(comm, x: torch.Tensor, average: bool) -> torch.Tensor:
    """``MPI_Allreduce`` of a copy of ``x`` (then the same division hpcasync does)."""
    ref = x.clone()
    comm.Allreduce(MPI.IN_PLACE, ref.numpy(), op=MPI.SUM)
    if average:
        ref.div_(comm.Get_size())
    return ref


def _fill(t: torch.Tensor, step: int, salt: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + 10 * RANK + salt)
    t.copy_(torch.randn(t.numel(), generator=gen, dtype=torch.float64).to(t.dtype))


@needs_init
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("average", [False, True])
def test_persistent_path_equals_mpi_allreduce_bitwise_on_reused_buffers(comm, dtype, average):
    """Per size, one registered storage holds spans a and b of that size (same size, different
    offsets), reused every step; two more storages of that size are made anew every step, the old
    one kept alive (``kept``) or dropped (``fresh``: its address, even its Python id, may come
    back). Five steps with new contents each: the blocking path (a, kept), the handle path (b:
    Start, then test() until done) and persistent.allreduce (fresh) must each equal
    MPI_Allreduce bitwise, and a and b are not built again after step 0."""
    keep = []
    for n in SIZES:
        store = persistent.register(torch.zeros(2 * n + 5, dtype=dtype))
        a, b = store[:n], store[n + 5:]
        built = None
        for step in range(STEPS):
            kept = persistent.register(torch.zeros(n, dtype=dtype))
            keep.append(kept)
            fresh = persistent.register(torch.zeros(n, dtype=dtype))
            _fill(store, step, 1)
            _fill(kept, step, 2)
            _fill(fresh, step, 3)
            spans = {"a": a, "b": b, "kept": kept, "fresh": fresh}
            refs = {k: _reference(comm, t, average) for k, t in spans.items()}
            allreduce(comm, a, average=average)                   # try_direct -> Start/Wait
            h = iallreduce(comm, b, average=average, name="b", step=step)
            while not h.test():                                   # Start, then polled
                pass
            allreduce(comm, kept, average=average)
            persistent.allreduce(comm, fresh, average=average)
            for k, t in spans.items():
                assert torch.equal(t, refs[k]), (n, step, k)
            del fresh, spans
            # (refcounting frees fresh here: its requests go with it)
            if step == 0:
                built = persistent.held()
            else:                                             # one more for each kept storage
                assert persistent.held() == built + step, (n, step)
        keep.clear()
        gc.collect()


@needs_init
def test_pieces_of_a_registered_buffer_each_get_their_request(comm):
    """bucket_bytes cuts a registered buffer into pieces (the general MPI path): one persistent
    request per piece, equal to MPI_Allreduce of the whole, step after step."""
    store = persistent.register(torch.zeros(10_000))
    before = persistent.held()
    for step in range(3):
        _fill(store, step, 4)
        ref = _reference(comm, store, True)
        allreduce(comm, store, average=True, bucket_bytes=4 * 3000)       # 4 pieces
        assert torch.equal(store, ref), step
        assert persistent.held() == before + 4


@needs_init
def test_unregistered_tensors_and_a_switched_off_path_build_no_request(comm):
    before = persistent.held()
    x = torch.randn(3000, generator=torch.Generator().manual_seed(RANK))
    ref = _reference(comm, x, False)
    assert torch.equal(allreduce(comm, x.clone()), ref)             # not registered
    persistent.set_enabled(False)
    y = persistent.register(x.clone())
    assert torch.equal(allreduce(comm, y), ref)                     # switched off
    assert persistent.held() == before
    with pytest.raises(ConfigError, match="registered CPU tensor"):
        persistent.allreduce(comm, x.clone())


@needs_init
def test_requests_are_freed_with_the_communicator_and_with_the_buffer(comm):
    before = persistent.held()
    store = persistent.register(torch.ones(5000))
    other = COMM.Dup()
    try:
        persistent.allreduce(comm, store[:1000])
        persistent.allreduce(other, store[:1000])
        persistent.allreduce(other, store[1000:])
        assert persistent.held() == before + 3
    finally:
        other.Free()                                   # MPI's delete callback -> forget()
    assert persistent.held() == before + 1
    view = store[:10]
    del store
    gc.collect()
    assert persistent.held() == before + 1             # a view keeps the storage: kept
    del view
    gc.collect()
    assert persistent.held() == before                 # the storage is gone: freed


@needs_init
def test_flat_model_registers_its_storages_and_buckets_reuse_their_requests(comm):
    """A FlatModel's gradient buckets (as SSGD reduces them) go through persistent requests,
    built once, with the same result as MPI_Allreduce."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 4))
    flat = FlatModel(net)
    assert persistent.registered(flat.grads) and persistent.registered(flat.params)
    before = persistent.held()
    spans = [flat.grads[:600], flat.grads[600:]]
    for step in range(3):
        _fill(flat.grads, step, 5)
        refs = [_reference(comm, s, True) for s in spans]
        for s, ref in zip(spans, refs):
            assert torch.equal(allreduce(comm, s, average=True), ref)
        assert persistent.held() == before + 2


@needs_init
@pytest.mark.parametrize("overlap,progress", [(True, "thread"), (True, "test"), (False, "thread")])
def test_ssgd_steps_are_bitwise_the_same_with_persistent_requests(monkeypatch, overlap, progress):
    """SSGD's DistributedOptimizer with the persistent path off, then on: after 3 steps the
    parameters are bitwise equal; with it on, each gradient bucket got one request, built at the
    first step and reused after."""
    from hpcasync.ssgd import DistributedOptimizer

    monkeypatch.setenv("HPCASYNC_ALLREDUCE", "mpi")
    params = []
    for on in (False, True):
        persistent.set_enabled(on)
        comm = COMM.Dup()
        try:
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                      torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                      torch.nn.Linear(64, 4))
            flat = FlatModel(net)
            opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                       flat, comm, bucket_bytes=4096, overlap=overlap,
                                       progress=progress)
            before = persistent.held()
            gen = torch.Generator().manual_seed(RANK)
            for step in range(3):
                x, y = torch.randn(16, 20, generator=gen), torch.randint(0, 4, (16,), generator=gen)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                opt.step()
                assert persistent.held() - before == len(opt.reducer.buckets) * on, step
            opt.close()
            params.append(flat.params.clone())
        finally:
            persistent.set_enabled(None)
            comm.Free()
    assert torch.equal(params[0], params[1])


def test_switch_reads_the_environment(monkeypatch):
    persistent.set_enabled(None)
    monkeypatch.setenv("HPCASYNC_PERSISTENT", "maybe")
    with pytest.raises(ConfigError, match="HPCASYNC_PERSISTENT='maybe': use 1 or 0"):
        persistent.enabled()
    monkeypatch.setenv("HPCASYNC_PERSISTENT", "0")
    persistent.set_enabled(None)
    assert persistent.enabled() is False
    monkeypatch.setenv("HPCASYNC_PERSISTENT", "1")
    persistent.set_enabled(None)
    assert persistent.enabled() is persistent.supported()
    monkeypatch.delenv("HPCASYNC_PERSISTENT")
    persistent.set_enabled(None)
    assert persistent.enabled() is (persistent.DEFAULT and persistent.supported())
    persistent.set_enabled(None)


# -- ULFM: a dead peer surfaces as an MPI error ---------------------------------------------------

_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    from hpcasync.comm import allreduce, iallreduce, persistent
    from hpcasync.topology import init_mpi
    MPI = init_mpi()         # as the CLI starts MPI (ULFM: no PMIx fence in MPI_Finalize)
    comm = MPI.COMM_WORLD.Dup()
    rank, mode = comm.Get_rank(), sys.argv[1]
    store = persistent.register(torch.ones(int(sys.argv[2])))
    for step in range(6):
        if step == 3 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            if mode == "blocking":
                allreduce(comm, store)
            else:
                h = iallreduce(comm, store)
                while not h.test():
                    time.sleep(0.001)
        except MPI.Exception as exc:
            print(f"rank {rank} step {step} raised {MPI.Get_error_string(exc.Get_error_class())}"
                  f" after {time.monotonic() - t0:.2f} s held {persistent.held()}", flush=True)
            sys.exit(0)
        assert float(store[0]) == comm.Get_size(), float(store[0])
        store.fill_(1.0)
    print(f"rank {rank} finished without an error", flush=True)
""")


@pytest.mark.rank0
@needs_init
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["blocking", "handle"])
def test_under_ulfm_a_dead_peer_raises_in_a_persistent_wait(tmp_path, mode):
    """Rank 1 of 3 SIGKILLs itself before step 3; ranks 0 and 2, reducing through persistent
    requests (HPCASYNC_PERSISTENT=1, auto on MPI as ULFM requires), raise MPI_ERR_PROC_FAILED
    at that step within seconds instead of waiting forever."""
    need_ulfm()
    script = tmp_path / "child.py"
    script.write_text(_CHILD, encoding="utf-8")
    env = clean_env(HPCASYNC_PERSISTENT="1", HPCASYNC_TUNE_FILE="none")
    out = subprocess.run([*mpiexec(3, ft=True), sys.executable, str(script), mode, "100000"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("rank ")]
    for r in (0, 2):
        [line] = [ln for ln in lines if ln.startswith(f"rank {r} ")]
        assert f"rank {r} step 3 raised MPI_ERR_PROC_FAILED" in line, out.stdout
        assert float(line.split(" after ")[1].split()[0]) < 30, line
        assert line.endswith("held 1"), line              # the path under test was persistent
    assert not any("finished without an error" in ln for ln in lines), out.stdout
