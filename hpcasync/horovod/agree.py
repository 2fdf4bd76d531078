"""Cross-rank agreement on every facade collective, and Horovod's ``join()``.

Horovod's coordinator matches collectives by name and raises the same error on every rank when
their dtypes, shapes, ops, roots or scale factors differ. Here collectives run in submission order
(MPI's rule), so before a collective's data moves every rank puts a 62-bit digest of its
*descriptor* (kind, name, op, dtype and shape of each tensor — allgather/alltoall: all but the
first dimension —, root, scale factors, device type) into one ``MPI_Allreduce(MIN)`` of four
int64 ``[digest, -digest, joined, first-in-join]``: equal min and max digest is agreement (32 bytes
and one latency per collective; nothing cached, so nothing can go stale). On disagreement the
descriptors are allgathered and every rank raises the same :class:`HorovodInternalError` with
Horovod's "Mismatched ..." text, the tensor's name and the two ranks compared.

``join()``: a joined rank loops in that exchange with a neutral digest. When the active ranks'
exchange shows a joined rank, they allgather the descriptor; for an allreduce (plain, grouped, or a
DistributedOptimizer step) the joined rank runs the same MPI calls on zeros — Horovod's rule: the
joined rank contributes zeros and Average still divides by ``size()``; allgather, broadcast,
alltoall, reducescatter and barrier raise Horovod's "... is not supported with Join at this time."
on the active ranks. When every rank is in ``join()`` it returns the last rank to join (ranks that
join in the same exchange: the highest).

Process sets: each set's collectives exchange on the set's communicator. Ranks that call the same
collective with different sets (or a collective one member of its set never calls) wait for each
other in a cycle; an exchange waiting longer than ``HPCASYNC_HOROVOD_PROBE_S`` seconds (1) sends
a probe to its set's other members, a waiting rank passes it on to the members of the set it waits
in, and a probe that comes back to its sender is a deadlock (the edge-chasing of Chandy, Misra and
Haas; the exchanges are nonblocking, so a waiting rank reads probes): every rank then raises the
same ``HorovodInternalError`` naming the cycle — at once where it waits, else at its next wait —
and later collectives raise it again until ``hvd.shutdown()``, which completes the exchanges left
behind (``hvd.init()`` then starts afresh).

Named collectives out of order (Horovod matches tensors by name, not by order): a collective
given a ``name`` (``key``: Horovod's tensor name, ``allreduce.<name>``, within its process set)
that meets other collectives on the other ranks — one rank in ``allreduce_async(t, name="x")``,
another in ``barrier()`` — is *parked*: the exchange allgathers each rank's current collective and
its parked ones, and the ``_async`` call returns its handle at once; a parked collective starts in
the first exchange in which every rank has its name (parked or current; the one listed first by
the lowest rank goes first, one per exchange, so the ranks post their MPI calls in one order) — a
later call on another rank, or this rank's ``synchronize``/``poll`` of it. A blocking call (an
unnamed collective, ``barrier``, a ``synchronize``) keeps exchanging while another rank parks; when
no rank can park and no name is common, the ranks wait for each other (Horovod stalls there): the
same ``HorovodInternalError`` as above on every rank. A mismatch found for a parked collective is
raised by its ``synchronize``. Only the fast path above is taken while every rank calls the same
collective, so parking costs nothing then. Not parked: unnamed collectives (matched in order),
Adasum allreduces, the ``*_object`` helpers, the optimizer's steps and, with a joined rank, any.

``HPCASYNC_HOROVOD_AGREE=0`` switches the exchange off (the cost measurement; then ``join()`` is a
plain collective again, as before).
"""
from __future__ import annotations

import hashlib
import os

import numpy as np

from .. import environ
from . import timeline as _timeline

BIG = 1 << 62
_MASK = BIG - 1

