"""Sparse gradients: ``hvd.sparse_allreduce_async`` and the sparse parameters of a
``DistributedOptimizer`` (an ``nn.Embedding(sparse=True)``), as Horovod reduces them.

A sparse COO tensor is "allreduced" by allgathering its indices and its values (Horovod's way:
duplicates are kept, so the result is uncoalesced — ``coalesce()`` sums them — and with
``op=Average`` the values are divided by the number of ranks)::

    handle = hvd.sparse_allreduce_async(grad, name="emb.weight", op=hvd.Average)
    total = handle()                 # Horovod's handle is a callable, not an integer

In ``DistributedOptimizer`` a parameter whose gradient arrives sparse (seen by a hook that runs
before autograd accumulates it) is reduced that way in ``synchronize()``, after the dense buckets:
its sparse gradient goes to the allgathers, not into the flat gradient buffer (its slot there
stays zero), and ``p.grad`` becomes the reduced sparse tensor, so ``torch.optim.SparseAdam`` (or
SGD) sees a sparse gradient as it would without Horovod. With ``sparse_as_dense=True`` the sparse
gradient is added into its dense slot instead (densified before the allreduce, as Horovod), the
slot is reduced with the others, and ``p.grad`` becomes the reduced slot made sparse again
(``Tensor.to_sparse()``, Horovod's conversion: elementwise indices, exact zeros dropped).

Differences from Horovod: a parameter seen sparse once is reduced sparse at every later step (a
step where it got no gradient sends zero rows), so ranks stay in step where Horovod would submit a
dense allreduce against the others' allgathers; the sparse reductions run in parameter order after
the dense buckets, not as their hooks fire; ``zero_grad()`` drops the reduced sparse gradient
(``p.grad`` is the dense slot again).
"""
from __future__ import annotations

import torch

from .collectives import Average, Sum, _comm, allgather_async, synchronize


def sparse_allreduce_async(tensor, name, op, process_set=None):
    """Start the reduction of sparse COO ``tensor``: allgathers of its indices (named
    ``f"{name}.indices"``) and values (``f"{name}.values"``). Returns a callable that waits and
    gives the result: every rank's entries concatenated in rank order (uncoalesced), values divided
    by the number of ranks when ``op`` is Average (Horovod's ``sparse_allreduce_async``)."""
    n = _comm(process_set).Get_size()
    indices = allgather_async(tensor._indices().transpose(0, 1).contiguous(),
                              name=f"{name}.indices", process_set=process_set)
    values = allgather_async(tensor._values(), name=f"{name}.values", process_set=process_set)

    def handle():
        v = synchronize(values)
        i = synchronize(indices)
        if op == Average:
            v = v / n
        return torch.sparse_coo_tensor(i.transpose(0, 1), v, tensor.size(),
                                       device=tensor.device, check_invariants=False)
    return handle


def sparse_params(optimizer, model=None) -> set:
    """Ids of the parameters whose gradients are sparse, as Horovod's
    ``broadcast_optimizer_state`` tells them: every parameter of a ``torch.optim.SparseAdam``;
    with ``torch.optim.SGD``, the weights of ``model``'s ``nn.Embedding(sparse=True)``."""
    if isinstance(optimizer, torch.optim.SparseAdam):
        return {id(p) for g in optimizer.param_groups for p in g["params"]}
    if isinstance(optimizer, torch.optim.SGD) and model is not None:
        return {id(p) for m in model.modules()
                if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    return set()


class SparseGrads:
    """The sparse gradients of one DistributedOptimizer's parameters (module doc).

    Args:
        params: the optimizer's parameters in flat order; names: their names;
        as_dense: Horovod's ``sparse_as_dense``; average: divide by the number of ranks.
    """

    def __init__(self, params, names, *, as_dense: bool, average: bool, process_set=None):
        self.params, self.names = list(params), list(names)
        self.as_dense, self.average, self.process_set = bool(as_dense), average, process_set
        self.seen: dict[int, tuple] = {}        # param index -> (sparse_dim, dense shape)
        self.local: dict[int, torch.Tensor] = {}  # this step's sparse gradients (not as_dense)
        self.hooks = [p.register_hook(self._hook(k)) for k, p in enumerate(self.params)
                      if p.requires_grad]

    def _hook(self, k: int):
        def hook(grad):
            if not grad.is_sparse:
                return None
            if k not in self.seen:
                self.seen = dict(sorted({**self.seen, k: _layout(grad)}.items()))
            if self.as_dense:
                return None                     # accumulates into the dense slot
            prev = self.local.get(k)
            self.local[k] = grad if prev is None else prev + grad
            return _empty(grad)                 # nothing for the dense slot
        return hook

    def finish(self) -> None:
        """After the dense buckets: reduce each sparse parameter, set its ``p.grad``."""
        if not self.seen:
            return
        if self.as_dense:
            for k in self.seen:
                p = self.params[k]
                p.grad = p.grad.to_sparse()
            return
        op = Average if self.average else Sum
        handles = []
        for k, layout in self.seen.items():
            p = self.params[k]
            local = self.local.pop(k, None)
            if local is None:
                local = _empty_like(p, layout)
            handles.append((p, sparse_allreduce_async(local, self.names[k], op,
                                                      self.process_set)))
        for p, handle in handles:
            p.grad = handle()

    def release(self) -> None:
        """``zero_grad()``: drop the reduced sparse gradients (the flat buffer rebinds its slots)
        and anything accumulated since."""
        self.local.clear()
        for k in self.seen:
            g = self.params[k].grad
            if g is not None and g.is_sparse:
                self.params[k].grad = None

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


def _layout(grad: torch.Tensor) -> tuple:
    return grad.sparse_dim(), tuple(grad.shape[grad.sparse_dim():])


def _empty(grad: torch.Tensor) -> torch.Tensor:
    sd = grad.sparse_dim()
    return torch.sparse_coo_tensor(
        torch.empty((sd, 0), dtype=torch.long, device=grad.device),
        torch.empty((0, *grad.shape[sd:]), dtype=grad.dtype, device=grad.device), grad.shape,
        check_invariants=False)


def _empty_like(p: torch.Tensor, layout: tuple) -> torch.Tensor:
    sd, dense = layout
    return torch.sparse_coo_tensor(
        torch.empty((sd, 0), dtype=torch.long, device=p.device),
        torch.empty((0, *dense), dtype=p.dtype, device=p.device), p.shape,
        check_invariants=False)
