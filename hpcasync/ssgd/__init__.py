"""SSGD — synchronous data-parallel SGD, the Horovod/DDP-style baseline.

* :mod:`.optimizer` ``DistributedOptimizer``: average the flat gradient buffer, then the user's step
* :mod:`.horovod`   the same loop through Horovod's ``DistributedOptimizer`` (``--backend horovod``)
* :mod:`.runtime`   ``hpcasync train --algorithm ssgd`` (its options: :mod:`.options`)
"""
_LAZY = {"DistributedOptimizer": ".optimizer"}
__all__ = ["DistributedOptimizer"]


def __getattr__(name):          # imported at first use: the package's options module needs no torch
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
