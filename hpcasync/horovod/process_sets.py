"""Horovod's process sets: collectives over a subset of the ranks, each set an MPI sub-communicator.

A :class:`ProcessSet` names ranks of the facade's world (``hvd.rank()`` numbers); registered at
``hvd.init(process_sets=[...])`` or later by ``hvd.add_process_set`` (with
``hvd.init(process_sets="dynamic")`` or ``HOROVOD_DYNAMIC_PROCESS_SETS=1``), it gets Horovod's
``process_set_id`` and, on its members, a communicator split from the facade's world. Pass it as
``process_set=`` to any collective, to ``DistributedOptimizer`` or to the broadcast helpers::

    even = hvd.ProcessSet(range(0, hvd.size(), 2))
    hvd.init(process_sets=[even])
    if even.included():
        hvd.allreduce(t, process_set=even)            # the even ranks only
        hvd.broadcast(t, root_rank=2, process_set=even)   # root: a global rank, as Horovod

Horovod 0.28.1's rules kept: ranks are sorted; ids are the smallest free ones (comm-defined sets
first, then the list's order); a duplicate set (or one equal to the global set) is refused; adding
and removing are collective over every rank; a rank outside a set that calls a collective on it
gets Horovod's ``ValueError``; ``root_rank`` is a global rank. Agreement (:mod:`.agree`) runs on
the set's communicator; ranks that call the same collective on different sets deadlock, and the
wait-for probes of :mod:`.agree` turn that into one error on every rank.
"""
from __future__ import annotations

import os

#: Horovod's texts
_NOT_REGISTERED = "Process set does not exist or has not been registered."
_NO_DYNAMIC = ("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow {} process sets after Horovod "
               "initialization.")


class ProcessSet:
    """Ranks that run collectives together (Horovod's class: ``ProcessSet(ranks)`` or
    ``ProcessSet(mpi4py_comm)``; pass it to ``hvd.init(process_sets=...)`` or
    ``hvd.add_process_set``)."""

    process_set_id = None
    ranks = None
    mpi_comm = None
    _comm = None            # this rank's sub-communicator (None outside the set)
    _uid = None             # registration serial: the same on every rank, never reused

    def __init__(self, ranks_or_comm):
        try:
            iter(ranks_or_comm)
        except TypeError:
            ranks = None
        else:
            ranks = sorted(ranks_or_comm)
        if ranks is not None:
            if any(not isinstance(r, int) for r in ranks):
                raise ValueError("ProcessSet should be initialized with a list of process ranks "
                                 "or an mpi4py Comm object")
            self.ranks = ranks
            return
        from mpi4py import MPI

        if not isinstance(ranks_or_comm, MPI.Comm):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an "
                             "mpi4py Comm object")
        self.mpi_comm = ranks_or_comm

    def _invalidate(self) -> None:
        self.process_set_id = None
        self._comm = None

    def size(self) -> int | None:
        """The number of ranks in the set (None until registered)."""
        if self.process_set_id is None:
            return None
        return len(_registered(self).ranks)

    def rank(self) -> int | None:
        """This rank's place in the set (None until registered; ValueError outside the set).
        Collectives still take global ranks (``root_rank``), as Horovod's."""
        if self.process_set_id is None:
            return None
        from .state import current

        ranks = _registered(self).ranks
        if current().comm.Get_rank() not in ranks:
            raise ValueError("Process is not part of provided process set.")
        return ranks.index(current().comm.Get_rank())

    def included(self) -> bool | None:
        """Whether this rank is in the set (None for a set made from a communicator, until
        registered)."""
        if self.ranks is None:
            return None
        from .state import current

        return current().comm.Get_rank() in self.ranks

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


#: every rank of the facade (``process_set_id`` 0); its ranks are filled in by ``hvd.init``
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _dynamic_env() -> bool:
    return os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "").strip().lower() in (
        "1", "true", "yes", "on")


