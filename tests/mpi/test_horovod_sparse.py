"""Sparse gradients (issue 22, item 4): ``hvd.sparse_allreduce_async`` and a DistributedOptimizer
over an ``nn.Embedding(sparse=True)``, against real Horovod in the same processes when it imports
and always against torch in one process on the concatenated batch. Run under ``mpiexec -n 2``,
``-n 3`` or ``-n 4``."""
from __future__ import annotations

import pytest
import torch

import hpcasync.horovod as fh
from tests.mpi_util import COMM, RANK, SIZE

pytestmark = pytest.mark.timeout(120)
ROWS, DIM, BATCH = 12, 4, 6


def _indices(step: int, rank: int) -> torch.Tensor:
    """Each rank's lookups: repeated rows within a rank and across ranks."""
    g = torch.Generator().manual_seed(31 * step + rank)
    idx = torch.randint(0, ROWS // 2, (BATCH,), generator=g)
    idx[1] = idx[0]                             # a duplicate on every rank
    return idx


def _sparse(rank: int) -> torch.Tensor:
    i = torch.tensor([[0, 2, 2, rank + 3], [1, 0, 0, 1]])
    v = torch.tensor([1.0, 2.0, 3.0, 4.0]) * (rank + 1)
    return torch.sparse_coo_tensor(i, v, (8, 2), check_invariants=True)


def test_sparse_allreduce_async_is_horovods(backends):
    t = _sparse(RANK)
    dense_sum = sum(_sparse(r).to_dense() for r in range(SIZE))
    for which, hvd in backends.items():
        for op, scale in ((hvd.Average, SIZE), (hvd.Sum, 1)):
            handle = hvd.sparse_allreduce_async(t, name=f"sp.{which}.{op}", op=op)
            assert callable(handle)                          # Horovod's handle is a callable
            out = handle()
            assert out.is_sparse and not out.is_coalesced() and out.shape == t.shape
            assert out._nnz() == 4 * SIZE                    # every entry kept, duplicates too
            assert torch.allclose(out.to_dense(), dense_sum / scale)
    if "horovod" in backends:
        hh = backends["horovod"]
        mine = fh.sparse_allreduce_async(t, "cmp", fh.Average)()
        theirs = hh.sparse_allreduce_async(t, "cmp", hh.Average)()
        assert torch.equal(mine._indices(), theirs._indices())      # the same order: by rank
        assert torch.equal(mine._values(), theirs._values())
    for hvd in backends.values():            # allreduce itself takes dense tensors only
        with pytest.raises(ValueError, match="is not supported"):
            hvd.allreduce(t, name="dense-only")
    empty = torch.sparse_coo_tensor(torch.empty(2, 0, dtype=torch.long), torch.empty(0), (8, 2),
                                    check_invariants=True)
    out = fh.sparse_allreduce_async(t if RANK == 0 else empty, "some-empty", fh.Sum)()
    assert torch.allclose(out.to_dense(), _sparse(0).to_dense())


# -- DistributedOptimizer --------------------------------------------------------------------------

class Net(torch.nn.Module):
    """A sparse embedding and a dense head: both paths of the optimizer at once."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx))).squeeze(-1)


def _loss(model, step, ranks):
    idx = torch.cat([_indices(step, r) for r in ranks])
    target = torch.cat([torch.linspace(-1, 1, BATCH) * (r + 1) / SIZE for r in ranks])
    return (model(idx) - target).pow(2).mean()


def _adam(model):          # SparseAdam for the embedding, as torch requires; Adam for the head
    return (torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.1),
            torch.optim.Adam(model.head.parameters(), lr=0.1))


def _train_distributed(hvd, steps=3, **kw):
    model = Net()
    sparse_opt, dense_opt = _adam(model)
    named = list(model.named_parameters())
    sparse_opt = hvd.DistributedOptimizer(sparse_opt, named_parameters=named[:1], **kw)
    dense_opt = hvd.DistributedOptimizer(dense_opt, named_parameters=named[1:])
    hvd.broadcast_optimizer_state(sparse_opt, root_rank=0, model=model)
    for step in range(steps):
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        _loss(model, step, [RANK]).backward()
        sparse_opt.step()
        dense_opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train_alone(steps=3, drop_zeros=False):
    """torch in one process on every rank's batch at once (the mean loss over SIZE·BATCH rows has
    the gradient the ranks average)."""
    model = Net()
    sparse_opt, dense_opt = _adam(model)
    model.emb.weight.grad = torch.zeros_like(model.emb.weight).to_sparse()
    sparse_opt.step()           # broadcast_optimizer_state's state-making step (Horovod's)
    for step in range(steps):
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        _loss(model, step, range(SIZE)).backward()
        if drop_zeros:           # sparse_as_dense: Horovod's to_sparse() keeps nonzero elements
            model.emb.weight.grad = model.emb.weight.grad.to_dense().to_sparse()
        sparse_opt.step()
        dense_opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("as_dense", [False, True], ids=["sparse", "sparse_as_dense"])
def test_sparse_embedding_with_sparse_adam(backends, as_dense):
    mine = _train_distributed(fh, sparse_as_dense=as_dense)
    alone = _train_alone(drop_zeros=as_dense)
    for a, b in zip(mine, alone):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    if "horovod" in backends:
        theirs = _train_distributed(backends["horovod"], sparse_as_dense=as_dense)
        for a, b in zip(mine, theirs):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    every = COMM.allgather([p.numpy().tobytes() for p in mine])
    assert all(e == every[0] for e in every)


def test_sparse_grad_reaches_the_optimizer_sparse_and_sgd_works(backends):
    model = Net()
    opt = fh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                  named_parameters=model.named_parameters())
    ref = Net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        _loss(model, step, [RANK]).backward()
        opt.synchronize()
        g = model.emb.weight.grad
        assert g.is_sparse and g._nnz() == SIZE * BATCH          # allgathered, uncoalesced
        assert not model.head.weight.grad.is_sparse
        with opt.skip_synchronize():
            opt.step()
        _loss(ref, step, range(SIZE)).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    opt.zero_grad()
    assert not model.emb.weight.grad.is_sparse           # the flat buffer's slot again
