"""A rank that dies before MPI is up ends the job within seconds, with one line naming it.

Under ULFM (``mpirun --with-ft ulfm``) Open MPI's launcher does not end a job whose process died,
and ``MPI_Init`` waits in a job-wide PMIx fence for every rank. A rank killed before it reaches
that fence (while importing, reading its options, loading the data) leaves the others in
``MPI_Init`` for good, holding the GIL, so no Python thread of theirs can act (Open MPI 5.0.11).
Once ``MPI_Init`` has returned, ULFM reports a dead rank to the collective that meets
it and :func:`hpcasync.errors.fail_fast` ends the job; this module covers the time before.

:func:`watch` (the CLI, first thing; under ULFM only) forks a small watcher. Until its rank says
:func:`done` (``MPI_Init`` returned), the watcher looks every :data:`POLL_S` seconds at the job's
ranks on this host (processes whose ``PMIX_NAMESPACE`` is this job's). A rank that was there and
is gone, or one of this host's ranks never seen at all (killed before the first look), died: the
watcher of the lowest surviving rank prints one line ``hpcasync: error (rank R): rank(s) D died
during start-up ...`` and ends the job's ranks here (SIGTERM, which ends a rank with exit status
15 even inside ``MPI_Init``: :func:`_exit_on`; then SIGKILL), so the job ends, non-zero. A rank
that ends on purpose (an option error: rank 0 prints it and exits) first leaves a mark
(:data:`MARK`, at interpreter exit), so its peers do not take it for a death.

Ranks on other hosts are invisible here: where the job spans hosts, a rank still in ``MPI_Init``
after :data:`TIMEOUT_ENV` seconds (default 300; data loading before it can be slow) ends the
job with a line saying so.

Without ULFM nothing is started: the launcher ends the job when a rank dies (Open MPI's prterun:
``prterun noticed that process rank R ... exited on signal 9``; MPICH's hydra: ``BAD
TERMINATION ... RANK R``).

Example (the CLI's order)::

    startup.watch()          # before anything slow
    ...                      # options, data, model checks
    init_mpi(); startup.done()
"""
from __future__ import annotations

import atexit
import os
import select
import signal
import sys
import tempfile
import time

from .. import environ
from ..launch import ft_requested

POLL_S = 0.25
#: a rank of this host not seen after this long (from the watcher's start) died before the look
NEVER_SEEN_S = 3.0
#: seconds a rank may wait in MPI_Init for ranks on other hosts before the job ends
TIMEOUT_ENV = "HPCASYNC_STARTUP_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
#: how long a watcher that does not speak waits for the one that does to end the ranks
END_GRACE_S = 5.0
#: the file (in the launcher's session directory) left by a rank that exits on purpose in start-up
MARK = "hpcasync-{job}-exit-{rank}"

_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK")
#: the signals of a crash: in start-up they end the rank with that number as its exit status
#: (a death by signal is a success to the ULFM launcher; Open MPI 5.0.11's MPI_Init can crash
#: on every survivor when a peer dies inside it)
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE, signal.SIGILL)
_state: dict = {}


