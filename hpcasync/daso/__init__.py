"""DASO — distributed asynchronous and selective optimization (Coquelin et al., arXiv 2104.05588).

One concern per module:

* :mod:`.schedule`  epoch phases, (global_skip, local_skip, batches_to_wait) and the per-batch plan
* :mod:`.plateau`   loss-plateau detection that drives the schedule
* :mod:`.merge`     the merge formula x ← (2B·x + S)/(2B + P)
* :mod:`.comm`      node-local averages, global sends in flight (cast, chunked), node broadcasts,
                    blocking global averages, the emulated slow link
* :mod:`.optimizer` ``DASO``, the wrapper around the user's torch optimizer

The ``hpcasync train --algorithm daso`` runtime is :mod:`hpcasync.daso.runtime` (its options:
:mod:`hpcasync.daso.options`).
"""
from .. import lazy_exports
from .merge import merge, merge_, merge_weights     # torch-free (and `merge` names the function)

_LAZY = {**dict.fromkeys(("DasoComm", "InFlight", "LinkDelay", "pack_state", "unpack_state"),
                         ".comm"),
         "DASO": ".optimizer", "PlateauDetector": ".plateau",
         **dict.fromkeys(("BatchPlan", "DasoSchedule", "Knobs", "next_knobs", "phase_of",
                          "plan_batch"), ".schedule")}
__all__ = ["DASO", "BatchPlan", "DasoComm", "DasoSchedule", "InFlight", "Knobs", "LinkDelay",
           "PlateauDetector", "merge", "merge_", "merge_weights", "next_knobs", "pack_state",
           "phase_of", "plan_batch", "unpack_state"]

__getattr__ = lazy_exports(__name__, _LAZY)     # first use: the options module needs no torch
