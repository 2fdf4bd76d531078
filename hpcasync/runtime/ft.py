"""Fault tolerance of the parameter server: a worker's death is survived under ULFM; without ULFM
the PS saves a checkpoint when the launcher's SIGTERM arrives and the job ends non-zero.

Two modes (:func:`ulfm_enabled`; logged at the start, ``fault_tolerance`` in the summary):

``ulfm``
    Open MPI started as ``mpirun --with-ft ulfm ...`` (the launcher then sets
    ``OMPI_MCA_mpi_ft_enable=1`` in every process) with an mpi4py that has the ULFM calls. An MPI
    call that involves a dead process returns ``MPI_ERR_PROC_FAILED`` (``..._PENDING`` for a receive
    from ``MPI_ANY_SOURCE``, whose request stays valid) instead of aborting: mpi4py's communicators
    use ``MPI_ERRORS_RETURN`` and raise it as ``MPI.Exception``. The PS-side transport turns that
    into :class:`WorkerFailed` after ``Comm.Ack_failed`` / ``Comm.Get_failed``
    (:func:`failed_ranks`); ``ps.server`` retires the worker (``rule.retire``: SHAT's count,
    DC-ASGD's backup, SMEGA2's N), drops its in-flight push and goes on. Workers talk only to the
    PS and never notice. At the end every survivor calls ``Comm.Shrink`` (:func:`survivors`; an
    agreement, also when nobody died, so every rank takes the same branch) and the end-of-run
    collectives run on the shrunk communicator. ``MPI_Win_free`` is collective over the window's
    whole group, so the RMA windows are freed only when nobody died, and are otherwise left to
    ``MPI_Finalize``. ``topology.ulfm_open_mpi_defaults`` skips the job-wide PMIx fence in
    ``MPI_Finalize``, which after a death can leave the survivors there for good (figures:
    docs/design/ps.md#notes-from-the-code-runtimeftpy).
``none``
    Without ``--with-ft`` Open MPI's launcher (prterun) ends the whole job when one process dies.
    With Open MPI 5.0.11 every survivor gets SIGCONT, SIGTERM 0.25 s later, SIGKILL about 0.25 s
    after that; mpirun exits with a non-zero status (137 for a SIGKILLed rank). The PS writes
    a checkpoint the moment it sees SIGTERM (:class:`SigtermCheckpoint`; the PS state between two
    pushes is a consistent point, and a write takes milliseconds) and logs the command that resumes
    the run, which retrains the dead worker's remaining batches. If the PS is busy for the whole
    quarter second (an epoch's evaluation), the last epoch or ``--checkpoint-every`` checkpoint is
    the resume point; without ``--checkpoint-dir`` the progress is lost (the message says so).

``none`` under MPICH (and the MPIs derived from it)
    ULFM is Open-MPI-only here (:func:`check_ft_request`: ``OMPI_MCA_mpi_ft_enable=1`` under
    another MPI is a one-line ConfigError; hydra itself rejects ``--with-ft``). MPICH's launcher
    (hydra 5.0.2) SIGKILLs every survivor at once when one process dies ("BAD TERMINATION"): no
    SIGTERM comes first, so no checkpoint is written at the death; the resume point is the last
    epoch or ``--checkpoint-every`` checkpoint (``--resume auto`` finds it).

The PS's own death (ULFM): the workers get ``MPI_ERR_PROC_FAILED``, agree on a new server among
themselves (the freshest θ; with ``--ps-ranks K > 1`` the surviving servers join and a dead
shard's slice comes from the freshest reply) and go on (:mod:`hpcasync.ps.takeover`). Without
ULFM the launcher ends the job; the PS dying after its end messages is :class:`PSFailed`, which
``errors.fail_fast`` turns into ``MPI_Abort`` (exit status 2).

The synchronous runtimes (ssgd, odsgd, daso) survive dead ranks under ULFM too:
:mod:`hpcasync.runtime.recovery`.

Tests kill a real process at a known point through :mod:`hpcasync.inject`.

Example::

    if ulfm_enabled():
        comm, lost = survivors(topo.world, True)      # on every surviving rank, after training
"""
from __future__ import annotations

import logging
import shlex
import signal
import sys
from typing import Callable

from .. import launch
from ..launch import FT_ENV, ft_requested  # noqa: F401 (re-exported)
from ..errors import HpcasyncError, dead_ranks, ranks_in as _ranks_in  # noqa: F401 (re-exported)

log = logging.getLogger("hpcasync")



class PSFailed(HpcasyncError):
    """The parameter server died: the run cannot go on (raised on the workers)."""


class WorkerFailed(Exception):
    """Raised by a PS-side transport call when processes of its communicator died (``ranks``)."""

    def __init__(self, ranks: list[int]):
        super().__init__(f"ranks {ranks} died")
        self.ranks = list(ranks)


def check_ft_request(env=None, vendor: str | None = None) -> None:
    """A one-line ConfigError when fault tolerance is asked for under an MPI other than Open MPI
    (hpcasync's ULFM paths are Open-MPI-only). Needs no initialised MPI; every rank raises alike."""
    if ft_requested(env):
        launch.require_open_mpi(f"{FT_ENV}=1 (fault tolerance)", vendor)


def ulfm_enabled() -> bool:
    """True when this process runs under Open MPI's ULFM (``mpirun --with-ft ulfm``) and mpi4py
    exposes the calls the PS needs; ConfigError when ULFM is asked for under another MPI."""
    if not ft_requested():
        return False
    check_ft_request()
    from mpi4py import MPI

    return all(hasattr(MPI.Comm, f) for f in ("Ack_failed", "Get_failed", "Shrink")) \
        and hasattr(MPI, "ERR_PROC_FAILED")


