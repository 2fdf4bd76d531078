"""Issue 22, the last facade gaps: ``hvd.SyncBatchNorm`` against torch's BatchNorm on the
concatenated batch (Horovod's own needs CUDA: its module refuses CPU input and the torch kernels
it calls are CUDA-only), and ``DistributedOptimizer`` with a custom compressor or with float64,
float16, bfloat16 and mixed parameters against real Horovod in the same processes when it imports
(its CPU build refuses bfloat16) and against the formula always. Run under ``mpiexec -n 2..4``."""
from __future__ import annotations

import pytest
import torch

import hpcasync.horovod as fh
from tests.mpi_util import COMM, RANK, SIZE

pytestmark = pytest.mark.timeout(60)
C = 3


def _batches(seed: int):
    """Every rank's batch (sizes 3, 1, 0, 4, ...: uneven, one empty), the same on all ranks."""
    g = torch.Generator().manual_seed(seed)
    sizes = [(3, 1, 0, 4)[r % 4] for r in range(SIZE)]
    xs = [torch.randn(n, C, 5, generator=g) * 3 + 1 for n in sizes]
    ws = [torch.randn(n, C, 5, generator=g) for n in sizes]          # loss weights
    return xs, ws


@pytest.mark.parametrize("momentum", [0.1, None])
def test_sync_batch_norm_is_batch_norm_on_the_concatenated_batch(backends, momentum):
    torch.manual_seed(0)
    mine, ref = fh.SyncBatchNorm(C, momentum=momentum), torch.nn.BatchNorm1d(C, momentum=momentum)
    with torch.no_grad():
        mine.weight.copy_(torch.randn(C)), mine.bias.copy_(torch.randn(C))
    ref.load_state_dict(mine.state_dict())
    for step in range(2):                        # running statistics over two updates
        xs, ws = _batches(step)
        x = xs[RANK].clone().requires_grad_()
        mine.zero_grad(), ref.zero_grad()
        y = mine(x)
        (y * ws[RANK]).sum().backward()
        xall = torch.cat(xs).requires_grad_()
        yall = ref(xall)
        (yall * torch.cat(ws)).sum().backward()
        lo = sum(len(t) for t in xs[:RANK])
        rows = slice(lo, lo + len(xs[RANK]))
        assert torch.allclose(y, yall[rows], rtol=0, atol=2e-6)
        assert torch.allclose(x.grad, xall.grad[rows], rtol=0, atol=2e-6)
        for p, q in ((mine.weight, ref.weight), (mine.bias, ref.bias)):  # this rank's part
            total = torch.from_numpy(COMM.allreduce(p.grad.numpy()))
            assert torch.allclose(total, q.grad, rtol=1e-6, atol=1e-5)
        assert torch.allclose(mine.running_mean, ref.running_mean, rtol=0, atol=1e-6)
        assert torch.allclose(mine.running_var, ref.running_var, rtol=1e-6, atol=1e-6)
        assert int(mine.num_batches_tracked) == int(ref.num_batches_tracked) == step + 1
    mine.eval(), ref.eval()                      # eval: the running statistics, locally
    x = _batches(5)[0][0]
    assert torch.allclose(mine(x), ref(x), rtol=0, atol=1e-6)


def test_sync_batch_norm_needs_two_values_over_all_ranks(backends):
    bn = fh.SyncBatchNorm(C)
    x = torch.randn(1 if RANK == 0 else 0, C)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(x)


class ShiftCompressor(fh.Compressor):
    """Not linear: a compressor applied after the sum, or once, gives another result."""
    calls = 0

    @staticmethod
    def compress(tensor):
        ShiftCompressor.calls += 1
        return tensor * 2 + 1, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return ((tensor - 1) / 2).to(ctx)


class HalfCompressor(fh.Compressor):
    """Compression.fp16 written as a user's class."""

    @staticmethod
    def compress(tensor):
        return tensor.half(), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


class _ToDouble(torch.nn.Module):
    def forward(self, x):
        return x.double()


