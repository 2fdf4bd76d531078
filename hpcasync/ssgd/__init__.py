"""SSGD — synchronous data-parallel SGD, the Horovod/DDP-style baseline.

* :mod:`.optimizer` ``DistributedOptimizer``: average the flat gradient buffer, then the user's step
* :mod:`.horovod`   the same loop through Horovod's ``DistributedOptimizer`` (``--backend horovod``)
* :mod:`.runtime`   ``hpcasync train --algorithm ssgd``
"""
from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
