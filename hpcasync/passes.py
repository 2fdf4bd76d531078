"""Backward passes per step, counted as Horovod counts them, and which parameters got a gradient.

Horovod's ``DistributedOptimizer(backward_passes_per_step=k)``: the user calls ``backward()`` k times
and ``step()`` once; every gradient hook counts one pass of its parameter, the k-th starts its
allreduce, a (k+1)-th before ``step()`` is an error. :class:`BackwardPasses` keeps those counts (a
``register_post_accumulate_grad_hook`` per trainable parameter), says whether the backward now running
is the last of the step for the parameter whose hook fires (``last``, read by the
:class:`~hpcasync.ssgd.buckets.BucketReducer` hook that fires right after), and which parameters got
a gradient at all this step (:meth:`presence`: the hook fired, or ``p.grad`` was set to a tensor
that is not the flat buffer's view). Its hook also stops at once when ``model.to(...)`` moved the
parameter off the flat buffer.

SSGD uses it for both (:mod:`hpcasync.ssgd.optimizer`); the other families use its presence to say
when a trainable parameter got no gradient in a step (:meth:`AlgorithmOptimizer._note_unused`).
"""
from __future__ import annotations

import torch

from .errors import ConfigError


def unbound_message(algorithm: str, name: str) -> str:
    """The one line for a parameter (or buffer) that ``model.to(...)`` moved off the flat buffer."""
    return (f"{algorithm}: {name} is no longer a view of the flat buffer (.to()/.cuda()/.half()/"
            ".double()/channels_last after hpcasync.optimizer(...)?): build the optimizer after "
            "moving/converting the model")


class BackwardPasses:
    """Per-parameter backward-pass counts of the current step (module doc).

    Args:
        flat: the :class:`~hpcasync.comm.FlatModel`.
        passes: ``backward_passes_per_step``.
        counted: per parameter (flat order), True where an overrun is an error (the parameters of
            the optimizer's param groups, as Horovod hooks only those); the others are counted
            but may get any number of passes.
        algorithm: named in the errors.

    Register it before the reducer: hooks of one tensor run in registration order.
    """

    def __init__(self, flat, passes: int, counted: list[bool], algorithm: str = "ssgd"):
        self.flat, self.passes, self.algorithm = flat, int(passes), algorithm
        self._counted = list(counted)
        self.counts = [0] * len(flat.parameters)
        self.last = True
        self._view_ptrs = [v.data_ptr() for _, v in flat.views("grads")]
        self._hooks = {}
        self._hook_trainable()

    def _hook_trainable(self) -> None:
        """A hook on every parameter that requires grad now (one unfrozen later gets it at the
        next step boundary)."""
        for k, p in enumerate(self.flat.parameters):
            if p.requires_grad and k not in self._hooks:
                self._hooks[k] = p.register_post_accumulate_grad_hook(self._hook(k))

    def _hook(self, k: int):
        ptr = self.flat._param_ptrs[k]        # noqa: SLF001 (the flat model's own record)
        name = self.flat.names[k]

        def hook(p: torch.Tensor) -> None:
            if p.data_ptr() != ptr and p.numel():
                raise ConfigError(unbound_message(self.algorithm, name))
            n = self.counts[k] = self.counts[k] + 1
            if n > self.passes and self._counted[k]:
                self.counts[k] -= 1
                raise ConfigError(
                    f"{self.algorithm}: the gradient of {name} was computed more than "
                    f"backward_passes_per_step={self.passes} times before step(): pass "
                    "backward_passes_per_step=<backward passes per step> to accumulate them "
                    "(Horovod's meaning), or call step() after each backward")
            self.last = n >= self.passes
        return hook

    @property
    def seen(self) -> int:
        """The most backward passes any parameter has had this step."""
        return max(self.counts, default=0)

    def presence(self) -> list[float]:
        """1.0 per parameter that got a gradient this step (its hook fired, or ``p.grad`` holds a
        tensor of its own, e.g. set by hand or after ``set_to_none``), else 0.0. Read it before
        the gradients are re-bound to the flat buffer."""
        out = []
        for p, n, ptr in zip(self.flat._params, self.counts, self._view_ptrs):  # noqa: SLF001
            g = p.grad
            out.append(1.0 if n or (g is not None and g.data_ptr() != ptr) else 0.0)
        return out

    def reset(self) -> None:
        """A new step: no pass seen."""
        self.counts = [0] * len(self.counts)
        self.last = True
        self._hook_trainable()

    def close(self) -> None:
        for h in self._hooks.values():
            h.remove()
        self._hooks = {}
