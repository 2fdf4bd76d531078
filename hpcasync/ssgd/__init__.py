"""SSGD — synchronous data-parallel SGD, the Horovod/DDP-style baseline.

* :mod:`.optimizer` ``DistributedOptimizer``: average the flat gradient buffer, then the user's step
* :mod:`.powersgd`  ``PowerSGD``: the gradient averaged as a low-rank approximation (``compress=``)
* :mod:`.localsgd`  ``LocalSGD`` (``localsgd``): SSGD warm-up, then local steps averaged every H
* :mod:`.slowmo`    ``SlowMo`` (``slowmo``): local SGD with a slow momentum at each sync
* :mod:`.diloco`    ``DiLoCo`` (``diloco``): inner steps, then an outer step on the averaged
  pseudo-gradient; Streaming DiLoCo's fragments, delay and mixing
* :mod:`.horovod`   the same loop through Horovod's ``DistributedOptimizer`` (``--backend horovod``)
* :mod:`.runtime`   ``hpcasync train --algorithm ssgd`` (its options: :mod:`.options`)
"""
from .. import lazy_exports

_LAZY = {"DistributedOptimizer": ".optimizer", "LocalSGD": ".localsgd", "PowerSGD": ".powersgd",
         "DiLoCo": ".diloco", "SlowMo": ".slowmo"}
__all__ = ["DiLoCo", "DistributedOptimizer", "LocalSGD", "PowerSGD", "SlowMo", "optimizer_class"]

__getattr__ = lazy_exports(__name__, _LAZY)     # first use: the options module needs no torch


def optimizer_class(algorithm: str):
    """The optimizer class of an algorithm of this family (its registry entry's ``optimizer``)."""
    from .. import registry

    return registry.resolve(registry.get(algorithm).optimizer)
