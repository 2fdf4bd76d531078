"""DASO's merge of a stale global sum into the local parameters (pure tensor math, no MPI).

Global group j (the rank with local index j on each of the P nodes) sent its parameters (and float
buffers) x_p at batch s and summed them: S = Σ_p x_p(s), this rank's own stale copy included. B
batches later each member has trained on to x_local and merges

    x ← (2B · x_local + S) / (2B + P)

i.e. a weighted average in which the fresh local copy weighs 2B and each stale copy (own one
included) weighs 1: the longer the message travelled, the more the local model is trusted
(Coquelin et al., "Accelerating neural network training with distributed asynchronous and
selective optimization (DASO)", arXiv 2104.05588, and Heat's ``DASO``). With B = 0 there is no local
progress to protect and the rule becomes the plain average S/P (DASO's blocking average).

Example::

    merge_(flat_state, received_sum, batches_to_wait=1, num_nodes=2)   # in place

Parameters torch would leave untouched (``requires_grad=False``, in no param group, or in a group
whose lr is 0 when the message was sent) are kept out of the merge (``keep``: their ranges of the
flat vector): the bf16 wire and the weights would otherwise round values that never changed.

Differences from Heat: the formula lives here once (Heat inlines it four times) and applies to the
float buffers too (BatchNorm running statistics), not only to the parameters.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:          # annotations only: the module imports no torch (hpcasync.daso's options)
    import torch


def merge_weights(*, batches_to_wait: int, num_nodes: int) -> tuple[float, float]:
    """(weight of x_local, weight of S) = (2B/(2B+P), 1/(2B+P))."""
    if batches_to_wait < 1:
        raise ConfigError(f"DASO batches_to_wait must be >= 1 to merge, got {batches_to_wait}")
    if num_nodes < 1:
        raise ConfigError(f"DASO merge needs >= 1 node, got {num_nodes}")
    denom = 2.0 * batches_to_wait + num_nodes
    return 2.0 * batches_to_wait / denom, 1.0 / denom


def merge(local: torch.Tensor, received_sum: torch.Tensor, *, batches_to_wait: int,
          num_nodes: int) -> torch.Tensor:
    """(2B·local + S) / (2B + P) as a new tensor (the reference form)."""
    if local.shape != received_sum.shape:
        raise ConfigError(f"DASO merge: local {tuple(local.shape)} and received "
                          f"{tuple(received_sum.shape)} differ in shape")
    two_b = 2.0 * batches_to_wait
    merge_weights(batches_to_wait=batches_to_wait, num_nodes=num_nodes)   # validates
    return (two_b * local + received_sum.to(local.dtype)) / (two_b + num_nodes)


def merge_(local: torch.Tensor, received_sum: torch.Tensor, *, batches_to_wait: int,
           num_nodes: int, keep=()) -> torch.Tensor:
    """In-place :func:`merge` into ``local`` (one temporary-free pass; equal to rounding).
    ``keep``: ``(start, end)`` ranges of ``local`` left bitwise as they are."""
    if local.shape != received_sum.shape:
        raise ConfigError(f"DASO merge: local {tuple(local.shape)} and received "
                          f"{tuple(received_sum.shape)} differ in shape")
    w_local, w_sum = merge_weights(batches_to_wait=batches_to_wait, num_nodes=num_nodes)
    saved = [local[a:b].clone() for a, b in keep]
    local.mul_(w_local).add_(received_sum.to(local.dtype), alpha=w_sum)
    for (a, b), values in zip(keep, saved):
        local[a:b].copy_(values)
    return local


def held_ranges(offsets, sizes, held) -> list[tuple[int, int]]:
    """The ``(start, end)`` ranges of a flat vector covered by the parameters (at ``offsets``, of
    ``sizes`` elements) whose ``held`` flag is set, adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for start, size, flag in zip(offsets, sizes, held):
        if not flag or not size:
            continue
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], start + size)
        else:
            out.append((start, start + size))
    return out
