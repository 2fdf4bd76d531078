"""A ``DistributedOptimizer``'s gradients reduced tensor by tensor, as Horovod's optimizer does:
the path for a custom compressor, parameters other than float32, or parameters on several devices
(the flat float32 buffer serves the rest).

Each gradient is compressed (``compression.compress(p.grad)``), the wires go in one
``grouped_allreduce_async_`` (one agreement, one MPI allreduce per tensor in its own dtype; with
``op=Average`` and ``gradient_predivide_factor`` f, prescale 1/f and postscale f, Horovod's
split), and each result is decompressed into ``p.grad`` (``p.grad.set_(...)``, as Horovod).
A trained parameter without a gradient sends zeros (Horovod's rule)::

    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.double().parameters(), lr=0.1),
                                   compression=MyCompressor)     # -> PerTensorReducer
"""
from __future__ import annotations

import torch

from .collectives import Average, grouped_allreduce_async_, synchronize


class PerTensorReducer:
    """Reduces ``params``' gradients in :meth:`finish` (module doc). ``overlap`` is off: the
    reduction runs in ``synchronize()``."""

    overlap = False

    def __init__(self, params, *, compression, op, predivide: float, name: str,
                 process_set=None, sparse=None):
        self.params = list(params)            # the optimizer's order (the sparse path's too)
        self.compression, self.op, self.name = compression, op, name
        self.process_set, self.sparse = process_set, sparse
        average = op == Average
        self.factors = (1.0 / predivide, predivide) if average else (1.0, 1.0)

    def finish(self) -> None:
        seen = self.sparse.seen if self.sparse is not None else {}
        as_dense = self.sparse is not None and self.sparse.as_dense
        dense = []
        for k, p in enumerate(self.params):
            if not p.requires_grad or (k in seen and not as_dense):
                continue                          # reduced by the sparse path (.sparse)
            if p.grad is None:                    # another rank may have one: send zeros
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:                # sparse_as_dense
                p.grad = p.grad.to_dense()
            dense.append(p)
        if not dense:
            return
        wires, ctxs = zip(*[self.compression.compress(p.grad) for p in dense])
        pre, post = self.factors
        outs = synchronize(grouped_allreduce_async_(list(wires), name=self.name, op=self.op,
                                                    prescale_factor=pre, postscale_factor=post,
                                                    process_set=self.process_set))
        with torch.no_grad():
            for p, out, ctx in zip(dense, outs, ctxs):
                p.grad.set_(self.compression.decompress(out, ctx))

    def discard(self) -> None:
        """Nothing is in flight between steps."""
