"""``op=hvd.Adasum`` (issue 22, item 3): the facade's allreduce and DistributedOptimizer against
real Horovod in the same processes when it imports, and always against a numpy reference of the
paper's formula (Maleki et al., MLSys 2021) over Horovod's tree. Run under ``mpiexec -n 2`` or
``-n 4`` (``-n 3``: both refuse a non-power-of-two size)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import hpcasync.horovod as fh
from hpcasync.horovod.adasum import is_power_of_two
from tests.mpi_util import COMM, RANK, SIZE, clean_env, idle_barrier

pytestmark = pytest.mark.timeout(120)
POW2 = is_power_of_two(SIZE)
need_pow2 = pytest.mark.skipif(not POW2, reason="Adasum needs a power-of-two number of ranks")
#: (rtol, atol) against the float64 reference: float32 rounds once per tree level, and Horovod sums
#: float32 products in double where the facade multiplies in double
TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (2e-6, 2e-6), torch.float16: (4e-3, 4e-3)}


def _ref_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The paper's combination, written out in float64 (Horovod: a coefficient is 1 when its
    vector's squared norm is below sqrt(DBL_MIN))."""
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    dot, aa, bb = a @ b, a @ a, b @ b
    tiny = np.sqrt(np.finfo(np.float64).tiny)
    ca = 1.0 - dot / (2.0 * aa) if aa >= tiny else 1.0
    cb = 1.0 - dot / (2.0 * bb) if bb >= tiny else 1.0
    return ca * a + cb * b


def _ref_tree(vectors: list[np.ndarray]) -> np.ndarray:
    """Horovod's tree: pairs (0, 1), (2, 3), ... then pairs of pairs."""
    level = [v.astype(np.float64).ravel() for v in vectors]
    while len(level) > 1:
        level = [_ref_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def _everyone(t: torch.Tensor) -> list[np.ndarray]:
    return COMM.allgather(t.detach().double().numpy())


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(1000 * seed + RANK)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


SHAPES = [(), (1,), (7,), (3, 5), (4, 3, 2), (1000,)]


@need_pow2
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_allreduce_adasum_matches_the_formula_and_horovod(backends, dtype):
    rtol, atol = TOL[dtype]
    for seed, shape in enumerate(SHAPES):
        x = _random(shape, dtype, seed)
        ref = _ref_tree(_everyone(x)).reshape(shape)
        for which, hvd in backends.items():
            y = hvd.allreduce(x, op=hvd.Adasum, name=f"ada.{which}.{seed}")
            assert y.dtype == dtype and tuple(y.shape) == shape
            assert np.allclose(y.double().numpy(), ref, rtol=rtol, atol=atol), (which, shape)
        mine = fh.allreduce(x, op=fh.Adasum)
        if "horovod" in backends:
            theirs = backends["horovod"].allreduce(x, op=backends["horovod"].Adasum)
            assert torch.allclose(mine, theirs, rtol=rtol, atol=atol), shape
        every = COMM.allgather(mine.numpy().tobytes())
        assert all(e == every[0] for e in every)           # the same bits on every rank


@need_pow2
def test_adasum_is_per_tensor_in_a_group_and_keeps_scales_and_edge_cases(backends):
    torch.manual_seed(0)
    g1 = _random((5,), torch.float64, 11)
    g2 = torch.tensor([1.0, -1.0], dtype=torch.float64) * (1 if RANK % 2 else -1)
    refs = [_ref_tree(_everyone(g1)), _ref_tree(_everyone(g2))]
    zero_here = torch.ones(3, dtype=torch.float64) * (RANK % 2)    # a zero vector on even ranks
    for hvd in backends.values():
        out = hvd.grouped_allreduce([g1, g2], op=hvd.Adasum, name="grp")
        for o, r in zip(out, refs):                     # each tensor its own dot product
            assert np.allclose(o.numpy(), r, rtol=1e-12, atol=1e-12)
        h = hvd.grouped_allreduce_async([g1.clone(), g2.clone()], op=hvd.Adasum, name="grp2")
        assert all(np.allclose(o.numpy(), r, rtol=1e-12, atol=1e-12)
                   for o, r in zip(hvd.synchronize(h), refs))
        y = hvd.allreduce(g1, op=hvd.Adasum, name="sc", prescale_factor=2.0, postscale_factor=3.0)
        assert np.allclose(y.numpy(), 6.0 * refs[0], rtol=1e-12, atol=1e-12)
        z = hvd.allreduce(zero_here, op=hvd.Adasum, name="z")
        assert np.allclose(z.numpy(), _ref_tree(_everyone(zero_here)), rtol=1e-12, atol=1e-12)
        t = torch.ones(4, dtype=torch.float64)
        hvd.allreduce_(t, op=hvd.Adasum, name="inplace")           # equal vectors: their mean
        assert torch.allclose(t, torch.ones(4, dtype=torch.float64))
        with pytest.raises(ValueError, match="supersedes"):
            hvd.allreduce(g1, average=False, op=hvd.Adasum)


@need_pow2
def test_adasum_float16_and_integers(backends):
    x = _random((9,), torch.float16, 5)
    ref = _ref_tree(_everyone(x))
    for which, hvd in backends.items():
        y = hvd.allreduce(x, op=hvd.Adasum, name=f"h.{which}")
        assert y.dtype == torch.float16
        assert np.allclose(y.double().numpy(), ref, rtol=4e-3, atol=4e-3), which
        with pytest.raises(hvd.HorovodInternalError, match="Unsupported data type"):
            hvd.allreduce(torch.arange(3, dtype=torch.int32), op=hvd.Adasum, name=f"i.{which}")
    y = fh.allreduce(x.bfloat16(), op=fh.Adasum)        # the facade's extra dtype
    assert np.allclose(y.double().numpy(), ref, rtol=3e-2, atol=3e-2)


@need_pow2
def test_adasum_is_differentiable_as_horovods():
    x = torch.ones(3, requires_grad=True)
    y = fh.allreduce(x * (RANK + 1), op=fh.Adasum)
    (g,) = torch.autograd.grad(y.sum(), x)
    # backward: the Adasum of the incoming gradients (all ones: their mean), times d(x·(r+1))/dx
    assert torch.allclose(g, torch.full((3,), float(RANK + 1)))


@pytest.mark.skipif(POW2, reason="the refusal needs a non-power-of-two size")
def test_non_power_of_two_is_refused_as_horovod_does(backends):
    for hvd in backends.values():
        with pytest.raises(NotImplementedError, match="non-power of 2 ranks"):
            hvd.allreduce(torch.ones(3), op=hvd.Adasum, name="np2")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match="non-power of 2 ranks"):
        fh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters(), op=fh.Adasum)
    fh.barrier()                 # the facade still works: nothing was sent


