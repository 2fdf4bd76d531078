"""``hvd.SyncBatchNorm``: batch normalisation whose training statistics cover every rank's batch.

In training, each channel's mean and variance are those of the whole global batch (the ranks'
batches may differ in size, empty ones included); the gradients flow through them; the running
statistics are updated with the global mean and the unbiased global variance (global count), as
torch's ``BatchNorm`` on the concatenated batch would. In eval mode the running statistics are
used, locally. On one rank it is plain batch norm::

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), hvd.SyncBatchNorm(8), torch.nn.ReLU())

Differences from Horovod's (``horovod/torch/sync_batch_norm.py``): it runs on the CPU (Horovod's
refuses CPU input, and torch's ``batch_norm_stats`` kernels it calls are CUDA-only); the statistics
are computed in float64 and exchanged in one allgather (count, mean, sum of squared deviations per
rank, combined by Chan et al.'s pairwise formula) and one allreduce in backward; ``momentum=None``
is torch's cumulative average (Horovod passes None to a kernel that needs a number). As in
Horovod, the weight and bias gradients are this rank's part (``DistributedOptimizer`` reduces them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .basics import size
from .collectives import Sum, allgather_async, allreduce_async, synchronize


class SyncBatchNorm(_BatchNorm):
    """Horovod's ``SyncBatchNorm(num_features, eps, momentum, affine, track_running_stats)``
    (module doc); input ``(N, C, ...)`` with at least 2 dimensions."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:             # torch's cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        if size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, True, factor, self.eps)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, self.running_mean,
                                      self.running_var, self.eps, factor)


def _shape(x: torch.Tensor) -> list[int]:
    """Broadcast shape of a per-channel vector against ``x``."""
    return [1, x.size(1)] + [1] * (x.dim() - 2)


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        x = x.contiguous()
        c, dims = x.size(1), [0] + list(range(2, x.dim()))
        n = x.numel() // c if c else 0
        x64 = x.to(torch.float64)
        mine = torch.zeros(1, 2 * c + 1, dtype=torch.float64)
        if n:
            mean = x64.mean(dims)
            mine[0, 0] = n
            mine[0, 1:c + 1] = mean
            mine[0, c + 1:] = (x64 - mean.view(_shape(x))).square().sum(dims)
        every = synchronize(allgather_async(mine, name="sync_batch_norm.stats"))
        counts, means, m2s = every[:, :1], every[:, 1:c + 1], every[:, c + 1:]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got "
                             f"{int(total)} over all ranks (SyncBatchNorm)")
        mean = (counts * means).sum(0) / total                      # Chan et al.: combine
        m2 = (m2s + counts * (means - mean).square()).sum(0)
        var = m2 / total
        invstd = (var + eps).rsqrt()
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((m2 / (total - 1)).to(running_var.dtype),
                                                    alpha=momentum)
        scale = invstd if weight is None else invstd * weight.detach().to(torch.float64)
        y = (x64 - mean.view(_shape(x))) * scale.view(_shape(x))
        if bias is not None:
            y = y + bias.detach().to(torch.float64).view(_shape(x))
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = total
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dims, shape = [0] + list(range(2, x.dim())), _shape(x)
        dy64, xmu = dy.contiguous().to(torch.float64), x.to(torch.float64) - mean.view(shape)
        sum_dy, sum_dy_xmu = dy64.sum(dims), (dy64 * xmu).sum(dims)
        grad_x = grad_w = grad_b = None
        if weight is not None and need_w:                  # this rank's part, as Horovod
            grad_w = (sum_dy_xmu * invstd).to(weight.dtype)
        if weight is not None and need_b:
            grad_b = sum_dy.to(weight.dtype)
        if need_x:
            both = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_xmu]), op=Sum,
                                               name="sync_batch_norm.sum_dy"))
            c, total = x.size(1), ctx.total
            mean_dy, mean_dy_xmu = both[:c] / total, both[c:] / total
            scale = invstd if weight is None else invstd * weight.detach().to(torch.float64)
            grad_x = ((dy64 - mean_dy.view(shape) - xmu * (invstd.square() *
                                                           mean_dy_xmu).view(shape))
                      * scale.view(shape)).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None