#: kind -> callable(descriptor) that a joined rank runs (registered by collectives / optimizer)
SERVE: dict = {}
_NOT_WITH_JOIN = {"ALLGATHER": "Allgather is not supported with Join at this time. Specify "
                               "sparse_to_dense=True if using DistributedOptimizer",
                  "BROADCAST": "Broadcast is not supported with Join at this time.",
                  "ALLTOALL": "Alltoall is not supported with Join at this time.",
                  "REDUCESCATTER": "Reducescatter is not supported with Join at this time.",
                  "BARRIER": "Barrier is not supported with Join at this time."}


#: Horovod's text for a collective that shutdown() ends before it ran
SHUT_DOWN = ("Horovod has been shut down. This was caused by an exception on one of the ranks or "
             "an attempt to allreduce, allgather or broadcast a tensor after one of the ranks "
             "finished execution. If the shutdown was caused by an exception, you should see the "
             "exception in the log before the first shutdown message.")


class HorovodInternalError(RuntimeError):
    """Raised where Horovod raises its internal error (a collective that failed or that the
    ranks disagree on)."""


def enabled() -> bool:
    return environ.switch("HPCASYNC_HOROVOD_AGREE", True)


class Desc(tuple):
    """``(kind, name, op, specs, root, factors, device, problem)``; ``specs`` one ``(dtype,
    shape)`` per tensor (allgather/alltoall: ``(dtype, ndim, shape[1:])``); ``problem`` a
    rank-local error (bad ``splits``, ...) raised on every rank after the exchange, so a rank
    whose call is invalid never leaves the others waiting."""

    __slots__ = ()

    def __new__(cls, kind, name=None, op=None, specs=(), root=None, factors=None, device="cpu",
                problem=None):
        return super().__new__(cls, (kind, name, op, tuple(specs), root, factors, device,
                                     problem))

    def __getnewargs__(self):             # pickled (the allgather of a disagreement) field-wise
        return tuple(self)

    kind = property(lambda s: s[0])
    name = property(lambda s: s[1])
    op = property(lambda s: s[2])
    specs = property(lambda s: s[3])
    root = property(lambda s: s[4])
    factors = property(lambda s: s[5])
    problem = property(lambda s: s[7])


def digest(desc: Desc) -> int:
    return int.from_bytes(hashlib.blake2b(repr(desc).encode(), digest_size=8).digest(),
                          "little") & _MASK


def _exchange(comm, mine: int | None, first: bool = False, label: str = "") -> np.ndarray:
    from mpi4py import MPI

    if _W.aborted:
        raise HorovodInternalError(_W.aborted)
    if mine is None:        # a joined rank: neutral digest
        v = np.array([BIG, BIG, -1, -comm.Get_rank() if first else BIG], dtype=np.int64)
    else:
        v = np.array([mine, -mine, 0, BIG], dtype=np.int64)
    ch = _W.sets.get(comm.py2f()) if _W.comm is not None else None
    if ch is None:                  # a communicator of no process set: a plain blocking exchange
        comm.Allreduce(MPI.IN_PLACE, v, op=MPI.MIN)
        return v
    uid = ch[1]
    k = _W.counts[uid] = _W.counts.get(uid, 0) + 1
    req = comm.Iallreduce(MPI.IN_PLACE, v, op=MPI.MIN)
    if not req.Test():
        _wait(req, v, uid, k, label)
    return v


class Pending:
    """A parked collective (module doc): ``go()`` starts its data movement and returns what its
    caller gets (``result``, once ``started``); ``error``: what its synchronization raises."""

    __slots__ = ("comm", "key", "desc", "go", "result", "error", "started")

    def __init__(self, comm, key, desc, go):
        self.comm, self.key, self.desc, self.go = comm, key, desc, go
        self.result, self.error, self.started = None, None, False

    def start(self) -> None:
        try:
            self.result = self.go()
        except Exception as exc:            # noqa: BLE001 - raised by its synchronize
            self.error = exc
        self.started = True


