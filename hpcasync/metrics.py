"""One JSONL metrics stream per run, written by rank 0.

Each record is one JSON object on one line, written with a single ``write`` and flushed, so a
reader never sees half a record. While the run is going the stream lives at ``PATH.partial``; it
is renamed to ``PATH`` when the run ends normally (invariant 5: a complete file appears whole). A run
that dies leaves ``PATH.partial`` behind for inspection. Records carry an ``event`` field: ``config``,
``epoch``, ``step``, ``summary`` and runtime-specific ones.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


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


class MetricsWriter:
    """Append-only JSONL writer; a no-op on ranks other than the writer or when ``path`` is None.

    Example::

        with MetricsWriter("run.jsonl", enabled=rank == 0) as m:
            m.write("epoch", epoch=1, test_accuracy=0.87)
    """

    def __init__(self, path: str | os.PathLike | None, *, enabled: bool = True):
        self.path = Path(path) if path is not None else None
        self.enabled = enabled and self.path is not None
        self.t0 = time.time()
        self._fh = None
        self.epochs: set = set()      # epochs whose ``epoch`` record is in the stream
        if self.enabled:
            self.partial = self.path.with_name(self.path.name + ".partial")
            self._fh = open(self.partial, "w", encoding="utf-8")

    def reopen_append(self) -> None:
        """Become the writer of this stream on another rank (its writer died, ULFM recovery):
        append to the existing ``.partial`` file (on a shared file system)."""
        if self.path is None or self._fh is not None:
            return
        self.partial = self.path.with_name(self.path.name + ".partial")
        try:
            self.epochs |= {r.get("epoch") for r in read_metrics(self.partial)
                            if r.get("event") == "epoch"}
        except (OSError, ValueError):        # a torn last line: the records before it count
            pass
        self._fh = open(self.partial, "a", encoding="utf-8")
        self.enabled = True

    def write(self, event: str, **fields: Any) -> None:
        if not self.enabled:
            return
        if event == "epoch":
            self.epochs.add(fields.get("epoch"))
        record = {"event": event, "time_s": round(time.time() - self.t0, 4), **fields}
        self._fh.write(json.dumps(_jsonable(record), allow_nan=False) + "\n")
        self._fh.flush()

    def close(self, *, complete: bool = True) -> None:
        if self._fh is None:
            return
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        if complete:
            os.replace(self.partial, self.path)

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc_type is None)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a finished (or ``.partial``) stream."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