def _registered(ps: ProcessSet) -> ProcessSet:
    """The registered set with ``ps``'s id (ValueError if there is none)."""
    from .state import current as _state

    got = _state().sets.get(ps.process_set_id)
    if got is None or got.ranks != ps.ranks and ps is not global_process_set:
        raise ValueError(_NOT_REGISTERED)
    return got


def _check_ranks(ranks, size: int) -> str | None:
    if not ranks:
        return "a ProcessSet needs at least one rank"
    if len(set(ranks)) != len(ranks):
        return f"ProcessSet ranks {ranks} name a rank twice"
    bad = [r for r in ranks if not 0 <= r < size]
    if bad:
        return f"ProcessSet ranks {bad} are not ranks of the {size} ranks of this job"
    return None


def _register(st, ranks: list[int], ps: ProcessSet | None) -> ProcessSet:
    """Split the world for ``ranks`` (collective over every rank) and give the set the smallest
    free id. ``ps`` is the caller's object, or None for a set this rank holds no object for."""
    from mpi4py import MPI

    from . import agree

    me = st.comm.Get_rank()
    comm = st.comm.Split(0 if me in ranks else MPI.UNDEFINED, me)
    ps = ps if ps is not None else ProcessSet(ranks)
    ps.ranks = list(ranks)
    ps.process_set_id = next(i for i in range(1, len(st.sets) + 2) if i not in st.sets)
    ps._comm = comm if comm != MPI.COMM_NULL else None
    st.serial += 1
    ps._uid = st.serial
    st.sets[ps.process_set_id] = ps
    agree.register(ps._comm, ps._uid, ps.process_set_id, ps.ranks)
    return ps


def check(process_sets, comm_given: bool) -> list:
    """``hvd.init``'s checks of ``process_sets``, before anything starts: the list of sets."""
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"process_sets must be a list of hvd.ProcessSet or 'dynamic', got "
                             f"{process_sets!r}")
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"       # as Horovod's init does
        return []
    process_sets = list(process_sets or [])
    if any(not isinstance(ps, ProcessSet) for ps in process_sets):
        raise ValueError("process_sets must be a list of hvd.ProcessSet (or 'dynamic')")
    if not comm_given and any(ps.ranks is None for ps in process_sets):
        raise NotImplementedError("At this time process sets defined via MPI communicators are "
                                  "only supported when calling hvd.init() with comm set to a "
                                  "global MPI communicator.")
    return process_sets


def setup(st, process_sets: list) -> None:
    """``hvd.init``'s part (collective): the global set, then ``process_sets`` (from
    :func:`check`)."""
    from . import agree
    from .agree import Desc

    n = st.comm.Get_size()
    global_process_set.ranks = list(range(n))
    global_process_set._comm = st.comm
    global_process_set._uid = 0
    st.sets = {0: global_process_set}
    st.dynamic = _dynamic_env()
    agree.setup(st.comm)
    agree.register(st.comm, 0, 0, global_process_set.ranks)
    via_comm = [ps for ps in process_sets if ps.ranks is None]
    via_ranks = [ps for ps in process_sets if ps.ranks is not None]
    # the ranks-defined sets must be the same list on every rank; comm-defined ones are gathered
    problem = next((p for p in (_check_ranks(ps.ranks, n) for ps in via_ranks) if p), None)
    agree.agree(st.comm, Desc("INIT-PROCESS-SETS", None, None,
                              [tuple(ps.ranks) for ps in via_ranks], problem=problem))
    mine = []
    for ps in via_comm:
        from mpi4py import MPI

        group = ps.mpi_comm.Get_group()
        world = st.comm.Get_group()
        ranks = sorted(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world))
        group.Free()
        world.Free()
        if MPI.UNDEFINED in ranks:
            raise ValueError(f"ProcessSet({ps.mpi_comm}): the communicator holds ranks outside "
                             "the facade's world")
        mine.append(ranks)
    wanted, seen = [], set()
    for ranks in (r for each in st.comm.allgather(mine) for r in each):
        if tuple(ranks) not in seen:
            seen.add(tuple(ranks))
            wanted.append(ranks)
    wanted += [ps.ranks for ps in via_ranks if tuple(ps.ranks) not in seen
               and not seen.add(tuple(ps.ranks))]
    by_ranks = {}
    for ranks in wanted:
        if ranks != global_process_set.ranks:
            by_ranks[tuple(ranks)] = _register(st, ranks, None)
    taken = {0}
    for k, ps in enumerate(process_sets):
        if ps.ranks is None:
            ps.ranks = mine.pop(0)
        got = by_ranks.get(tuple(ps.ranks))
        if got is None or got.process_set_id in taken:
            ps._invalidate()
            raise ValueError(f"Horovod could not be initialized because process_sets entry "
                             f"number {k} is a duplicate: {ps}")
        taken.add(got.process_set_id)
        ps.process_set_id, ps._comm, ps._uid = got.process_set_id, got._comm, got._uid
        st.sets[ps.process_set_id] = ps