@_timeline.negotiates           # the exchange is the collective's NEGOTIATE phase
def agree(comm, desc: Desc, dig: int | None = None, *, key=None, go=None, park: bool = False):
    """Every rank's ``desc`` equal, or the same HorovodInternalError on every rank; with a
    joined rank, serve it (allreduce kinds) or raise Horovod's join error (the others). Returns
    True once agreed (the caller starts the collective); with ``park`` (a named collective,
    ``key`` its Horovod name, ``go`` its start) a :class:`Pending` when the other ranks are in
    other collectives (module doc)."""
    if not enabled():
        if desc.problem:
            raise ValueError(desc.problem)
        return True
    if _settle(comm, desc, dig, key, park and key is not None and not desc.problem, None):
        return True
    p = Pending(comm, key, desc, go)
    _W.parked.setdefault(comm.py2f(), []).append(p)
    return p


def settle(p: Pending, park: bool) -> bool:
    """``synchronize`` (``park`` False: waits) or ``poll`` (True) of a parked collective: True once
    it has started; raises its error."""
    if not p.started:
        try:
            agreed = _settle(p.comm, p.desc, None, p.key, park, p)
        except BaseException as exc:        # the other ranks raised it too: it stays the answer
            _unpark(p)
            p.error, p.started = exc, True
            raise
        if not agreed:
            return False
        _unpark(p)
        p.start()
    if p.error is not None:
        raise p.error
    return True


def _unpark(p: Pending) -> None:
    mine = _W.parked.get(p.comm.py2f(), [])
    if p in mine:
        mine.remove(p)


def _settle(comm, desc: Desc, dig, key, park: bool, own) -> bool:
    """The exchanges of this rank's current collective (``own``: the parked one it waits for):
    True when it is agreed on every rank, False when it is parked; starts the parked collectives
    whose names every rank has meanwhile (module doc)."""
    mine = digest(desc) if dig is None else dig
    label = _label(desc)
    while True:
        v = _exchange(comm, mine, label=label)
        if v[2] == 0 and v[0] == -v[1]:
            if desc.problem:
                raise ValueError(desc.problem)          # the same problem on every rank
            return True                                 # the fast path: agreed, nobody joined
        parked = [p for p in _W.parked.get(comm.py2f(), ()) if p is not own]
        every = comm.allgather((desc, key, park, [(p.key, p.desc) for p in parked]))
        if v[2] != 0 or len({o[1] for o in every if o is not None}) == 1:
            _check(every, v, desc)                  # one collective on every rank (or a join)
            return True
        common = _first_common(every)
        if common is None:                          # nothing to start: park, wait or fail
            if not any(o[2] for o in every):
                _check(every, v, desc)              # every rank waits for another: raises
            if park:
                return False
            continue
        descs = [o[0] if o[1] == common else dict(o[3])[common] for o in every]
        error = _error(descs)
        if key == common:
            if error is not None:
                raise error
            return True
        p = next(p for p in parked if p.key == common)
        _unpark(p)
        if error is not None:
            p.error, p.started = error, True
        else:
            p.start()
        if park:
            return False


def _first_common(every) -> object:
    """The first name, in the lowest rank's order (its parked collectives, then its current one),
    that every rank has parked or current; None if none."""
    have = [{o[1], *(k for k, _ in o[3])} for o in every]
    for k in [k for k, _ in every[0][3]] + [every[0][1]]:
        if k is not None and all(k in h for h in have):
            return k
    return None


def _error(descs: list):
    """The error every rank raises for one collective whose descriptors are ``descs`` (one per
    rank), or None when they agree."""
    bad = [(r, d.problem) for r, d in enumerate(descs) if d is not None and d.problem]
    if bad:
        return ValueError(f"{bad[0][1]} [rank {bad[0][0]}]")
    if any(d != descs[0] for d in descs):
        return HorovodInternalError(mismatch(descs))
    return None