_said_without_ulfm = False


def say_without_ulfm(what: str, rank: int) -> None:
    """One warning line (rank 0, once a process): ``what`` was asked for (a grow-back, a floor on
    the ranks) but this job does not run under ULFM, so a death ends it instead."""
    global _said_without_ulfm
    if _said_without_ulfm or rank != 0:
        return
    _said_without_ulfm = True
    log.warning("%s asked for, but this job does not run under ULFM (`mpirun --with-ft ulfm`): "
                "a dead rank ends it (`hpcasync launch --max-restarts N` restarts it from its "
                "checkpoints)", what)


def describe(ulfm: bool) -> str:
    if ulfm:
        return ("fault tolerance: ULFM (a dead worker is retired; a dead server is replaced by a "
                "worker; a dead rank of a synchronous run is shrunk out)")
    if launch.mpi_vendor() != launch.OPEN_MPI:
        return ("fault tolerance: none (a dead rank ends the job; surviving a worker's death needs "
                "Open MPI's ULFM)")
    return ("fault tolerance: none (start with `mpirun --with-ft ulfm` to survive a worker's "
            "death; without it a dead rank ends the job)")


def failed_ranks(comm, exc: BaseException) -> list[int] | None:
    """For an ``MPI.Exception`` that reports dead processes: acknowledge them on ``comm`` and
    return the ranks (of ``comm``) known dead so far; None for any other exception."""
    from mpi4py import MPI

    codes = {getattr(MPI, n, None) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                             "ERR_REVOKED")} - {None}
    if not isinstance(exc, MPI.Exception) or exc.Get_error_class() not in codes:
        return None
    return dead_ranks(comm)


def survivors(comm, ulfm: bool):
    """Collective over the surviving ranks of ``comm``: ``(comm', lost)`` with ``comm'`` the
    shrunk communicator (``comm`` itself without ULFM) and ``lost`` the ranks of ``comm`` that are
    not in it. Every survivor gets the same answer."""
    if not ulfm:
        return comm, []
    new = comm.Shrink()
    kept = _ranks_in(new.Get_group(), comm)
    return new, sorted(set(range(comm.Get_size())) - set(kept))


def translate(rank: int, src, dst) -> int:
    """Rank ``rank`` of communicator ``src`` as a rank of ``dst`` (-1 when it is not there)."""
    from mpi4py import MPI

    a, b = src.Get_group(), dst.Get_group()
    try:
        r = MPI.Group.Translate_ranks(a, [rank], b)[0]
    finally:
        a.Free()
        b.Free()
    return -1 if r == MPI.UNDEFINED else int(r)


def record_late_deaths(summary: dict, lost: list[int], worker_ranks: list[int]) -> None:
    """Add to ``summary["failed_workers"]`` the ``lost`` ranks (from :func:`survivors`) that the
    PS had not seen die: they died after their last message."""
    known = {f["rank"] for f in summary["failed_workers"]}
    for r in sorted(set(lost) - known):
        w = worker_ranks.index(r)
        summary["failed_workers"].append({"worker": w, "rank": r, "ps_version": summary["pushes"],
                                          "pushes": summary["pushes_per_worker"][w],
                                          "finished": True})
        log.warning("worker %d (rank %d) died after its last push", w, r)


def resume_command(world_size: int, argv: list[str] | None = None) -> str:
    """The command line that resumes this run from its checkpoints (``--resume auto``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--resume":
            skip = True
        elif not a.startswith("--resume="):
            kept.append(a)
    if launch.mpi_vendor() == launch.OPEN_MPI:
        start = ["mpirun", "--with-ft", "ulfm", "-n", str(world_size)]
    else:                       # MPICH's hydra: no ULFM, oversubscribes by default
        start = ["mpiexec", "-n", str(world_size)]
    cmd = [*start, sys.executable, "-m", "hpcasync", *kept, "--resume", "auto"]
    return shlex.join(cmd)


class SigtermCheckpoint:
    """Write a checkpoint as soon as SIGTERM arrives at the PS (without ULFM a dead rank makes the
    launcher SIGTERM, then SIGKILL, every survivor; a scheduler's SIGTERM is followed by SIGKILL
    too). ``poll()`` is called where the PS state is consistent (between pushes, while waiting);
    ``save(kind)`` writes the checkpoint and returns its path (None: no ``--checkpoint-dir``).
    The usual stop protocol runs afterwards and, if it gets the time, writes a newer one."""

    def __init__(self, flag, save: Callable[[str], object] | None, *, world_size: int,
                 ulfm: bool):
        self.flag, self.save = flag, save
        self.world_size, self.ulfm = world_size, ulfm
        self.saved = False

    def poll(self) -> None:
        if self.saved or self.flag is None or self.flag.signum != signal.SIGTERM:
            return
        self.saved = True
        open_mpi = launch.mpi_vendor() == launch.OPEN_MPI
        why = ("SIGTERM (a scheduler's preemption)" if self.ulfm or not open_mpi else
               "SIGTERM (a rank died and Open MPI without `--with-ft ulfm` is ending the job, or "
               "a scheduler preempts it)")
        if self.save is None:
            log.warning("PS: %s without --checkpoint-dir: this run's progress is lost; rerun with "
                        "--checkpoint-dir%s", why, " (and `mpirun --with-ft ulfm` to survive a "
                        "worker's death)" if open_mpi else "")
            return
        path = self.save("signal")
        log.warning("PS: %s: wrote checkpoint %s; if the job ends now, resume with:\n  %s", why,
                    path, resume_command(self.world_size))
        for h in logging.getLogger("hpcasync").handlers + logging.getLogger().handlers:
            h.flush()