def teardown(st) -> None:
    """``hvd.shutdown``'s part: free the sets' communicators, forget their ids."""
    from . import agree

    agree.teardown()
    for sid, ps in sorted(st.sets.items()):
        if sid and ps._comm is not None:
            ps._comm.Free()
        ps._invalidate()
    global_process_set.process_set_id = 0
    st.sets = {}


def add_process_set(process_set) -> ProcessSet:
    """Register a set after ``hvd.init`` (collective over every rank; needs dynamic process
    sets). Returns it, registered; a duplicate is Horovod's ValueError."""
    from . import agree
    from .agree import Desc
    from .state import current as _state

    st = _state()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None and process_set.mpi_comm is not None:
        raise NotImplementedError("Dynamically adding process sets defined by an MPI communicator "
                                  "is not implemented. Please build the process set via a list "
                                  "of ranks.")
    if not st.dynamic:
        raise ValueError(_NO_DYNAMIC.format("adding"))
    agree.agree(st.comm, Desc("ADD_PROCESS_SET", None, None, [tuple(process_set.ranks)],
                              problem=_check_ranks(process_set.ranks, st.comm.Get_size())))
    if any(ps.ranks == process_set.ranks for ps in st.sets.values()):
        process_set._invalidate()
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    return _register(st, process_set.ranks, process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set (collective over every rank); False for the global set or one that is not
    registered, as Horovod's."""
    from . import agree
    from .agree import Desc
    from .state import current as _state

    st = _state()
    sid = process_set.process_set_id
    if sid is None or sid == 0:
        return False
    if not st.dynamic:
        raise ValueError(_NO_DYNAMIC.format("removing"))
    agree.agree(st.comm, Desc("REMOVE_PROCESS_SET", None, None, [tuple(process_set.ranks or ())]))
    got = st.sets.get(sid)
    process_set._invalidate()
    if got is None or got.ranks != process_set.ranks:
        return False
    del st.sets[sid]
    if got._comm is not None:
        agree.unregister(got._comm)
        got._comm.Free()
    got._invalidate()
    return True


def resolve(process_set, kind: str, root_rank: int | None = None):
    """``(communicator, set)`` of a collective's ``process_set=`` on this rank; a rank outside the
    set gets Horovod's ValueError for ``kind`` (Allreduce, Allgather, Broadcast, ...)."""
    from .state import current as _state

    st = _state()
    if process_set is None or process_set is global_process_set:
        return st.comm, global_process_set
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be an hvd.ProcessSet, got "
                        f"{type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(_NOT_REGISTERED)
    got = _registered(process_set)
    if got._comm is None:
        me = st.comm.Get_rank()
        if kind == "Broadcast":
            raise ValueError(f"broadcast received invalid root rank {root_rank} for provided "
                             "process set")
        if kind == "Reducescatter":
            raise ValueError(f"Invalid process set id for this rank: {got.process_set_id}")
        raise ValueError(f"{kind}: Rank {me} is not a member of the provided process set.")
    return got._comm, got
