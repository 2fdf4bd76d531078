"""One JSONL metrics stream per run, written by rank 0 (and its numbers as TensorBoard scalars).

Each record is one JSON object on one line, written with a single ``write`` and flushed, so a
reader never sees half a record. While the run is going the stream lives at ``PATH.partial``; it
is renamed to ``PATH`` when the run ends normally (invariant 5: a complete file appears whole). A run
that dies leaves ``PATH.partial`` behind for inspection. Records carry an ``event`` field: ``config``,
``epoch``, ``step``, ``summary`` and runtime-specific ones.

With a TensorBoard directory (``--tensorboard DIR``, ``open_metrics(..., tensorboard=DIR)``) the
writer also puts every record's numbers into an event file in ``DIR`` (:func:`scalars`: the tags,
:meth:`MetricsWriter.tensorboard_step`: the step), one event per record. Its writer thread
flushes them every 2 s and when the writer closes (a flush per record would cost 10x the JSONL's
write on a parameter server logging every push): a writer that dies loses its last 2 s there, not
in the stream.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from .errors import ConfigError


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):      # numpy / torch scalars
        return _jsonable(value.item())
    return value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scalars(record: dict[str, Any]) -> list[tuple[str, float]]:
    """The TensorBoard scalars of one (JSON-ready) record: each int or float field (not bool) as
    ``<event>/<field>``; the numbers of a list field as ``<event>/<field>/<index>`` and of a dict
    field as ``<event>/<field>/<key>`` (one level: deeper values, strings, None are left out).
    A NaN or infinite value is not a number in the JSONL stream (None, "inf") and is left out here
    as well."""
    event = record["event"]
    out = []
    for key, value in record.items():
        tag = f"{event}/{key}"
        if _number(value):
            out.append((tag, value))
        elif isinstance(value, list):
            out.extend((f"{tag}/{i}", v) for i, v in enumerate(value) if _number(v))
        elif isinstance(value, dict):
            out.extend((f"{tag}/{k}", v) for k, v in value.items() if _number(v))
    return out


def require_tensorboard(flag: str):
    """torch's ``SummaryWriter``; ConfigError naming ``flag`` and the fix when the ``tensorboard``
    package is missing (checked on every rank before training: no rank waits on one that failed)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(f"{flag} needs the tensorboard package: "
                          "pip install hpcasync[tensorboard] (or pip install tensorboard)") from None
    return SummaryWriter


class MetricsWriter:
    """Append-only JSONL writer, and TensorBoard writer when ``tensorboard`` names a directory; a
    no-op on ranks other than the writer or when neither ``path`` nor ``tensorboard`` is given.

    ``keep_previous``: a stream already at ``path`` (the run a resume goes on from) is moved to
    the first free ``PATH.N`` (:attr:`kept`) when this one is complete, instead of being
    replaced (a run that fails leaves it where it is).

    Example::

        with MetricsWriter("run.jsonl", enabled=rank == 0, tensorboard="runs/tb") as m:
            m.write("epoch", epoch=1, test_accuracy=0.87)
    """

    def __init__(self, path: str | os.PathLike | None, *, enabled: bool = True,
                 tensorboard: str | os.PathLike | None = None, keep_previous: bool = False):
        self.path = Path(path) if path is not None else None
        if self.path is not None:                  # the stream while it is written
            self.partial = self.path.with_name(self.path.name + ".partial")
        self.tensorboard = Path(tensorboard) if tensorboard is not None else None
        if self.tensorboard is not None:
            require_tensorboard("tensorboard=")
        self.enabled = enabled and self.requested
        self.t0 = time.time()
        self._fh = None
        self._tb = None                      # torch's FileWriter of the SummaryWriter
        self._summary = None                 # TensorBoard's Summary message class
        self.tb_file: Path | None = None     # this writer's TensorBoard event file
        self.epochs: set = set()      # epochs whose ``epoch`` record is in the stream
        self.counts: dict[str, int] = {}     # records written per event
        self.keep_previous = keep_previous
        self.kept: Path | None = None        # where an earlier stream at ``path`` was moved
        if self.enabled:
            self._open("w")

    @property
    def requested(self) -> bool:
        """A stream or a TensorBoard directory was asked for (the same on every rank)."""
        return self.path is not None or self.tensorboard is not None

    def _open(self, mode: str) -> None:
        if self.path is not None:
            self._fh = open(self.partial, mode, encoding="utf-8")
        if self.tensorboard is not None:
            from tensorboard.compat.proto.summary_pb2 import Summary

            self._summary = Summary
            writer = require_tensorboard("tensorboard=")(str(self.tensorboard), flush_secs=2)
            self._tb = writer.file_writer
            name = getattr(self._tb.event_writer, "_file_name", None)
            self.tb_file = Path(name) if name else None

    def reopen_append(self) -> None:
        """Become the writer of this stream on another rank (its writer died, ULFM recovery):
        append to the existing ``.partial`` file (on a shared file system), and write a new event
        file into the TensorBoard directory, counting each event's records on from the stream's
        (with no JSONL stream to read, from 0)."""
        if not self.requested or self._fh is not None or self._tb is not None:
            return
        if self.path is not None:
            try:
                with open(self.partial, encoding="utf-8") as fh:
                    for line in fh:
                        if line.strip():
                            self._count(json.loads(line))
            except (OSError, ValueError):        # a torn last line: the records before it count
                pass
        self._open("a")
        self.enabled = True

    def _count(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event == "epoch":
            self.epochs.add(record.get("epoch"))
        self.counts[event] = self.counts.get(event, 0) + 1

    def tensorboard_step(self, record: dict[str, Any]) -> int:
        """The step of ``record``'s scalars: its ``epoch`` for an ``epoch`` record, else its
        ``step`` field, else how many records of its event the stream held before it."""
        epoch, step = record.get("epoch"), record.get("step")
        if record["event"] == "epoch" and isinstance(epoch, int) and not isinstance(epoch, bool):
            return epoch
        if isinstance(step, int) and not isinstance(step, bool):
            return step
        return self.counts.get(record["event"], 0)

    def write(self, event: str, **fields: Any) -> None:
        if not self.enabled:
            return
        record = _jsonable({"event": event, "time_s": round(time.time() - self.t0, 4), **fields})
        if self._fh is not None:
            self._fh.write(json.dumps(record, allow_nan=False) + "\n")
            self._fh.flush()
        if self._tb is not None:        # one event per record: a quarter of add_scalar's cost a value
            Summary = self._summary
            values = [Summary.Value(tag=tag, simple_value=v) for tag, v in scalars(record)]
            self._tb.add_summary(Summary(value=values), self.tensorboard_step(record))
        self._count(record)

    def close(self, *, complete: bool = True) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._fh is None:
            return
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        if complete:
            if self.keep_previous and self.path.exists():
                self.kept = _free_name(self.path)
                os.replace(self.path, self.kept)
            os.replace(self.partial, self.path)

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc_type is None)


def _free_name(path: Path) -> Path:
    """``PATH.1``, ``PATH.2``, ...: the first that does not exist."""
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    return path.with_name(f"{path.name}.{n}")


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a finished (or ``.partial``) stream."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
