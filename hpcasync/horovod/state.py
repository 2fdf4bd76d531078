"""The facade's state after ``hvd.init()``: its communicators, roles and process sets.

A leaf of :mod:`hpcasync.horovod` (imports nothing of it), so that :mod:`.basics` (which sets it)
and :mod:`.process_sets` (which reads it) do not import each other::

    from hpcasync.horovod import state
    state.current().comm.Get_rank()       # ValueError before hvd.init()
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class State:
    comm: object            # the facade's world: every rank, or the workers of a PS algorithm
    local: object
    cross: object
    roles: object           # hpcasync.Roles of the whole job
    algorithm: str | None
    homogeneous: bool
    spec_sent: bool = False
    sets: dict = field(default_factory=dict)    # process_set_id -> ProcessSet (0: the global set)
    dynamic: bool = False                       # add_process_set / remove_process_set allowed
    serial: int = 0                             # process sets registered so far (their uids)
    owns_world: bool = False    # init(comm=...) made roles.topology.world: shutdown frees it


STATE: State | None = None      # set by hvd.init(), None again after hvd.shutdown()


def current() -> State:
    """The state of the running facade (ValueError before ``hvd.init()``, as Horovod's)."""
    if STATE is None:
        raise ValueError("hpcasync.horovod has not been initialized; use hvd.init().")
    return STATE
