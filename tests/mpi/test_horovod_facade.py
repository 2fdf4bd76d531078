"""``hpcasync.horovod`` call by call: against numpy references always, and against real Horovod
(``horovod.torch``, in the same processes, on the same inputs) whenever it is installed — CI builds
it, and then a Horovod that does not import fails these tests instead of skipping them.

Run under ``mpiexec -n 4 python -m mpi4py -m pytest``: every rank runs every test.
"""
from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import hpcasync.horovod as fh
from tests.mpi_util import COMM, HOROVOD_ERROR, RANK, SIZE, clean_env, need_horovod

pytestmark = pytest.mark.timeout(120)

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.uint8, torch.int8]




def test_real_horovod_is_there_when_ci_built_it():
    need_horovod()          # fails (not skips) under HPCASYNC_HOROVOD=1 if it does not import


def _data(dtype, rank=RANK, shape=(3, 5)):
    """Rank-dependent values that every op and dtype represents exactly."""
    n = int(np.prod(shape))
    base = torch.arange(n, dtype=torch.float64).reshape(shape)
    if dtype in (torch.uint8, torch.int8):
        return ((base + rank) % 3 + 1).to(dtype)        # products fit in 8 bits
    signs = torch.where(base % 3 == 0, -1.0, 1.0) if dtype != torch.uint8 else 1.0
    return ((base % 5 + rank + 1) * signs).to(dtype)


def _everyone(t: torch.Tensor) -> np.ndarray:
    return np.stack(COMM.allgather(t.to(torch.float64).numpy()))


def _same(a: torch.Tensor, b, dtype, tol=None):
    b = torch.as_tensor(b)
    assert a.dtype == dtype, (a.dtype, dtype)
    if dtype.is_floating_point:
        tol = tol or {torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-6)
        assert torch.allclose(a.double(), b.double(), rtol=tol, atol=tol), (a, b)
    else:
        assert torch.equal(a.long(), b.long()), (a, b)


# -- basics ----------------------------------------------------------------------------------------

def test_ranks_and_sizes_match_horovod_and_mpi(backends):
    for hvd in backends.values():
        assert (hvd.size(), hvd.rank()) == (SIZE, RANK)
        assert hvd.local_size() * hvd.cross_size() == SIZE
        assert hvd.is_initialized() and hvd.mpi_threads_supported()
    if "horovod" in backends:
        rh = backends["horovod"]
        for f in ("local_rank", "local_size", "cross_rank", "cross_size",
                  "mpi_built"):
            assert bool(getattr(fh, f)()) == bool(getattr(rh, f)()) and \
                int(getattr(fh, f)()) == int(getattr(rh, f)()), f


def test_calls_before_init_raise_value_error():
    if RANK:
        return
    code = ("import hpcasync.horovod as h\n"
            "try:\n    h.size()\nexcept ValueError as e:\n    print('ValueError', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True,
                       text=True, timeout=60)
    assert "ValueError" in r.stdout and "hvd.init()" in r.stdout, r.stdout + r.stderr


# -- allreduce -------------------------------------------------------------------------------------

def _reference(op, stacked, pre, post):
    x = stacked * pre
    red = {fh.Sum: x.sum(0), fh.Average: x.sum(0), fh.Min: x.min(0), fh.Max: x.max(0),
           fh.Product: x.prod(0)}[op]
    return red * (post / SIZE if op == fh.Average else post)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.parametrize("op", ["Average", "Sum", "Min", "Max", "Product"])
def test_allreduce_every_op_and_dtype(backends, dtype, op):
    op = getattr(fh, op)
    x = _data(dtype)
    ref = _reference(op, _everyone(x), 1.0, 1.0)
    got = fh.allreduce(x, op=op)
    if dtype.is_floating_point:
        _same(got, ref, dtype)
    else:      # integer averages: scaled in float64, truncated toward zero
        _same(got, np.trunc(ref), dtype)
    assert torch.equal(x, _data(dtype)), "the input changed"
    # Horovod's allreduce refuses uint8/int8 ("Tensor type ... is not supported"); ours sums them
    if "horovod" in backends and dtype not in (torch.bfloat16, torch.uint8, torch.int8):
        theirs = backends["horovod"].allreduce(_data(dtype), op=op, name=f"ar.{dtype}.{op}")
        _same(got, theirs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64], ids=str)