# -- DistributedOptimizer(op=hvd.Adasum) ----------------------------------------------------------

def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _batch(step):
    g = torch.Generator().manual_seed(100 * step + RANK)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _train(hvd, make_opt, steps=3, **kw):
    model = _model()
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(),
                                   op=hvd.Adasum, **kw)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _reference(make_opt, steps=3):
    """The Adasum optimizer by hand: each rank's local step, the deltas tree-combined in numpy."""
    model = _model()
    opt = make_opt(model)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        with torch.no_grad():
            for p, b in zip(model.parameters(), before):
                delta = _ref_tree(_everyone(p - b))
                p.copy_(b + torch.from_numpy(delta).reshape(p.shape).to(p.dtype))
    return [p.detach().clone() for p in model.parameters()]


OPTS = {"sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9,
                                                  weight_decay=1e-3),
        "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.05)}


@need_pow2
@pytest.mark.parametrize("kind", sorted(OPTS))
def test_distributed_optimizer_adasum_matches_horovod(backends, kind):
    mine = _train(fh, OPTS[kind])
    ref = _reference(OPTS[kind])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(mine, ref))
    if "horovod" in backends:
        theirs = _train(backends["horovod"], OPTS[kind])
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(mine, theirs))
    every = COMM.allgather([p.numpy().tobytes() for p in mine])
    assert all(e == every[0] for e in every)                   # replicas stay identical


@need_pow2
def test_adasum_optimizer_guards_are_horovods(backends):
    for hvd in backends.values():
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), op=hvd.Adasum)
        assert isinstance(opt, torch.optim.SGD)
        x, y = _batch(0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        with pytest.raises(AssertionError, match="Skipping synchronization is not supported"):
            with opt.skip_synchronize():
                pass
        if hvd is fh:   # (Horovod's hook has already started its allreduce: it must be stepped)
            with pytest.raises(AssertionError, match="before optimizer.step"):
                opt.zero_grad()
            with pytest.raises(AssertionError, match="backward_passes_per_step"):
                torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()                                   # a no-op, as Horovod's
        opt.step()
        opt.zero_grad()
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        fh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=fh.Adasum,
                                gradient_predivide_factor=2.0)


def test_one_rank_falls_back_to_the_plain_optimizer(tmp_path):
    """Horovod on one rank builds its plain DistributedOptimizer (an Adasum of one gradient is the
    gradient): the result equals torch alone. A one-process job, from rank 0."""
    if RANK == 0:
        script = tmp_path / "one.py"
        script.write_text(
            "import torch, hpcasync.horovod as hvd\n"
            "hvd.init()\n"
            "def run(dist):\n"
            "    torch.manual_seed(0); m = torch.nn.Linear(4, 2)\n"
            "    opt = torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9)\n"
            "    if dist:\n"
            "        opt = hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters(),"
            " op=hvd.Adasum)\n"
            "        assert not hasattr(opt, '_adasum_params')\n"
            "    for s in range(3):\n"
            "        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(s))\n"
            "        opt.zero_grad(); m(x).pow(2).sum().backward(); opt.step()\n"
            "    return [p.detach() for p in m.parameters()]\n"
            "assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))\n"
            "print('ONE-RANK-OK')\n")
        done = subprocess.run([sys.executable, str(script)], env=clean_env(), capture_output=True,
                              text=True, timeout=120)
        ok = "ONE-RANK-OK" in done.stdout
        detail = done.stdout[-2000:] + done.stderr[-2000:]
    else:
        ok, detail = True, ""
    idle_barrier()                      # the other ranks sleep meanwhile (2 cores)
    ok, detail = COMM.bcast((ok, detail), root=0)
    assert ok, detail