def _check(every, v, desc: Desc) -> None:
    """The slow path of one collective called on every rank (``every``: the allgathered offers,
    None for a joined rank): raise the problem or the mismatch, or Horovod's join error."""
    descs = [o[0] if o is not None else None for o in every]
    bad = [(r, d.problem) for r, d in enumerate(descs) if d is not None and d.problem]
    if bad:
        raise ValueError(f"{bad[0][1]} [rank {bad[0][0]}]")
    if v[2] != 0 and desc.kind in _NOT_WITH_JOIN:
        # the joined ranks learn the descriptor from the same allgather and skip it
        if v[0] == -v[1]:
            raise HorovodInternalError(_NOT_WITH_JOIN[desc.kind])
    if v[0] != -v[1]:
        raise HorovodInternalError(mismatch(descs))


def join(comm) -> int:
    """Horovod's join on ``comm`` (module doc): returns the last rank to join. A collective this
    rank parked before joining takes part with its own tensors when the others start it."""
    if not enabled():
        import time

        return max(comm.allgather((time.time_ns(), comm.Get_rank())))[1]
    first = True
    while True:
        v = _exchange(comm, None, first, "JOIN")
        first = False
        if v[0] == BIG:                             # every rank is in join()
            return int(-v[3])
        every = comm.allgather(None)
        live = [o for o in every if o is not None]
        if (any(o[0] != live[0][0] for o in live) or live[0][0].kind in _NOT_WITH_JOIN
                or live[0][0].problem):
            continue                                # the active ranks raise; nothing to serve
        mine = [p for p in _W.parked.get(comm.py2f(), ()) if p.key == live[0][1]]
        if live[0][1] is not None and mine:
            _unpark(mine[0])
            mine[0].start()
        else:
            SERVE[live[0][0].kind](live[0][0])


# -- process sets: the wait-for probes -------------------------------------------------------------

#: seconds an exchange waits before it asks whether the ranks wait for each other in a cycle
#: (None: ``HPCASYNC_HOROVOD_PROBE_S``, default 1)
PROBE_S: float | None = None
_PROBE, _ABORT = 1, 2


class _Watch:
    """This rank's part in finding deadlocks between process sets (module doc)."""

    def __init__(self):
        self.comm = None        # a duplicate of the facade's world: probes and aborts travel here
        self.me = 0
        self.sets = {}          # communicator handle -> (communicator, uid, set id, members)
        self.members = {}       # uid -> (set id, members: ranks of the facade's world)
        self.counts = {}        # uid -> exchanges this rank has started on that set
        self.blocked = None     # (uid, k, label) while this rank waits in its k-th exchange
        self.forwarded = set()  # probes passed on during this wait
        self.sends = []         # requests of probes and aborts sent
        self.aborted = None     # the deadlock's text, once found: every later exchange raises it
        self.dangling = []      # (request, buffer) of an exchange left when the deadlock was found
        self.parked = {}        # communicator handle -> this rank's parked collectives (Pending)


_W = _Watch()


def setup(world) -> None:
    """Called by ``hvd.init`` (collective): the probes' communicator."""
    _W.__init__()
    _W.comm = world.Dup()
    _W.me = _W.comm.Get_rank()


def register(comm, uid: int, set_id: int, members) -> None:
    """Exchanges on ``comm`` (this rank's communicator of a process set, or None outside it) count
    as set ``uid``'s (a number that is the same on every rank and never reused)."""
    _W.members[uid] = (set_id, list(members))
    if comm is not None:
        _W.sets[comm.py2f()] = (comm, uid, set_id, list(members))


def unregister(comm) -> None:
    _W.sets.pop(comm.py2f(), None)


