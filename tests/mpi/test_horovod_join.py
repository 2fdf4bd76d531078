"""``hvd.join()`` with Horovod's semantics: ranks hold different numbers of batches; a rank out
of data joins and contributes zeros to the others' allreduces (Average still divides by size()),
join() returns the last rank to join. Against real Horovod when it imports, else the formula.
Run under ``mpiexec -n 2`` or ``-n 3``."""
from __future__ import annotations

import pytest
import torch

import hpcasync.horovod as fh
from tests.mpi_util import COMM, HOROVOD_ERROR, RANK, SIZE

pytestmark = pytest.mark.timeout(60)




def _uneven(hvd):
    """Rank r allreduces r+1 times (named per round), then joins."""
    outs = []
    for k in range(RANK + 1):
        x = torch.full((3,), float(RANK + 1)) * (k + 1)
        outs.append((hvd.allreduce(x, name=f"u{k}"),
                     hvd.allreduce(x, name=f"s{k}", op=hvd.Sum),
                     hvd.allreduce(torch.tensor([3 * (RANK + 1), 5]).int(), name=f"i{k}")))
    last = hvd.join()
    return outs, last


def _formula(k):
    """Round k: ranks r >= k contribute (r+1)(k+1), the joined ones zero."""
    live = [r for r in range(SIZE) if r >= k]
    s = sum((r + 1) * (k + 1) for r in live)
    ints = torch.tensor([sum(3 * (r + 1) for r in live), 5 * len(live)])
    return s / SIZE, s, (ints.double() / SIZE).to(torch.int32)


def test_uneven_allreduces_then_join(backends):
    for name, hvd in backends.items():
        outs, last = _uneven(hvd)
        assert last == SIZE - 1, (name, last)                 # the last rank to join
        for k, (avg, tot, ints) in enumerate(outs):
            favg, fsum, fint = _formula(k)
            assert torch.allclose(avg, torch.full((3,), favg)), (name, k, avg, favg)
            assert torch.equal(tot, torch.full((3,), float(fsum))), (name, k, tot)
            assert torch.equal(ints, fint), (name, k, ints, fint)
    if "horovod" in backends:                                  # bitwise the same as Horovod
        ours, _ = _uneven(fh)
        theirs, _ = _uneven(backends["horovod"])
        for a, b in zip(ours, theirs):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    # everyone joined: the facade works as before
    assert torch.equal(fh.allreduce(torch.ones(2), op=fh.Sum), torch.full((2,), float(SIZE)))


@pytest.mark.parametrize("what", ["allgather", "broadcast", "alltoall", "reducescatter"])
def test_other_collectives_after_a_join_raise_horovods_error(backends, what):
    calls = {"allgather": lambda h: h.allgather(torch.ones(2, 2), name="j"),
             "broadcast": lambda h: h.broadcast(torch.ones(2), 0, name="j"),
             "alltoall": lambda h: h.alltoall(torch.ones(2 * SIZE), name="j"),
             "reducescatter": lambda h: h.reducescatter(torch.ones(2 * SIZE), name="j")}
    for name, hvd in backends.items():
        if RANK == SIZE - 1:                   # out of data first
            assert hvd.join() in range(SIZE - 1)
            continue
        with pytest.raises(RuntimeError, match="is not supported with Join at this time") as e:
            calls[what](hvd)
        assert type(e.value).__name__ == "HorovodInternalError"
        assert hvd.join() in range(SIZE - 1)


def _train(hvd, batches: int, overlap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kw = {} if hvd is not fh else {"overlap": overlap}
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kw)
    g = torch.Generator().manual_seed(100 + RANK)
    for _ in range(batches):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    last = hvd.join()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), last


def _reference(batches_of):
    """Plain torch: the mean gradient over ranks still holding data, times (live ranks / size)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gens = [torch.Generator().manual_seed(100 + r) for r in range(SIZE)]
    for step in range(max(batches_of)):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(SIZE):
            if step >= batches_of[r]:
                continue
            x = torch.randn(8, 4, generator=gens[r])
            y = torch.randint(0, 2, (8,), generator=gens[r])
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            for a, p in zip(grads, model.parameters()):
                a += p.grad
        for a, p in zip(grads, model.parameters()):
            p.grad = a / SIZE
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("overlap", [False, True])
def test_distributed_optimizer_with_uneven_batches_and_join(backends, overlap):
    batches_of = [2 + r for r in range(SIZE)]          # rank r has 2 + r batches
    mine, last = _train(fh, batches_of[RANK], overlap)
    assert last == SIZE - 1
    if RANK == SIZE - 1:                               # trained every step: the reference
        ref = _reference(batches_of)
        assert torch.allclose(mine, ref, atol=1e-6), (mine - ref).abs().max()
    if "horovod" in backends and not overlap:
        theirs, hlast = _train(backends["horovod"], batches_of[RANK], None)
        assert hlast == last
        assert torch.allclose(mine, theirs, atol=1e-6), (mine - theirs).abs().max()
    COMM.Barrier()