def _int(env: dict, *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return None


def watch() -> None:
    """Fork the start-up watcher (module doc) when this process is a rank of a ULFM job of more
    than one rank under a PMIx launcher; a no-op otherwise, and after the first call."""
    env = os.environ
    if _state or not ft_requested(env) or "PMIX_NAMESPACE" not in env:
        return
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        return                  # MPI is up already: ULFM reports deaths from here
    rank, size = _int(env, *_RANK_VARS), _int(env, "OMPI_COMM_WORLD_SIZE")
    if rank is None or size is None or size < 2:
        return
    namespace = env["PMIX_NAMESPACE"]
    marks = os.path.join(env.get("PMIX_SERVER_TMPDIR") or tempfile.gettempdir(),
                         MARK.format(job="".join(c if c.isalnum() else "_" for c in namespace),
                                     rank="{rank}"))
    job = {"namespace": namespace, "rank": rank, "size": size, "marks": marks,
           "local_size": _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") or 0, "timeout": _timeout(env)}
    term = _exit_on(signal.SIGTERM)     # first: the watcher may end this rank at any moment
    crash = _on_crash()
    read, write = os.pipe()
    try:
        pid = os.fork()
    except OSError:             # no watcher: the job is as it was before this module
        os.close(read)
        os.close(write)
        _restore(signal.SIGTERM, term)
        _restore_crash(crash)
        return
    if pid == 0:                # the watcher
        code = 0
        try:
            os.close(write)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            _Watcher(read, os.getppid(), **job).run()
        except BaseException:   # noqa: BLE001 - a watcher's own failure must not end the rank
            code = 1
        finally:
            os._exit(code)
    os.close(read)
    _state.update(pid=pid, pipe=write, mark=marks.format(rank=rank), term=term, crash=crash)
    atexit.register(_mark_exit)


def entering_mpi() -> None:
    """This rank is about to call ``MPI_Init`` (starts the other-hosts timeout)."""
    _send(b"i")


def done() -> None:
    """``MPI_Init`` returned on this rank: from here ULFM reports deaths; stop the watcher."""
    if "pipe" not in _state:
        return
    _send(b"u")
    os.close(_state.pop("pipe"))
    _restore(signal.SIGTERM, _state.pop("term", None))
    _restore_crash(_state.pop("crash", None))
    pid = _state.get("pid")
    for _ in range(100):                # reap it (it exits at once); never wait long
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
        except ChildProcessError:
            break
        time.sleep(0.01)


def _send(what: bytes) -> bool:
    fd = _state.get("pipe")
    if fd is None:
        return False
    try:
        os.write(fd, what)
    except OSError:
        return False
    return True


def _mark_exit() -> None:
    """At interpreter exit before :func:`done`: leave the mark that says this rank ended on
    purpose (a SIGKILL never gets here)."""
    if _state.get("pipe") is None:
        return
    try:
        with open(_state["mark"], "w"):
            pass
    except OSError:
        pass


def _exit_on(signum: int):
    """Make ``signum`` end this process at once with exit status ``signum`` (SIGTERM: 15), even
    while it is inside ``MPI_Init`` holding the GIL, where no Python handler can run: libc's
    ``_exit`` is itself the C handler (it takes the signal number as its status and is
    async-signal-safe). Under ULFM the launcher reports a job whose ranks were killed by a signal
    as a success (exit 0); a rank's non-zero exit status makes it a failure. Not SIGHUP
    (status 1): UCX, loaded inside ``MPI_Init``, takes SIGHUP for its debug mode. Returns the
    previous C handler for :func:`_restore` (None: not installed)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        previous = libc.signal(signum, ctypes.cast(libc._exit, ctypes.c_void_p).value)
    except (OSError, AttributeError):
        return None
    return {"libc": libc, "handler": previous}


def _restore(signum: int, saved) -> None:
    if saved is not None:
        saved["libc"].signal(signum, saved["handler"])


def _on_crash() -> dict:
    """Until :func:`done`: a crash (:data:`CRASH_SIGNALS`) ends this rank with the signal's
    number as exit status (:func:`_exit_on`), after faulthandler's traceback when it is on
    (re-enabled over the new handlers, which it then calls). Returns what
    :func:`_restore_crash` puts back."""
    import faulthandler

    fault = faulthandler.is_enabled()
    if fault:
        faulthandler.disable()
    saved = {signum: _exit_on(signum) for signum in CRASH_SIGNALS}
    if fault:
        faulthandler.enable(all_threads=True)
    return {"saved": saved, "fault": fault}


def _restore_crash(crash: dict | None) -> None:
    if crash is None:
        return
    import faulthandler

    if crash["fault"]:
        faulthandler.disable()
    for signum, saved in crash["saved"].items():
        _restore(signum, saved)
    if crash["fault"]:
        faulthandler.enable(all_threads=True)


def _timeout(env) -> float:
    return environ.seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, env)


class _Watcher:
    """The forked watcher's loop (module doc). ``peers``: rank -> (pid, start time) of the job's
    ranks seen on this host; ``marks``: the :data:`MARK` path with ``{rank}`` to fill in."""

    def __init__(self, pipe: int, parent: int, *, namespace: str, rank: int, size: int,
                 local_size: int, marks: str, timeout: float):
        self.pipe, self.parent, self.rank, self.size = pipe, parent, rank, size
        self.local_size, self.marks, self.timeout = local_size, marks, timeout
        self.key = b"\0PMIX_NAMESPACE=" + namespace.encode() + b"\0"
        self.peers: dict[int, tuple[int, str]] = {}
        self.local: set[int] = set()          # local indices seen (OMPI_COMM_WORLD_LOCAL_RANK)
        self.t0, self.in_mpi = time.monotonic(), None
        self.launcher = (_stat(parent) or (None, None, None))[1]   # the ranks' parent here

    def run(self) -> None:
        while True:
            ready, _, _ = select.select([self.pipe], [], [], POLL_S)
            if ready:
                msg = os.read(self.pipe, 16)
                if b"u" in msg:                     # MPI is up
                    return
                if not msg:                         # the rank is gone: on purpose if marked
                    if not self._marked(self.rank):
                        self._end_after(f"rank(s) {self.rank} died during start-up, before MPI "
                                        "was up on every rank")
                    return
                self.in_mpi = self.in_mpi or time.monotonic()
            if not self.local_size or len(self.peers) < self.local_size:
                self._scan()
            dead = self._dead()
            if dead:
                return self._end(f"rank(s) {', '.join(dead)} died during start-up, before MPI "
                                 "was up on every rank")
            if (self.local_size and self.local_size < self.size and self.in_mpi is not None
                    and time.monotonic() - self.in_mpi > self.timeout):
                return self._end(f"MPI_Init waited {self.timeout:.0f} s ({TIMEOUT_ENV}) for "
                                 "ranks on other hosts: did one die during start-up?")

    def _scan(self) -> None:
        """Find the job's ranks on this host (their children, this watcher among them, share
        the environment: a process whose parent is one of them is left out)."""
        found: dict[int, tuple[int, int | None]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as fh:
                    raw = b"\0" + fh.read() + b"\0"
            except OSError:
                continue
            if self.key not in raw:
                continue
            env = dict(item.decode(errors="replace").partition("=")[::2]
                       for item in raw.split(b"\0") if b"=" in item)
            rank = _int(env, *_RANK_VARS)
            if rank is not None:
                found[int(name)] = (rank, _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"))
        for pid, (rank, local) in found.items():
            stat = _stat(pid)
            if stat is None or stat[1] in found or rank in self.peers:
                continue
            self.peers[rank] = (pid, stat[2])
            if local is not None:
                self.local.add(local)

    def _alive(self) -> dict[int, int]:
        return {r: pid for r, (pid, start) in self.peers.items()
                if (_stat(pid) or (None, None, None))[2] == start}

    def _dead(self) -> list[str]:
        """The dead ranks of this host (as words): gone since seen, or never seen (one host: by
        rank; several: by local index). A rank that left its mark ended on purpose."""
        alive = self._alive()
        if self.peers.get(self.rank) and self.rank not in alive:
            return []               # this rank itself is gone: the pipe's end says so next
        dead = [r for r in self.peers if r not in alive and not self._marked(r)]
        missing = []
        if self.local_size and len(self.peers) < self.local_size \
                and time.monotonic() - self.t0 > NEVER_SEEN_S \
                and _children(self.launcher) < self.local_size:   # not one still starting
            if self.local_size == self.size:        # one host: the missing ranks are known
                dead += [r for r in range(self.size) if r not in self.peers
                         and not self._marked(r)]
            elif not any(self._marked(r) for r in range(self.size)):
                missing = [f"the one of local index {i} on this host"
                           for i in range(self.local_size) if i not in self.local]
        return [str(r) for r in sorted(set(dead))] + missing

    def _marked(self, rank: int) -> bool:
        return os.path.exists(self.marks.format(rank=rank))

    def _end(self, what: str) -> None:
        """End the job's ranks here, one line said first. The watcher of the lowest rank alive
        here acts at once; the others wait :data:`END_GRACE_S` for it (their rank is ended, or
        MPI came up) before acting themselves. Of those that act, the one that creates the
        ``ending`` mark first says the line and ends every rank here; the others end their
        own."""
        alive = self._alive()
        if self.rank not in alive:
            return                  # this rank is gone already: nothing to say or do
        if self.rank != min(alive):
            end = time.monotonic() + END_GRACE_S
            while time.monotonic() < end:
                ready, _, _ = select.select([self.pipe], [], [], max(0.0, end - time.monotonic()))
                if ready:
                    msg = os.read(self.pipe, 16)
                    if not msg or b"u" in msg:
                        return
            alive = self._alive()
        victims = [self.parent]
        if self._say(what):         # (else another watcher said it)
            victims = [p for r, p in alive.items() if r != self.rank] + victims
        _end_processes({pid: (_stat(pid) or (None, None, None))[2] for pid in victims})

    def _end_after(self, what: str) -> None:
        """This watcher's rank died (killed, or crashed: :func:`_on_crash`): unless another
        watcher already said a death, say ``what`` and end this host's other ranks of the job
        (a survivor left alone in ``MPI_Init`` waits there for good; all of them crashed: the
        job would otherwise end without a word)."""
        if not self.peers or len(self.peers) < (self.local_size or 0):
            self._scan()
        if self._say(what):         # (else another watcher said it and ends the ranks)
            _end_processes({pid: start for r, (pid, start) in self.peers.items()
                            if r != self.rank})

    def _say(self, what: str) -> bool:
        """Say ``what`` in the job's one line, unless another watcher has (the ``ending``
        mark, made once); True when this one said it."""
        try:
            os.close(os.open(self.marks.format(rank="ending"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except OSError:
            return False
        print(f"hpcasync: error (rank {self.rank}): {what}; this run cannot survive it; "
              "ending the job", file=sys.stderr, flush=True)
        time.sleep(0.3)             # let the launcher forward the line before the ranks go
        return True


def _end_processes(victims: dict) -> None:
    """SIGTERM (exit status 15), then SIGKILL what is left, each of ``victims`` (pid -> start
    time) that is still the process seen then."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, start in victims.items():
            if start is not None and (_stat(pid) or (None, None, None))[2] == start:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        time.sleep(0.5)


def _children(pid: int | None) -> int:
    """How many live processes ``pid`` has as their parent (a large number when not known)."""
    if pid is None:
        return 1 << 30
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit() and (_stat(int(name)) or (None, None))[1] == pid:
            count += 1
    return count


def _stat(pid: int):
    """``(state, parent pid, start time)`` of a live (non-zombie) process, else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[0], int(fields[1]), fields[19]
