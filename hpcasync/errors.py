"""Errors and the one place that turns them into an exit.

Two kinds of failure, two behaviours:

* :class:`HpcasyncError` (and subclasses) is *bad input or environment*: a config value, a missing
  data file, a world size that does not fit, a corrupt checkpoint. It is shown as one line,
  ``hpcasync: error: <what>``, without a traceback.
* Anything else is a bug or a crash: it is shown with its traceback, prefixed by the rank.

Either way, once MPI is running, the failing rank calls ``MPI_Abort`` on ``COMM_WORLD`` so the whole
job ends within seconds instead of leaving the other ranks blocked in a collective (invariant 2).
Before MPI is initialised (option validation happens there) every rank sees the same error, so only
rank 0 prints it and every rank exits with status 2. After, a user error on a rank other than 0 is
held back for :data:`FOLLOWER_GRACE_S`, so an error that every rank meets is still said once (by
rank 0). A world of one rank whose launcher numbered it k > 0 (Open MPI started by a plain
``srun``: N separate singleton jobs) is treated like the pre-MPI case: task 0 speaks for all.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback


class HpcasyncError(Exception):
    """Bad input or environment; reported as a single line."""


class ConfigError(HpcasyncError, ValueError):
    """An invalid option or config file value, or a misuse of the API (``except ValueError``
    catches it, as it would torch's own argument checks)."""


class DataError(HpcasyncError, ValueError):
    """A missing, truncated or malformed data set."""


class TopologyError(HpcasyncError, RuntimeError):
    """The MPI world does not fit the requested layout."""


class CheckpointError(HpcasyncError, RuntimeError):
    """A missing, corrupt or incompatible checkpoint."""


class DivergedError(HpcasyncError, RuntimeError):
    """Training diverged (non-finite or exploding loss, non-finite weights): the run stops."""


class ProcessFailedError(HpcasyncError, RuntimeError):
    """Ranks died (ULFM reported it) and nothing here survives it; ``dead_ranks`` names them
    (the role of Horovod's ``HorovodInternalError``)."""

    def __init__(self, message: str, dead_ranks=()):
        super().__init__(message)
        self.dead_ranks = list(dead_ranks)


PRE_MPI_FOLLOWER_WAIT_S = 15.0
#: Once MPI runs, a rank other than 0 that hits a user error waits this long before reporting it:
#: an error every rank meets (a data file, a world size, a checkpoint) is then said once, by rank
#: 0, whose MPI_Abort ends the wait; an error of this rank alone is reported after the wait.
FOLLOWER_GRACE_S = 5.0
#: After a peer's death the lowest survivor speaks; the next survivors wait FOLLOWER_GRACE_S, then
#: this much longer per place in the survivors' order (capped at FOLLOWER_WAIT_CAP_S), so that when
#: the lowest one is busy outside MPI (it has not met the failure) only the first follower speaks
#: and its MPI_Abort ends the others' waits: one line, not one per survivor.
FOLLOWER_STAGGER_S = 2.0
FOLLOWER_WAIT_CAP_S = 20.0


def follower_wait(place: int) -> float:
    """Seconds survivor number ``place`` (0: the lowest) waits before naming a peer's death."""
    if place <= 0:
        return 0.0
    return min(FOLLOWER_GRACE_S + FOLLOWER_STAGGER_S * (place - 1), FOLLOWER_WAIT_CAP_S)


def launcher_rank() -> int:
    """This process's rank as the launcher announced it, readable before MPI is initialised."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def _mpi_world():
    """COMM_WORLD if MPI is initialised and still running, else None (never initialises MPI)."""
    mpi_mod = sys.modules.get("mpi4py.MPI")
    if mpi_mod is None:
        return None
    try:
        if mpi_mod.Is_initialized() and not mpi_mod.Is_finalized():
            return mpi_mod.COMM_WORLD
    except Exception:  # pragma: no cover - a broken MPI is reported by the caller
        return None
    return None


def fail_fast(exc: BaseException, *, code: int | None = None) -> None:
    """Report ``exc`` and end the job: ``MPI_Abort`` when MPI runs with >1 rank, else ``exit``."""
    world = _mpi_world()
    user_error = isinstance(exc, HpcasyncError) and not isinstance(exc, ProcessFailedError)
    if code is None:
        code = 2 if user_error else 1
    _mark_for_supervisor(exc, user_error)
    rank = world.Get_rank() if world is not None else launcher_rank()
    size = world.Get_size() if world is not None else 1
    if world is not None and size == 1 and launcher_rank() != 0:
        world, rank = None, launcher_rank()      # one of N singleton jobs: as before MPI
    if user_error:
        if world is not None and size > 1 and rank != 0:
            time.sleep(FOLLOWER_GRACE_S)      # rank 0's abort ends this if it failed alike
        # Before MPI every rank raises the same error: let rank 0 speak for all of them.
        if world is not None or rank == 0:
            where = f" (rank {rank})" if world is not None and size > 1 else ""
            print(f"hpcasync: error{where}: {exc}", file=sys.stderr, flush=True)
    elif world is not None and _dead_ranks_line(world, exc, rank):
        pass                  # a peer died (ULFM) where nothing survives it: one line said so
    else:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        print(f"hpcasync: rank {rank} failed:\n{text}", file=sys.stderr, flush=True)
    if world is not None and size > 1:
        time.sleep(0.2)     # let the launcher forward our line before its own abort banner
        world.Abort(code)
    if world is None and rank != 0:
        # Before MPI, rank 0 speaks for everyone. If this rank exited first, the launcher would end
        # the job and could kill rank 0 before it printed. So wait: rank 0's exit ends the job (and
        # this sleep) as soon as it has printed; the cap only matters under launchers that do not
        # kill the remaining tasks (plain srun without --kill-on-bad-exit). MPICH's hydra
        # (HYDI_CONTROL_FD set) is such a launcher, but it never kills a task for another's exit,
        # so there the wait protects nothing and only delays the job's end by 15 s.
        if "HYDI_CONTROL_FD" not in os.environ:
            time.sleep(PRE_MPI_FOLLOWER_WAIT_S)
    sys.stdout.flush()
    os._exit(code) if world is not None else sys.exit(code)


def _mark_for_supervisor(exc: BaseException, user_error: bool) -> None:
    """Under ``hpcasync launch`` (``HPCASYNC_SUPERVISOR_DIR`` set): leave ``exit-R`` saying what
    ends this rank — ``error`` (bad input), ``mpi`` (an MPI error: how a peer's death shows
    here), ``interrupt`` or ``crash`` (any other exception) —, so the supervisor restarts after
    deaths only (hpcasync.supervisor.decide)."""
    folder = os.environ.get("HPCASYNC_SUPERVISOR_DIR")
    if not folder:
        return
    mpi_mod = sys.modules.get("mpi4py.MPI")
    if user_error:
        kind = "error"
    elif isinstance(exc, ProcessFailedError) or proc_failure(exc) \
            or (mpi_mod is not None and isinstance(exc, mpi_mod.Exception)):
        kind = "mpi"
    elif isinstance(exc, KeyboardInterrupt):
        kind = "interrupt"
    else:
        kind = "crash"
    message = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
    try:
        with open(os.path.join(folder, f"exit-{launcher_rank()}"), "w", encoding="utf-8") as fh:
            fh.write(json.dumps({"kind": kind, "message": message}) + "\n")
    except OSError:
        pass


def proc_failure(exc: BaseException | None) -> bool:
    """``exc`` (or an exception it was raised from) reports dead processes or a revoked
    communicator (ULFM's ``MPI_ERR_PROC_FAILED``, ``..._PENDING``, ``MPI_ERR_REVOKED``)."""
    mpi_mod = sys.modules.get("mpi4py.MPI")
    if mpi_mod is None:                 # MPI never imported: no MPI error to look at
        return False
    codes = {getattr(mpi_mod, n, None) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                                 "ERR_REVOKED")} - {None}
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ProcessFailedError):
            return True
        if isinstance(exc, mpi_mod.Exception) and exc.Get_error_class() in codes:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def dead_ranks(comm) -> list[int]:
    """Acknowledge the failures known here on ``comm`` (ULFM) and return the dead ranks of
    ``comm``, sorted (empty: none known yet)."""
    comm.Ack_failed()
    return ranks_in(comm.Get_failed(), comm)