def _model(dtype=torch.float32, mixed=False):
    """Two linear layers; ``mixed``: the first float32, the second float64."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3),
                                _ToDouble() if mixed else torch.nn.Identity(),
                                torch.nn.Linear(3, 2))
    return model[2].double() and model if mixed else model.to(dtype)


def _steps(hvd, model, steps=2, integer=False, **kw):
    """Two SGD steps on rank-dependent data; the gradients of the last one and the parameters."""
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.5),
                                   named_parameters=model.named_parameters(), **kw)
    g = torch.Generator().manual_seed(11 + RANK)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(5, 4, generator=g)
        if integer:
            x = x.round()
        out = model(x.to(next(model.parameters()).dtype))
        (out.to(torch.float64) * torch.arange(out.numel()).view(out.shape)).sum().backward()
        opt.synchronize()
        grads = [p.grad.clone() for p in model.parameters()]
        with opt.skip_synchronize():
            opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def _local(model, integer=False, steps=1):
    """This rank's gradients of the first step, without any reduction."""
    g = torch.Generator().manual_seed(11 + RANK)
    x = torch.randn(5, 4, generator=g)
    if integer:
        x = x.round()
    out = model(x.to(next(model.parameters()).dtype))
    (out.to(torch.float64) * torch.arange(out.numel()).view(out.shape)).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _integer_model(dtype=torch.float32):
    """Integer weights: with integer inputs every gradient is an integer, every sum exact."""
    model = _model(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.arange(p.numel()).view(p.shape) % 3 - 1)
    return model


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_custom_compressor_is_applied_to_each_tensor_on_each_rank(backends, op):
    every = COMM.allgather(_local(_integer_model(), integer=True))
    ShiftCompressor.calls = 0
    mine, _ = _steps(fh, _integer_model(), steps=1, integer=True, compression=ShiftCompressor,
                     op=getattr(fh, op))
    assert ShiftCompressor.calls == 4                  # once per parameter
    for k, g in enumerate(mine):                       # decompress(Σ compress(g_r) [/ n])
        wire = sum(e[k] * 2 + 1 for e in every)
        want = ((wire / SIZE if op == "Average" else wire) - 1) / 2
        assert torch.equal(g, want)
    if "horovod" in backends:
        rh = backends["horovod"]
        theirs, _ = _steps(rh, _integer_model(), steps=1, integer=True,
                           compression=ShiftCompressor, op=getattr(rh, op))
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


def test_a_users_fp16_compressor_trains_as_horovods(backends):
    # f = 3: the prescale 1/f and postscale f/size round in float16 on the wire, as Horovod's
    mine = _steps(fh, _model(), compression=HalfCompressor, gradient_predivide_factor=3.0)
    builtin = _steps(fh, _model(), compression=fh.Compression.fp16)
    for a, b in zip(mine[0], builtin[0]):
        assert torch.allclose(a, b, rtol=0, atol=4e-3 * _big(b))
    if "horovod" in backends:
        theirs = _steps(backends["horovod"], _model(), compression=HalfCompressor,
                        gradient_predivide_factor=3.0)
        assert all(torch.equal(a, b) for a, b in zip(mine[0] + mine[1], theirs[0] + theirs[1]))


_ULPS = {torch.float16: 2e-3, torch.float32: 1e-6, torch.float64: 1e-14}   # relative to max|x|


def _big(t: torch.Tensor) -> float:
    return float(t.double().abs().max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, "mixed"])
def test_other_dtypes_are_reduced_in_their_own_dtype_as_horovod(backends, dtype):
    mixed = dtype == "mixed"
    make = (lambda: _model(mixed=True)) if mixed else (lambda: _model(dtype))
    every = COMM.allgather(_local(make()))
    mine = _steps(fh, make(), steps=1)
    for k, g in enumerate(mine[0]):
        assert g.dtype == list(make().parameters())[k].dtype
        want = sum(e[k].double() for e in every) / SIZE
        assert torch.allclose(g.double(), want, rtol=0, atol=_ULPS[g.dtype] * _big(want))
    if "horovod" in backends:
        theirs = _steps(backends["horovod"], make(), steps=1)
        for a, b in zip(mine[0] + mine[1], theirs[0] + theirs[1]):
            assert a.dtype == b.dtype
            assert torch.allclose(a.double(), b.double(), rtol=0, atol=_ULPS[a.dtype] * _big(b))
    if "horovod" in backends and dtype == torch.float64:      # exact sums: bit for bit
        exact = [_steps(hvd, _integer_model(torch.float64), integer=True)
                 for hvd in (fh, backends["horovod"])]
        assert all(torch.equal(a, b) for a, b in zip(exact[0][0] + exact[0][1],
                                                     exact[1][0] + exact[1][1]))


def test_bfloat16_parameters_are_summed_in_bfloat16(backends):
    # Horovod's CPU build refuses bfloat16 tensors: against the formula only (integer data, so
    # each bfloat16 sum is exact and the average a division by a power of two or one rounding)
    every = COMM.allgather(_local(_integer_model(torch.bfloat16), integer=True))
    grads, params = _steps(fh, _integer_model(torch.bfloat16), steps=1, integer=True)
    for k, g in enumerate(grads):
        assert g.dtype == torch.bfloat16
        want = (sum(e[k].float() for e in every) / SIZE).bfloat16()
        assert torch.equal(g, want)


def test_a_joined_rank_sends_zeros_to_the_per_tensor_path(backends):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1).double()
    opt = fh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                  named_parameters=model.named_parameters(), op=fh.Sum)
    for step in range(1 if RANK == SIZE - 1 else 2):         # the last rank joins early
        opt.zero_grad()
        model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
        opt.step()
        assert float(model.bias.grad) == (SIZE if step == 0 else SIZE - 1)
    assert fh.join() in range(SIZE)
