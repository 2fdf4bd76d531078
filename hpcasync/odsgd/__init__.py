"""OD-SGD — one-step-delay SGD (Xu et al., arXiv 2005.06728).

* :mod:`.steps`      LocalOpt and the global step: pure functions over flat tensors
* :mod:`.core`       one round as pure functions (shared with the simulator)
* :mod:`.pipeline`   ``ODSGDWorker``: this rank's round in flight and its local weights (MPI)
* :mod:`.checkpoint` the global state plus every rank's own state
* :mod:`.runtime`    ``hpcasync train --algorithm odsgd`` (its options: :mod:`.options`)
"""
_LAZY = {**dict.fromkeys(("GlobalState", "ODSGDHyper", "WorkerState", "global_update",
                          "local_update", "simulate_round"), ".core"),
         "ODSGD": ".optimizer", "ODSGDWorker": ".pipeline"}
__all__ = ["ODSGD", "GlobalState", "ODSGDHyper", "ODSGDWorker", "WorkerState", "global_update",
           "local_update", "simulate_round"]


def __getattr__(name):          # imported at first use: the package's options module needs no torch
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