def ranks_in(group, comm) -> list[int]:
    """The ranks in ``comm`` of the members of ``group`` that belong to it, sorted; frees
    ``group``."""
    from mpi4py import MPI

    mine = comm.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), mine)
    finally:
        group.Free()
        mine.Free()
    return sorted(int(r) for r in ranks if r != MPI.UNDEFINED)


def _dead_ranks_line(world, exc: BaseException, rank: int) -> bool:
    """For a process failure reported by ULFM (``MPI_ERR_PROC_FAILED``/``REVOKED``, or a
    :class:`ProcessFailedError`) where no recovery applies: print one line naming the dead world
    ranks and return True. Every survivor meets the failure, so the lowest one says it; the
    others first wait :func:`follower_wait` (staggered by their place), which the first
    speaker's ``MPI_Abort`` ends."""
    if not proc_failure(exc):
        return False
    dead = getattr(exc, "dead_ranks", None)
    if not dead:
        try:
            dead = dead_ranks(world)
        except Exception:       # noqa: BLE001 - best effort: the line below still names the failure
            dead = []
    survivors = sorted(set(range(world.Get_size())) - set(dead)) or [rank]
    time.sleep(follower_wait(survivors.index(rank) if rank in survivors else len(survivors)))
    who = f"rank(s) {', '.join(map(str, dead))} died" if dead else "a rank died"
    print(f"hpcasync: error (rank {rank}): {who}; this run cannot survive it here ({exc}); "
          "ending the job", file=sys.stderr, flush=True)
    return True


def run_guarded(main, *args, **kwargs):
    """Run ``main`` and turn any exception into :func:`fail_fast`; returns ``main``'s result."""
    try:
        return main(*args, **kwargs)
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:
        fail_fast(exc, code=130)
    except BaseException as exc:  # noqa: BLE001 - this *is* the last-resort handler
        fail_fast(exc)
