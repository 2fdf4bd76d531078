"""What a parameter server records about the pushes it handles (the MPI PS and the simulator).

Per push: worker, the version its gradient was computed on, staleness τ (accepted pushes since that
version), its loss, accepted or rejected (and why). Per epoch: the staleness histogram (count per τ),
accepted and rejected pushes, pushes per worker, the mean pushed loss. Totals for the summary.

``state_dict`` / ``load_state_dict`` carry the counters through a checkpoint.

Example::

    stats = PushStats(num_workers=3)
    stats.accept(worker=1, version=4, staleness=2, loss=0.71)
    stats.reject(worker=2, version=5, reason="gradient contains NaN or Inf")
    record = stats.end_epoch()       # {"staleness_histogram": {2: 1}, "pushes": 1, ...}
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass

log = logging.getLogger("hpcasync")

MAX_LOGGED_REJECTS = 5


@dataclass(frozen=True)
class PushRecord:
    worker: int
    version: int
    staleness: int          # -1 for a rejected push
    loss: float
    accepted: bool


class PushStats:
    """Counters of one PS run. ``keep_log`` keeps every :class:`PushRecord` in ``log``."""

    def __init__(self, num_workers: int, *, keep_log: bool = True):
        self.num_workers = num_workers
        self.keep_log = keep_log
        self.log: list[PushRecord] = []
        self.accepted = 0
        self.rejected = 0
        self.per_worker = [0] * num_workers            # accepted pushes per worker
        self.rejected_per_worker = [0] * num_workers
        self.histogram: Counter[int] = Counter()       # whole run
        self.reasons: Counter[str] = Counter()
        self._reset_epoch()

    def start_at(self, position, pushes_per_epoch: int | None = None) -> None:
        """Count ``position`` accepted pushes of every worker (or ``position[w]`` of worker w) as
        served before (a server that took over from a dead one, :mod:`.takeover`); with
        ``pushes_per_epoch``, the current epoch holds the pushes past its last crossing."""
        self.per_worker = ([int(p) for p in position] if isinstance(position, (list, tuple))
                           else [int(position)] * self.num_workers)
        self.accepted = sum(self.per_worker)
        if pushes_per_epoch:
            self._accepted = self.accepted % pushes_per_epoch

    def _reset_epoch(self) -> None:
        self._hist: Counter[int] = Counter()
        self._accepted = 0
        self._rejected = 0
        self._per_worker = [0] * self.num_workers
        self._loss_sum = 0.0
        self._loss_n = 0

    def accept(self, worker: int, version: int, staleness: int, loss: float) -> None:
        self.accepted += 1
        self._accepted += 1
        self.per_worker[worker] += 1
        self._per_worker[worker] += 1
        self.histogram[staleness] += 1
        self._hist[staleness] += 1
        if math.isfinite(loss):
            self._loss_sum += loss
            self._loss_n += 1
        if self.keep_log:
            self.log.append(PushRecord(worker, version, staleness, loss, True))

    def reject(self, worker: int, version: int, reason: str, loss: float = math.nan) -> None:
        self.rejected += 1
        self._rejected += 1
        if 0 <= worker < self.num_workers:
            self.rejected_per_worker[worker] += 1
        self.reasons[reason] += 1
        if self.rejected <= MAX_LOGGED_REJECTS:
            log.warning("PS: rejected a push from worker %d (version %d): %s", worker, version,
                        reason)
        if self.keep_log:
            self.log.append(PushRecord(worker, version, -1, loss, False))

    @property
    def train_loss(self) -> float:
        """Mean loss of the accepted pushes of the current epoch (NaN if none reported one)."""
        return self._loss_sum / self._loss_n if self._loss_n else math.nan

    def end_epoch(self) -> dict:
        """The epoch's figures (for the epoch record); starts the next epoch's counters."""
        hist = dict(sorted(self._hist.items()))
        n = sum(hist.values())
        record = {"staleness_histogram": hist, "pushes": self._accepted,
                  "rejected_pushes": self._rejected, "pushes_per_worker": list(self._per_worker),
                  "mean_staleness": (sum(k * v for k, v in hist.items()) / n) if n else 0.0,
                  "max_staleness": max(hist, default=0), "train_loss": self.train_loss}
        self._reset_epoch()
        return record

    _COUNTERS = ("accepted", "rejected", "_accepted", "_rejected", "_loss_n")

    def state_dict(self) -> dict:
        """The counters (whole run and current epoch) as plain data for a checkpoint; the push
        ``log`` is not included (a resumed run's log holds only its own pushes)."""
        d = {k: getattr(self, k) for k in self._COUNTERS}
        d.update(num_workers=self.num_workers, per_worker=list(self.per_worker),
                 rejected_per_worker=list(self.rejected_per_worker),
                 histogram=dict(self.histogram), reasons=dict(self.reasons),
                 epoch_histogram=dict(self._hist), epoch_per_worker=list(self._per_worker),
                 epoch_loss_sum=float(self._loss_sum))
        return d

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict` (CheckpointError when it is for another number of workers
        or incomplete)."""
        from ..errors import CheckpointError

        try:
            if d["num_workers"] != self.num_workers:
                raise CheckpointError(f"PS statistics are for {d['num_workers']} workers, this "
                                      f"run has {self.num_workers}")
            for k in self._COUNTERS:
                setattr(self, k, int(d[k]))
            self.per_worker = [int(x) for x in d["per_worker"]]
            self.rejected_per_worker = [int(x) for x in d["rejected_per_worker"]]
            self.histogram = Counter({int(k): int(v) for k, v in d["histogram"].items()})
            self.reasons = Counter({str(k): int(v) for k, v in d["reasons"].items()})
            self._hist = Counter({int(k): int(v) for k, v in d["epoch_histogram"].items()})
            self._per_worker = [int(x) for x in d["epoch_per_worker"]]
            self._loss_sum = float(d["epoch_loss_sum"])
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise CheckpointError(f"PS statistics in the checkpoint are incomplete ({exc})"
                                  ) from None

    def summary(self) -> dict:
        """Whole-run totals."""
        hist = dict(sorted(self.histogram.items()))
        n = sum(hist.values())
        return {"pushes": self.accepted, "rejected_pushes": self.rejected,
                "pushes_per_worker": list(self.per_worker),
                "rejected_per_worker": list(self.rejected_per_worker),
                "staleness_histogram": hist,
                "mean_staleness": (sum(k * v for k, v in hist.items()) / n) if n else 0.0,
                "reject_reasons": dict(self.reasons)}
