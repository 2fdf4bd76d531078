"""OD-SGD — one-step-delay SGD (Xu et al., arXiv 2005.06728).

* :mod:`.steps`      LocalOpt and the global step: pure functions over flat tensors
* :mod:`.core`       one round as pure functions (shared with the simulator)
* :mod:`.pipeline`   ``ODSGDWorker``: this rank's round in flight and its local weights (MPI)
* :mod:`.checkpoint` the global state plus every rank's own state
* :mod:`.runtime`    ``hpcasync train --algorithm odsgd``
"""
from .core import GlobalState, ODSGDHyper, WorkerState, global_update, local_update, simulate_round
from .optimizer import ODSGD
from .pipeline import ODSGDWorker

__all__ = ["ODSGD", "GlobalState", "ODSGDHyper", "ODSGDWorker", "WorkerState", "global_update",
           "local_update", "simulate_round"]