def test_allreduce_prescale_postscale(backends, dtype):
    x = _data(dtype)
    for op in (fh.Average, fh.Sum):
        got = fh.allreduce(x, op=op, prescale_factor=2.0, postscale_factor=0.5)
        ref = _reference(op, _everyone(x), 2.0, 0.5)
        _same(got, np.trunc(ref) if not dtype.is_floating_point else ref, dtype)
        if "horovod" in backends:
            theirs = backends["horovod"].allreduce(x, op=op, prescale_factor=2.0,
                                                   postscale_factor=0.5)
            _same(got, theirs, dtype)


def test_allreduce_forms_in_place_async_grouped(backends):
    x = _data(torch.float32)
    ref = torch.from_numpy(_everyone(x).mean(0)).float()
    y = x.clone()
    assert fh.allreduce_(y) is y and torch.allclose(y, ref)
    h = fh.allreduce_async(x, name="a")
    while not fh.poll(h):
        pass
    out = fh.synchronize(h)
    assert out is not x and torch.allclose(out, ref) and torch.equal(x, _data(torch.float32))
    z = x.clone()
    assert fh.synchronize(fh.allreduce_async_(z)) is z and torch.allclose(z, ref)
    with pytest.raises(ValueError):
        fh.synchronize(h)                       # a handle is synchronized once
    outs = fh.grouped_allreduce([x, 2 * x], op=fh.Sum)
    assert torch.allclose(outs[0], ref * SIZE) and torch.allclose(outs[1], 2 * ref * SIZE)
    zs = [x.clone(), x.clone()]
    fh.grouped_allreduce_(zs)
    assert all(torch.allclose(z, ref) for z in zs)
    with pytest.raises(ValueError):
        fh.allreduce(x, average=True, op=fh.Sum)
    if "horovod" in backends:
        rh = backends["horovod"]
        theirs = rh.grouped_allreduce([x, 2 * x], op=rh.Sum)
        assert all(torch.allclose(a, b) for a, b in zip(outs, theirs))


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_allreduce_with_compression(backends, compression):
    x = _data(torch.float32) / 7
    got = fh.allreduce(x, compression=getattr(fh.Compression, compression))
    assert got.dtype == torch.float32
    _same(got, _everyone(x).mean(0), torch.float32, tol=1e-2)
    if "horovod" in backends and compression == "fp16":
        rh = backends["horovod"]
        _same(got, rh.allreduce(x, compression=rh.Compression.fp16), torch.float32, tol=2e-3)


# -- allgather, broadcast, alltoall, reducescatter ---------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.float16, torch.uint8], ids=str)
def test_allgather_with_differing_first_dimensions(backends, dtype):
    x = _data(dtype, shape=(RANK + 1, 3))
    got = fh.allgather(x)
    ref = np.concatenate([_data(dtype, r, (r + 1, 3)).double().numpy() for r in range(SIZE)])
    _same(got, ref, dtype)
    if "horovod" in backends:
        _same(got, backends["horovod"].allgather(x), dtype)


def test_broadcast_forms(backends):
    x = _data(torch.float32)
    ref = _data(torch.float32, rank=1)
    got = fh.broadcast(x, root_rank=1)
    assert torch.equal(got, ref) and torch.equal(x, _data(torch.float32))
    y = x.clone()
    assert fh.broadcast_(y, 1) is y and torch.equal(y, ref)
    assert torch.equal(fh.synchronize(fh.broadcast_async(x, 1)), ref)
    with pytest.raises(ValueError):
        fh.broadcast(x, root_rank=SIZE)
    if "horovod" in backends:
        assert torch.equal(got, backends["horovod"].broadcast(x, root_rank=1))


