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
            "moving the model (its device, channels_last); its dtype stays float32")


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
        self.ready: list[int] = []      # parameters in the order their gradients came this step
        self.last = True
        self._view_ptrs = [v.data_ptr() for _, v in flat.views("grads")]
        self._grad_version: int | None = None    # flat.grads' version after the last hook
        self._hooks = {}
        self.paused = False
        self._hook_trainable()

    def _hook_trainable(self) -> None:
        """A hook on every parameter that requires grad now (one unfrozen later gets it at the
        next step boundary); none while paused."""
        if self.paused:
            return
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
            if n == 1:
                self.ready.append(k)
            if n > self.passes and self._counted[k]:
                self.counts[k] -= 1
                raise ConfigError(
                    f"{self.algorithm}: the gradient of {name} was computed more than "
                    f"backward_passes_per_step={self.passes} times before step(): pass "
                    "backward_passes_per_step=<backward passes per step> to accumulate them "
                    "(Horovod's meaning), or call step() after each backward")
            self.last = n >= self.passes
            self._grad_version = self.flat.grads._version
        return hook

    def changed_since_backward(self) -> bool:
        """Whether the flat gradient buffer was written in place since the last gradient hook
        of this step (a ``clip_grad_norm_`` between ``backward()`` and ``step()``): torch counts
        every in-place write in the buffer's version, which its views share."""
        return self._grad_version is not None and self.flat.grads._version != self._grad_version

    @property
    def seen(self) -> int:
        """The most backward passes any parameter has had this step."""
        return max(self.counts, default=0)

    def presence(self) -> list[float]:
        """1.0 per parameter that got a gradient this step (its hook fired, or ``p.grad`` holds a
        tensor of its own, e.g. set by hand or after ``set_to_none``), else 0.0. Read it before
        the gradients are re-bound to the flat buffer.

        A parameter made trainable after the last :meth:`reset`/:meth:`refresh` had no hook during
        this backward (a hook cannot be put on a tensor that does not require grad): it counts as
        present when its gradient slot is not all zeros (the slot was zeroed before the backward)."""
        out = []
        for k, (p, n, ptr) in enumerate(zip(self.flat._params, self.counts,  # noqa: SLF001
                                            self._view_ptrs)):
            g = p.grad
            got = bool(n) or (g is not None and g.data_ptr() != ptr)
            if not got and k not in self._hooks and p.requires_grad and g is not None:
                got = bool(g.any())
            out.append(1.0 if got else 0.0)
        return out

    def reset(self) -> None:
        """A new step: no pass seen."""
        self.counts = [0] * len(self.counts)
        self.ready = []
        self.last = True
        self._grad_version = None
        self._hook_trainable()

    def refresh(self) -> None:
        """Hook the parameters made trainable since the last step (``zero_grad()`` calls it, so
        a layer unfrozen between two steps is counted from its first backward on)."""
        self._hook_trainable()

    def close(self) -> None:
        for h in self._hooks.values():
            h.remove()
        self._hooks = {}

    def pause(self) -> None:
        """No hooks until :meth:`resume` (steps whose gradients are torch's own tensors, which
        nothing counts: local SGD's local steps)."""
        if not self.paused:
            self.close()
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self._hook_trainable()