def teardown() -> None:
    """Called by ``hvd.shutdown`` (collective over every rank), before the sets' communicators are
    freed: after a deadlock, every set's exchanges are made whole (each rank posts neutral
    exchanges up to the count of the set's furthest member), so no request is left pending."""
    from mpi4py import MPI

    for waiting in _W.parked.values():      # never started: their synchronize raises this
        for p in waiting:
            p.error, p.started = HorovodInternalError(SHUT_DOWN), True
    if _W.comm is None:
        return
    every = _W.comm.allgather((bool(_W.aborted or _W.dangling), dict(_W.counts)))
    if any(broken for broken, _ in every):
        reqs = [r for r, _ in _W.dangling]
        bufs = [b for _, b in _W.dangling]
        for comm, uid, _, members in list(_W.sets.values()):
            top = max(every[m][1].get(uid, 0) for m in members)
            for _ in range(top - _W.counts.get(uid, 0)):
                bufs.append(np.array([BIG, BIG, 0, BIG], dtype=np.int64))
                reqs.append(comm.Iallreduce(MPI.IN_PLACE, bufs[-1], op=MPI.MIN))
        MPI.Request.Waitall(reqs)
    _W.comm.Barrier()
    status = MPI.Status()
    while _W.comm.iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
        _W.comm.recv(source=status.Get_source(), tag=status.Get_tag())
    MPI.Request.Waitall(_W.sends)
    _W.comm.Free()
    _W.__init__()


def _label(desc: Desc) -> str:
    return desc.kind if desc.name is None else f"{desc.kind} {desc.name!r}"


def _wait(req, buf, uid: int, k: int, label: str) -> None:
    """Wait for this rank's ``k``-th exchange on set ``uid``; after ``PROBE_S`` seconds (and again
    each ``PROBE_S``) send a probe to the set's other members. A rank that gets a probe while it
    waits in an exchange the sender is not part of passes it on to its own set; a probe that comes
    back to its sender, still in the same wait, is a cycle: a deadlock (Chandy-Misra-Haas)."""
    import time

    probe_s = environ.seconds("HPCASYNC_HOROVOD_PROBE_S", 1.0) if PROBE_S is None else PROBE_S
    t0 = time.monotonic()
    due, rnd = t0 + probe_s, 0
    _W.blocked, _W.forwarded = (uid, k, label), set()
    try:
        while not req.Test():
            now = time.monotonic()
            if now - t0 < 0.002:
                os.sched_yield()
                continue
            time.sleep(0.0002 if now - t0 < 0.05 else 0.001)
            _service()
            if now >= due:
                rnd, due = rnd + 1, now + probe_s
                _probe((_W.me, uid, k, rnd, uid, k, [(_W.me, _W.members[uid][0], label)]), uid)
    except HorovodInternalError:
        _W.dangling.append((req, buf))
        raise
    finally:
        _W.blocked = None


def _probe(msg, uid: int) -> None:
    for m in _W.members[uid][1]:
        if m != _W.me:
            _W.sends.append(_W.comm.isend(msg, dest=m, tag=_PROBE))


def _service() -> None:
    """Read the probes and aborts that arrived; pass probes on (see :func:`_wait`)."""
    from mpi4py import MPI

    status = MPI.Status()
    while _W.comm.iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
        msg = _W.comm.recv(source=status.Get_source(), tag=status.Get_tag())
        if status.Get_tag() == _ABORT:
            _W.aborted = msg
            raise HorovodInternalError(msg)
        _on_probe(*msg)
    _W.sends = [r for r in _W.sends if not r.Test()]


def _on_probe(origin, ouid, ok, rnd, suid, sk, path) -> None:
    if _W.blocked is None or _W.counts.get(suid, 0) >= sk:
        return          # not waiting, or already in (or past) the sender's exchange: no edge
    uid, k, label = _W.blocked
    if origin == _W.me:
        if (uid, k) == (ouid, ok):
            _deadlock(path)
        return
    if (origin, ouid, ok, rnd) in _W.forwarded:
        return
    _W.forwarded.add((origin, ouid, ok, rnd))
    _probe((origin, ouid, ok, rnd, uid, k, path + [(_W.me, _W.members[uid][0], label)]), uid)


def _deadlock(path) -> None:
    def where(sid):
        return "the global process set" if sid == 0 else f"process set {sid}"

    low = min(range(len(path)), key=lambda i: path[i][0])
    path = path[low:] + path[:low]          # the same cycle found from two ranks: the same text
    hops = [f"rank {r} waits in {label} on {where(sid)} for rank {nxt}"
            for (r, sid, label), nxt in zip(path, [p[0] for p in path[1:]] + [path[0][0]])]
    text = ("Deadlock: the ranks wait for each other in a cycle — " + "; ".join(hops) + " (every "
            "rank of a process set must call the set's collectives, in the same order; the same "
            "collective called with different process sets on different ranks never completes)")
    _W.aborted = text
    for m in range(_W.comm.Get_size()):
        if m != _W.me:
            _W.sends.append(_W.comm.isend(text, dest=m, tag=_ABORT))
    raise HorovodInternalError(text)