def test_alltoall_with_and_without_splits(backends):
    x = torch.arange(SIZE * 2 * 3, dtype=torch.float32).reshape(SIZE * 2, 3) + 100 * RANK
    out = fh.alltoall(x)
    ref = np.concatenate([(torch.arange(SIZE * 6.).reshape(SIZE * 2, 3) + 100 * r)
                          [2 * RANK: 2 * RANK + 2].numpy() for r in range(SIZE)])
    _same(out, ref, torch.float32)
    splits = torch.tensor([(RANK + k) % 3 for k in range(SIZE)], dtype=torch.int32)
    y = torch.arange(int(splits.sum()) * 2, dtype=torch.int64).reshape(-1, 2) + 1000 * RANK
    got, received = fh.alltoall(y, splits=splits)
    assert received.tolist() == [(r + RANK) % 3 for r in range(SIZE)]
    if "horovod" in backends:
        rh = backends["horovod"]
        _same(out, rh.alltoall(x), torch.float32)
        theirs, their_received = rh.alltoall(y, splits=splits)
        assert torch.equal(got, theirs) and torch.equal(received, their_received)


@pytest.mark.parametrize("rows", [SIZE * 2, 10])
def test_reducescatter_uneven_rows(backends, rows):
    x = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) * (RANK + 1)
    counts = [rows // SIZE + (r < rows % SIZE) for r in range(SIZE)]
    lo = sum(counts[:RANK])
    total = _everyone(x).sum(0)[lo: lo + counts[RANK]]
    _same(fh.reducescatter(x, op=fh.Sum), total, torch.float32)
    _same(fh.reducescatter(x), total / SIZE, torch.float32)
    if "horovod" in backends:
        rh = backends["horovod"]
        _same(fh.reducescatter(x), rh.reducescatter(x), torch.float32)
        _same(fh.reducescatter(x, op=fh.Sum), rh.reducescatter(x, op=rh.Sum), torch.float32)


def test_barrier_and_join(backends):
    fh.barrier()
    last = fh.join()
    assert 0 <= last < SIZE and COMM.allgather(last) == [last] * SIZE


# -- gradients ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["allreduce", "allgather", "broadcast", "reducescatter",
                                  "alltoall"])
def test_collectives_are_differentiable_as_in_horovod(backends, what):
    grads = {}
    for name, hvd in backends.items():
        x = (_data(torch.float64, shape=(SIZE * 2, 3)) / 3).requires_grad_()
        call = {"allreduce": lambda t: hvd.allreduce(t, op=hvd.Average),
                "allgather": lambda t: hvd.allgather(t),
                "broadcast": lambda t: hvd.broadcast(t, root_rank=1),
                "reducescatter": lambda t: hvd.reducescatter(t),
                "alltoall": lambda t: hvd.alltoall(t)}[what]
        y = call(x)
        weights = torch.arange(y.numel(), dtype=torch.float64).reshape(y.shape) * (RANK + 1)
        (y * weights).sum().backward()
        grads[name] = x.grad
    assert grads["facade"] is not None and torch.isfinite(grads["facade"]).all()
    if "horovod" in grads:
        assert torch.allclose(grads["facade"], grads["horovod"]), (what, grads)


# -- helpers ----------------------------------------------------------------------------------------

def test_broadcast_parameters_optimizer_state_and_objects(backends):
    torch.manual_seed(RANK)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fh.broadcast_parameters(model.state_dict(), root_rank=0)
    for t in model.state_dict().values():
        assert all(np.array_equal(a, t.numpy()) for a in COMM.allgather(t.numpy()))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (RANK + 1))
    fh.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01
    assert len(opt.state) == 4 and all(
        np.array_equal(a, opt.state[model[0].weight]["exp_avg"].numpy())
        for a in COMM.allgather(opt.state[model[0].weight]["exp_avg"].numpy()))
    named = list(model.named_parameters())
    with torch.no_grad():
        named[0][1].add_(RANK)
    fh.broadcast_parameters(named, root_rank=2)
    assert np.array_equal(COMM.bcast(named[0][1].detach().numpy(), root=2),
                          named[0][1].detach().numpy())
    assert fh.broadcast_object({"r": RANK}, root_rank=3) == {"r": 3}
    assert fh.allgather_object(RANK * 2) == [2 * r for r in range(SIZE)]
    if "horovod" in backends:
        rh = backends["horovod"]
        assert rh.broadcast_object({"r": RANK}, root_rank=3) == {"r": 3}
        assert rh.allgather_object(RANK * 2) == fh.allgather_object(RANK * 2)


