"""SSGD — synchronous data-parallel SGD, the Horovod/DDP-style baseline.

* :mod:`.optimizer` ``DistributedOptimizer``: average the flat gradient buffer, then the user's step
* :mod:`.horovod`   the same loop through Horovod's ``DistributedOptimizer`` (``--backend horovod``)
* :mod:`.runtime`   ``hpcasync train --algorithm ssgd`` (its options: :mod:`.options`)
"""
from .. import lazy_exports

_LAZY = {"DistributedOptimizer": ".optimizer"}
__all__ = ["DistributedOptimizer"]

__getattr__ = lazy_exports(__name__, _LAZY)     # first use: the options module needs no torch