# -- the error text ----------------------------------------------------------------------------

def _shape(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _g(x: float) -> str:
    return f"{x:g}"


def _differ(a: Desc, b: Desc) -> str:
    """Horovod's message for the first difference, in its coordinator's order."""
    kind = a.kind
    if a.kind != b.kind:
        return (f"Mismatched operations: One rank did an {a.kind}, but another rank did an "
                f"{b.kind}.")
    if a.name != b.name:
        return (f"Mismatched tensor names: One rank submitted {a.name!r}, but another rank "
                f"submitted {b.name!r} (each rank waits in a collective that another rank has not "
                "called).")
    if len(a.specs) != len(b.specs):
        return (f"Mismatched {kind} group sizes: One rank sent {len(a.specs)} tensors, but "
                f"another rank sent {len(b.specs)}.")
    for sa, sb in zip(a.specs, b.specs):
        if sa[0] != sb[0]:
            return (f"Mismatched data types: One rank had type {sa[0]}, but another rank had "
                    f"type {sb[0]}.")
    if a.op != b.op:
        return (f"Mismatched reduction operation: One rank sent reduction op {a.op}, but another "
                f"rank sent reduction op {b.op}.")
    for sa, sb in zip(a.specs, b.specs):
        if kind in ("ALLGATHER", "ALLTOALL"):
            (_, na, ra), (_, nb, rb) = sa, sb
            if na != nb:
                return (f"Mismatched {kind} tensor shapes: One rank sent a tensor of rank {na}, "
                        f"but another rank sent a tensor of rank {nb}.")
            for d, (x, y) in enumerate(zip(ra, rb), start=1):
                if x != y:
                    return (f"Mismatched {kind} tensor shapes: One rank sent a tensor with "
                            f"dimension {d} equal to {x}, but another rank sent a tensor with "
                            f"dimension {d} equal to {y}.")
        elif sa[1:] != sb[1:]:
            which = f" (parameter {sa[2]} / {sb[2]})" if len(sa) > 2 else ""
            return (f"Mismatched {kind} tensor shapes: One rank sent a tensor of shape "
                    f"{_shape(sa[1])}, but another rank sent a tensor of shape "
                    f"{_shape(sb[1])}.{which}")
    if a.factors != b.factors:
        fa, fb = a.factors or (1.0, 1.0), b.factors or (1.0, 1.0)
        return (f"Mismatched prescale and/or postscale factors: One rank sent factors "
                f"({_g(fa[0])}, {_g(fa[1])}), but another rank sent factors ({_g(fb[0])}, "
                f"{_g(fb[1])}).")
    if a.root != b.root:
        return (f"Mismatched {kind} root ranks: One rank specified root rank {a.root}, but "
                f"another rank specified root rank {b.root}.")
    if a[6] != b[6]:
        dev = {True: "CPU", False: "GPU"}
        return (f"Mismatched {kind} CPU/GPU device selection: One rank specified device "
                f"{dev[a[6] == 'cpu']}, but another rank specified device {dev[b[6] == 'cpu']}.")
    return f"Mismatched {kind} requests: {a!r} vs {b!r}."


def mismatch(every: list) -> str:
    """One line, the same on every rank: Horovod's text, then the tensor and the ranks."""
    live = [(r, d) for r, d in enumerate(every) if d is not None]
    r0, a = live[0]
    r1, b = next((r, d) for r, d in live if d != a)
    name = a.name if a.name is not None else f"{a.kind.lower()}.noname"
    return f"{_differ(a, b)} [tensor {name}: rank {r0} vs rank {r1}]"
