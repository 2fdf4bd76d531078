"""DASO — distributed asynchronous and selective optimization (Coquelin et al., arXiv 2104.05588).

One concern per module:

* :mod:`.schedule`  epoch phases, (global_skip, local_skip, batches_to_wait) and the per-batch plan
* :mod:`.plateau`   loss-plateau detection that drives the schedule
* :mod:`.merge`     the merge formula x ← (2B·x + S)/(2B + P)
* :mod:`.comm`      node-local averages, global sends in flight (cast, chunked), node broadcasts,
                    blocking global averages, the emulated slow link
* :mod:`.optimizer` ``DASO``, the wrapper around the user's torch optimizer

The ``hpcasync train --algorithm daso`` runtime is :mod:`hpcasync.daso.runtime`.
"""
from .comm import DasoComm, InFlight, LinkDelay, pack_state, unpack_state
from .merge import merge, merge_, merge_weights
from .optimizer import DASO
from .plateau import PlateauDetector
from .schedule import BatchPlan, DasoSchedule, Knobs, next_knobs, phase_of, plan_batch

__all__ = ["DASO", "BatchPlan", "DasoComm", "DasoSchedule", "InFlight", "Knobs", "LinkDelay",
           "PlateauDetector", "merge", "merge_", "merge_weights", "next_knobs", "pack_state",
           "phase_of", "plan_batch", "unpack_state"]