# -- DistributedOptimizer ----------------------------------------------------------------------------

def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _batch(step, rank=RANK):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def _train(hvd, steps=4, passes=1, **kwargs):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kwargs)
    for s in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = _batch(s * passes + k)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def _reference_train(steps=4, passes=1, op="average"):
    """The same training with the gradient average computed by hand from every rank's batches."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        grads = []
        for r in range(SIZE):
            model.zero_grad()
            for k in range(passes):
                x, y = _batch(s * passes + k, r)
                torch.nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            total = sum(g[i] for g in grads)
            p.grad = total / SIZE if op == "average" else total
        opt.step()
    return model


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_distributed_optimizer_is_the_users_class_and_trains_like_horovod(backends):
    model, opt = _train(fh)
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    assert "momentum_buffer" in opt.state[next(model.parameters())]
    ours = _flat(model)
    assert all(np.array_equal(a, ours.numpy()) for a in COMM.allgather(ours.numpy()))
    assert torch.allclose(ours, _flat(_reference_train()), atol=1e-5)
    if "horovod" in backends:
        theirs, _ = _train(backends["horovod"])
        assert torch.allclose(ours, _flat(theirs), atol=1e-5)


def test_powersgd_through_the_facade_is_the_front_doors_bitwise(backends):
    """``hvd.DistributedOptimizer(..., compress=hpcasync.PowerSGD(...))``: the front door's
    SSGD with PowerSGD (Horovod has none), the same parameters after 6 steps (2 uncompressed)."""
    import hpcasync

    def power():
        return hpcasync.PowerSGD(rank=1, start_iter=2, seed=3)

    model, opt = _train(fh, steps=6, compress=power())
    assert opt.algorithm == "ssgd" and opt.powersgd is not None
    ref = _net()
    ref_opt = hpcasync.optimizer("ssgd", ref, torch.optim.SGD(ref.parameters(), lr=0.1,
                                                                momentum=0.9), compress=power())
    for s in range(6):
        ref_opt.zero_grad()
        x, y = _batch(s)
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    ours = _flat(model)
    assert torch.equal(ours, _flat(ref))
    assert not torch.allclose(ours, _flat(_reference_train(steps=6)), atol=1e-6)  # compressed
    from hpcasync.errors import ConfigError

    with pytest.raises(ConfigError, match="does not take compression"):
        fh.DistributedOptimizer(torch.optim.SGD(_net().parameters(), lr=0.1),
                                compression=fh.Compression.fp16, compress=power())


def test_overlap_on_and_off_are_bitwise_equal():
    on, _ = _train(fh, overlap=True, bucket_bytes=64)
    off, _ = _train(fh, overlap=False, bucket_bytes=64)
    assert torch.equal(_flat(on), _flat(off))


@pytest.mark.parametrize("overlap", [False, True])
def test_backward_passes_per_step_and_sum(backends, overlap):
    model, _ = _train(fh, passes=2, overlap=overlap)
    assert torch.allclose(_flat(model), _flat(_reference_train(passes=2)), atol=1e-5)
    summed, _ = _train(fh, op=fh.Sum, overlap=overlap)
    assert torch.allclose(_flat(summed), _flat(_reference_train(op="sum")), atol=1e-4)
    if "horovod" in backends:
        rh = backends["horovod"]
        theirs, _ = _train(rh, passes=2)
        assert torch.allclose(_flat(model), _flat(theirs), atol=1e-5)


def test_fp16_compression_close_to_horovods(backends):
    model, _ = _train(fh, compression=fh.Compression.fp16)
    assert torch.allclose(_flat(model), _flat(_reference_train()), atol=2e-3)
    if "horovod" in backends:
        rh = backends["horovod"]
        theirs, _ = _train(rh, compression=rh.Compression.fp16)
        assert torch.allclose(_flat(model), _flat(theirs), atol=2e-3)


def test_synchronize_then_skip_synchronize_and_the_warning():
    model = _net()
    opt = fh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    x, y = _batch(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    with opt.skip_synchronize():
        opt.step()
    ours = _flat(model)
    assert all(np.array_equal(a, ours.numpy()) for a in COMM.allgather(ours.numpy()))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught)


@pytest.mark.parametrize("backend", ["facade", "horovod"])
def test_horovods_guards(backends, backend):
    if backend not in backends:
        need_horovod()
        pytest.skip("Horovod is not installed")
    hvd = backends[backend]
    model = _net()
    named = list(model.named_parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError):                              # duplicate names
        hvd.DistributedOptimizer(sgd, named_parameters=[("w", p) for _, p in named])
    with pytest.raises(ValueError):                              # a parameter not named
        hvd.DistributedOptimizer(sgd, named_parameters=named[:1])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=named)
    x, y = _batch(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError):                          # zero_grad before step
        opt.zero_grad()
    with pytest.raises(AssertionError):                          # a second backward
        torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()


@pytest.mark.parametrize("algorithm, kw", [
    ("localsgd", {"compression": fh.Compression.fp16}),
    ("daso", {"op": fh.Sum, "epochs": 1, "steps_per_epoch": 2}),
    ("slowmo", {"gradient_predivide_factor": 2.0}),
    ("diloco", {"groups": 2, "sparse_as_dense": True}),
])
def test_allreduce_arguments_beside_another_algorithm_are_one_line(algorithm, kw):
    """Horovod's arguments that shape SSGD's gradient allreduce, given with ``algorithm=`` (which
    reduces in its own way): a one-line error, not a run that ignored them (a fp16 compression
    beside local SGD trained uncompressed). Their defaults, and backward_passes_per_step, pass."""
    from hpcasync.errors import ConfigError

    fh.init()
    model = _net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    given = [k for k in kw if k not in ("epochs", "steps_per_epoch")]
    with pytest.raises(ConfigError, match=rf"DistributedOptimizer\({', '.join(given)}=\.\.\.\) "
                                          f"shapes SSGD's gradient allreduce; "
                                          f"algorithm='{algorithm}'"):
        fh.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                algorithm=algorithm, **kw)
    extra = {k: v for k, v in kw.items() if k in ("epochs", "steps_per_epoch")}
    fh.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), algorithm=algorithm,
                            compression=fh.Compression.none, op=fh.Average,
                            gradient_predivide_factor=1.0, backward_passes_per_step=2, **extra)


def test_elastic_has_horovods_names():
    """hvd.elastic is no longer refused (tests/mpi/reliability/test_horovod_elastic.py runs it)."""
    for name in ("run", "TorchState", "ObjectState", "ElasticSampler", "State"):
        assert callable(getattr(fh.elastic, name)), name


def test_bench_ssgd_times_the_facade(backends):
    """``hpcasync bench ssgd`` has the facade's column (the committed tables:
    experiments/results/horovod_facade.md); a tiny run, Horovod's pass left out here."""
    import argparse

    from hpcasync.bench.ssgd import add_arguments, format_table, measure

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--models", "mlp", "--steps", "2", "--warmup", "1",
                              "--no-horovod"])
    rows = measure(COMM, args)
    assert rows[0]["facade"] > 0 and rows[0]["bitwise"]
    table = format_table(rows)
    assert "facade ms" in table and ("DDP/facade" in table) == ("ddp" in rows[0])
