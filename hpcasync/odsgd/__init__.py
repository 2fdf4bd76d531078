"""OD-SGD — one-step-delay SGD (Xu et al., arXiv 2005.06728).

* :mod:`.steps`      LocalOpt and the global step: pure functions over flat tensors
* :mod:`.core`       one round as pure functions (shared with the simulator)
* :mod:`.pipeline`   ``ODSGDWorker``: this rank's round in flight and its local weights (MPI)
* :mod:`.checkpoint` the global state plus every rank's own state
* :mod:`.runtime`    ``hpcasync train --algorithm odsgd`` (its options: :mod:`.options`)
"""
from .. import lazy_exports

_LAZY = {**dict.fromkeys(("GlobalState", "ODSGDHyper", "WorkerState", "global_update",
                          "local_update", "simulate_round"), ".core"),
         "ODSGD": ".optimizer", "ODSGDWorker": ".pipeline"}
__all__ = ["ODSGD", "GlobalState", "ODSGDHyper", "ODSGDWorker", "WorkerState", "global_update",
           "local_update", "simulate_round"]

__getattr__ = lazy_exports(__name__, _LAZY)     # first use: the options module needs no torch
