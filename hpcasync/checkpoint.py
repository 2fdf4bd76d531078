"""Atomic, verifiable checkpoints, and an agreed stop on preemption.

A checkpoint file is a ``torch.save`` of plain data only — tensors, ints, floats, bools, str, None,
lists, tuples and dicts with str/int keys — so ``torch.load(path, weights_only=True)`` reads it and
loading never runs code from the file. Its top level is::

    {"header": {"format": "hpcasync-checkpoint", "version": 1, "algorithm": …, "model": …,
                "world_size": …, "epoch": …, "step": …, "created": …, "torch": …,
                "allreduce_auto": {…}, …},
     "sha256": "<hex>", "payload": <the state dict>}

Example::

    mgr = CheckpointManager("runs/ckpt", keep=3)
    found = mgr.load_latest(expect={"algorithm": "ssgd", "world_size": 4})
    start = found[1]["epoch"] + 1 if found else 0
    flag = PreemptionFlag()                 # SIGTERM / SIGUSR1 set a flag
    for step in ...:
        if step % 20 == 0 and flag.agree(comm):      # every rank stops at the same step
            mgr.save(state, epoch=e, step=step, algorithm="ssgd", world_size=4)
            sys.exit(EXIT_PREEMPTED)

``allreduce_auto`` (when the run reduced with ``auto``) holds its per-class choices; reading the
file pins them (:mod:`hpcasync.comm.tune`), so a resume sums in the same order.

Design: docs/design/checkpoints.md#checkpoint-files (the checksum, atomic writes, names).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import re
import signal
import struct
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterable

import torch

from . import __version__
from .errors import CheckpointError

log = logging.getLogger("hpcasync")

__all__ = ["FORMAT", "VERSION", "EXIT_PREEMPTED", "save_checkpoint", "load_checkpoint",
           "read_checkpoint", "latest_checkpoint", "checkpoint_name", "CheckpointManager",
           "PreemptionFlag"]

FORMAT = "hpcasync-checkpoint"
VERSION = 1
#: Exit status of a run that stopped at a checkpoint because of a preemption signal (EX_TEMPFAIL:
#: "try again"); the sbatch templates requeue the job on it.
EXIT_PREEMPTED = 75

_TORCH_ADVICE = ("Weights only load failed", "(1)", "(2)", "Check the documentation",
                 "In PyTorch", "Please file an issue")
_NAME = re.compile(r"^ckpt-e(\d{4,})-s(\d{8,})\.pt$")
_HEADER_KEYS = ("algorithm", "model", "world_size", "epoch", "step")


def checkpoint_name(epoch: int, step: int) -> str:
    return f"ckpt-e{epoch:04d}-s{step:08d}.pt"


# --- validation and canonical hash ------------------------------------------------------------

#: the key of a checkpoint's list of each rank's own state (local SGD's optimizer state and
#: replica, PowerSGD's error memory), index = the writing job's rank
PER_RANK = "per_rank"


def gather_own(comm, local) -> list | None:
    """Collective over ``comm``: every rank's ``local()`` (its optimizer's
    ``local_state_dict()``) on rank 0, as the checkpoint's :data:`PER_RANK` list; None there
    when no rank holds anything of its own (and on the other ranks)."""
    from .comm.objects import gather_object

    parts = gather_object(comm, local(), 0)
    return parts if parts is not None and any(x is not None for x in parts) else None


def own_part(parts: list | None, rank: int, size: int, what: str) -> Any:
    """This rank's entry of a checkpoint's :data:`PER_RANK` list when the checkpoint was written
    by a job of ``size`` ranks, else None (rank 0 says once that every rank goes on from rank
    0's state; ``what`` names the reader)."""
    if parts is None:
        return None
    if len(parts) == size:
        return parts[rank]
    if rank == 0:
        log.warning("%s: the checkpoint holds the own state (optimizer momentum or moments, local "
                    "SGD's replicas, PowerSGD's error memory) of %d ranks, this job has %d: every "
                    "rank goes on from rank 0's (not a bitwise replay of an uninterrupted run)",
                    what, len(parts), size)
    return None


def _check_plain(obj: Any, where: str) -> Any:
    """``obj`` with tensors detached and scalar subclasses made plain; CheckpointError for
    anything that is not plain data."""
    if obj is None:
        return obj
    for kind in (bool, int, float, str):    # subclasses (numpy.float64, TorchVersion, enums) would
        if isinstance(obj, kind):           # pickle as their class, which weights_only refuses
            return obj if type(obj) is kind else kind(obj)
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_quantized:
            raise CheckpointError(f"checkpoint state {where}: only dense tensors can be saved")
        return obj.detach()
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CheckpointError(f"checkpoint state {where}: dict key {k!r} is not str or int")
            out[_check_plain(k, where)] = _check_plain(v, f"{where}[{k!r}]")
        return out
    if isinstance(obj, (list, tuple)):
        items = [_check_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise CheckpointError(f"checkpoint state {where}: {type(obj).__name__} cannot be saved "
                          "(only tensors, int, float, bool, str, None, lists, tuples, dicts)")


def _feed(h, obj: Any) -> None:
    """Feed a canonical, type-tagged encoding of ``obj`` to the hash ``h``."""
    if obj is None:
        h.update(b"N")
    elif isinstance(obj, bool):
        h.update(b"b1" if obj else b"b0")
    elif isinstance(obj, int):
        s = str(obj).encode()
        h.update(b"i" + struct.pack("<Q", len(s)) + s)
    elif isinstance(obj, float):
        h.update(b"f" + struct.pack("<d", obj))
    elif isinstance(obj, str):
        s = obj.encode("utf-8", "surrogatepass")
        h.update(b"s" + struct.pack("<Q", len(s)) + s)
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        meta = f"{t.dtype}|{tuple(t.shape)}".encode()
        h.update(b"t" + struct.pack("<Q", len(meta)) + meta)
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        h.update(b"d" + struct.pack("<Q", len(obj)))
        for k, v in obj.items():        # insertion order is preserved by save and load
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update((b"l" if isinstance(obj, list) else b"u") + struct.pack("<Q", len(obj)))
        for v in obj:
            _feed(h, v)
    else:  # only reachable with a loaded file whose structure was tampered with
        raise CheckpointError(f"unexpected {type(obj).__name__} in checkpoint")


def _digest(header: dict, payload: Any) -> str:
    h = hashlib.sha256()
    _feed(h, header)
    _feed(h, payload)
    return h.hexdigest()


# --- save / load --------------------------------------------------------------------------------

def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    with contextlib.suppress(OSError):     # not every file system syncs a directory
        os.fsync(fd)
    os.close(fd)


def save_checkpoint(path: str | os.PathLike, state: dict, *, algorithm: str | None = None,
                    model: str | None = None, world_size: int | None = None,
                    epoch: int | None = None, step: int | None = None,
                    extra: dict | None = None) -> Path:
    """Write ``state`` to ``path`` atomically; returns the path.

    Args:
        state: plain data (see the module doc); anything else raises CheckpointError before
            anything is written.
        algorithm, model, world_size, epoch, step: header fields that :func:`load_checkpoint`'s
            ``expect`` compares against (None: not recorded).
        extra: more header fields (plain data).
    """
    path = Path(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint state must be a dict, not {type(state).__name__}")
    payload = _check_plain(state, "state")
    header = {"format": FORMAT, "version": VERSION, "algorithm": algorithm, "model": model,
              "world_size": world_size, "epoch": epoch, "step": step,
              "created": round(time.time(), 3), "hpcasync": __version__,
              "torch": str(torch.__version__)}
    used = _allreduce_choices()
    if used:            # how ``auto`` reduced: a resume reduces alike (comm.tune.pin)
        header["allreduce_auto"] = used
    if extra:
        clash = set(extra) & set(header)
        if clash:
            raise CheckpointError(f"checkpoint extra header fields clash with {sorted(clash)}")
        header.update(_check_plain(dict(extra), "extra"))
    blob = {"header": header, "sha256": _digest(header, payload), "payload": payload}
    directory = path.parent if str(path.parent) else Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(blob, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    return path


def read_checkpoint(path: str | os.PathLike, *, expect: dict | None = None,
                    map_location: str | torch.device = "cpu") -> tuple[dict, dict]:
    """``(header, state)`` of a checkpoint, verified; raises CheckpointError (one line) for a
    missing, truncated, corrupt, foreign or (given ``expect``) mismatching file.

    ``expect`` maps header fields (algorithm, model, world_size, …) to the values they must have.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read ({exc.strerror})") from None
    if not data:
        raise CheckpointError(f"checkpoint {path}: empty file (truncated)")
    try:
        with warnings.catch_warnings():       # a damaged pickle makes torch warn before failing
            warnings.simplefilter("ignore")
            blob = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for bad files
        text = str(exc)
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        # torch wraps weights-only failures in paragraphs of advice: keep the line naming the cause
        detail = [ln for ln in lines if not ln.startswith(_TORCH_ADVICE)] or lines or [repr(exc)]
        first = detail[0]
        if not data.startswith(b"PK"):           # torch.save writes a zip archive: PK\3\4...
            problem = ("truncated" if b"PK\x03\x04".startswith(data)
                       else "not a checkpoint file (not a torch zip archive)")
        elif "Weights only load failed" in text and "unsupported" in text.lower():
            problem = "refused: holds objects other than plain data (unsafe or corrupt; not loaded)"
        else:
            problem = f"truncated or corrupt ({first[:120]})"
        raise CheckpointError(f"checkpoint {path}: {problem}") from None
    if not (isinstance(blob, dict) and isinstance(blob.get("header"), dict)
            and blob["header"].get("format") == FORMAT):
        raise CheckpointError(f"checkpoint {path}: not an hpcasync checkpoint "
                              "(or its header is damaged)")
    header = blob["header"]
    if header.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {path}: format version {header.get('version')!r} "
                              f"is not supported (this hpcasync reads version {VERSION})")
    payload, stored = blob.get("payload"), blob.get("sha256")
    try:
        actual = _digest(header, payload)
    except CheckpointError:
        actual = None
    if not isinstance(payload, dict) or stored != actual:
        raise CheckpointError(f"checkpoint {path}: corrupt (checksum mismatch)")
    _check_expected(path, header, expect)
    if "allreduce_auto" in header:
        from .comm import tune
        tune.pin(header["allreduce_auto"])
    return header, payload


def _check_expected(path, header: dict, expect: dict | None) -> None:
    """One line when a header field differs from what ``expect`` asks."""
    for key, want in (expect or {}).items():
        if header.get(key) != want:
            raise CheckpointError(f"checkpoint {path}: {key} is {header.get(key)!r}, "
                                  f"this run has {want!r}")


def _allreduce_choices() -> dict:
    """``auto``'s choices of this process (comm.tune.in_use), if the comm layer was loaded."""
    tune = sys.modules.get("hpcasync.comm.tune")
    return tune.in_use() if tune is not None else {}


def read_once(read, *, root: bool, bcast, what: str):
    """``read()`` on the ``root`` rank alone, its result broadcast by ``bcast(obj)`` (collective:
    every rank calls it): one read of a file that may hold a large model, not one a rank. An
    exception there is raised on every rank, in the same line (a
    :class:`~hpcasync.errors.CheckpointError`; ``what`` starts any other's line)."""
    got = None
    if root:
        try:
            got = ("found", read())
        except Exception as exc:        # noqa: BLE001 - said on every rank, none left waiting
            got = ("error", exc if isinstance(exc, CheckpointError) else CheckpointError(
                f"{what}: {type(exc).__name__}: {exc}"))
    kind, value = bcast(got)
    if kind == "error":
        raise value
    return value


def load_checkpoint(path: str | os.PathLike, *, expect: dict | None = None,
                    map_location: str | torch.device = "cpu") -> dict:
    """The verified state of a checkpoint (see :func:`read_checkpoint`)."""
    return read_checkpoint(path, expect=expect, map_location=map_location)[1]


def _candidates(directory: Path) -> list[tuple[int, int, Path]]:
    found = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    for p in entries:
        m = _NAME.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), int(m.group(2)), p))
    return sorted(found, key=lambda t: (t[0], t[1]), reverse=True)


def _load_latest(directory: Path, expect: dict | None) -> tuple[Path, dict, dict] | None:
    for _, _, path in _candidates(Path(directory)):
        try:
            header, state = read_checkpoint(path)
        except CheckpointError as exc:
            log.warning("skipping %s", exc)
            continue
        _check_expected(path, header, expect)    # an intact file that does not fit: an error
        return path, header, state
    return None


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest (by epoch, step) complete checkpoint in ``directory``, or None. Temp and
    unrelated files are ignored; a file that fails verification is skipped with a warning."""
    found = _load_latest(Path(directory), None)
    return found[0] if found else None


class CheckpointManager:
    """Checkpoints of one run in one directory, keeping the newest ``keep`` (default 3).

    Only one rank should save (the caller decides which).
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3):
        if keep < 1:
            raise CheckpointError(f"checkpoint keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep

    def save(self, state: dict, epoch: int, step: int, **header: Any) -> Path:
        """Save as ``ckpt-e{epoch}-s{step}.pt`` (header fields as in :func:`save_checkpoint`),
        then delete all but the newest ``keep`` checkpoints and stale temp files."""
        known = {k: header.pop(k) for k in ("algorithm", "model", "world_size", "extra")
                 if k in header}
        if header:
            known.setdefault("extra", {}).update(header)
        path = save_checkpoint(self.directory / checkpoint_name(epoch, step), state,
                               epoch=epoch, step=step, **known)
        self.prune()
        return path

    def prune(self) -> None:
        for _, _, old in _candidates(self.directory)[self.keep:]:
            old.unlink(missing_ok=True)
        cutoff = time.time() - 3600       # temp files of writers that died an hour ago or more
        for p in self.directory.glob(".ckpt-*.tmp"):
            with contextlib.suppress(OSError):
                if p.stat().st_mtime < cutoff:
                    p.unlink()

    def checkpoints(self) -> list[Path]:
        """Checkpoint files, newest first (not verified)."""
        return [p for _, _, p in _candidates(self.directory)]

    def latest(self) -> Path | None:        # the newest valid one
        return latest_checkpoint(self.directory)

    def load_latest(self, expect: dict | None = None) -> tuple[Path, dict, dict] | None:
        """``(path, header, state)`` of the newest valid checkpoint, or None when there is none."""
        return _load_latest(self.directory, expect)


class PreemptionFlag:
    """A flag set by SIGTERM / SIGUSR1 (Slurm's preemption and time-limit warnings).

    The handler only stores the signal number (Python runs it between bytecodes of the main
    thread; nothing in it can deadlock). Ranks receive the signal at different moments, so poll
    with :meth:`agree` — a one-integer allreduce (logical OR) — every N steps (say every 10-50:
    its cost is one small latency-bound collective) and stop when it returns True: then every rank
    stops at the same step and can take part in the final checkpoint.

    Example::

        with PreemptionFlag() as flag:
            for step, batch in enumerate(loader):
                ...
                if step % 20 == 0 and flag.agree(comm):
                    save(); sys.exit(EXIT_PREEMPTED)
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1), *,
                 install: bool = True):
        self.signals = tuple(signals)
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        if install:
            self.install()

    def _handler(self, signum, frame) -> None:
        self.signum = signum

    def install(self) -> None:
        """Install the handlers (main thread only); the previous ones come back on restore()."""
        for s in self.signals:
            if s not in self._previous:
                self._previous[s] = signal.signal(s, self._handler)

    def restore(self) -> None:
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        """True once a signal arrived here (or :meth:`agree` found one on another rank)."""
        return self.signum is not None

    def agree(self, comm) -> bool:
        """Collective over ``comm``: True on every rank if any rank's flag is set."""
        import numpy as np
        from mpi4py import MPI

        buf = np.array([1 if self.requested else 0], dtype=np.int32)
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
        if buf[0] and self.signum is None:
            self.signum = 0          # set elsewhere; 0 means "agreed, not received here"
        return bool(buf[0])

    def __enter__(self) -> "PreemptionFlag":
        return self

    def __exit__(self, *exc) -> None:  # the previous handlers come back
        self.restore()
