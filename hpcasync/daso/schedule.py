"""DASO's schedule: which epoch is blocking, and what each batch of an epoch does (pure, no MPI).

Epochs are numbered 1 … E. Epochs ``1 … warmup_epochs`` and ``E − cooldown_epochs + 1 … E`` are
*blocking*; the others are *cycling* with knobs (gs, ls, B) = (global_skip, local_skip,
batches_to_wait). For an epoch of n batches (a count; batches b = 0 … n−1) and L global groups
(L = ranks per node), :func:`plan_batch` says what batch b does after its backward pass:

blocking epoch
    grads averaged over all ranks (``grad_sync="global"``), local step; on b = n−1 the float
    buffers (BatchNorm statistics) are averaged over all ranks (``average="buffers"``) — the
    parameters already are identical.
cycling epoch
    * ``grad_sync="local"`` (node-local gradient average) when b mod ls = 0, else ``"none"``;
    * local optimizer step;
    * receive: when b − B = s ≥ 0 is a send batch, global group ((s div gs) mod L) completes the
      message it sent at s, merges x ← (2B·x + S)/(2B + P), and broadcasts inside its node;
    * send: when b mod gs = 0 and b + B ≤ n − 2, global group ((b div gs) mod L) starts a
      nonblocking sum of its parameters and buffers (a message that could only land on the last
      batch is not sent: that batch's blocking average supersedes it);
    * b = n − 1: blocking plain average of parameters and buffers over all ranks (``"all"``).

At the end of a cycling epoch the rank-averaged training loss feeds a :class:`PlateauDetector`;
on a plateau the knobs move ``(gs, ls, B) → (gs/2, ls/2, B−1)`` (each at least 1), and from
(1, 1, 1) they reset to ``(max_global_skips, max(1, max_global_skips/4), same)`` = (8, 2, 2).

Example::

    sched = DasoSchedule(total_epochs=10, num_groups=2)
    for epoch in range(1, 11):
        for b in range(n):
            plan = sched.advance(n)       # BatchPlan(batch=b, grad_sync=..., send_group=..., ...)
        sched.end_epoch(avg_loss)

Differences from the paper / Heat (each a Decision in algorithms.md or a fixed quirk):

* ``warmup_epochs = 0`` starts cycling in epoch 1 (Heat stays blocking for the first epoch);
* n is a batch *count* (Heat's ``last_batch`` is used as both count and last index);
* the cycling knobs start at (global_skip, local_skip, B) = (4, 1, 1) but never above
  ``max_global_skips`` (validated; Heat ignores it at the end of warm-up);
* blocking epochs average *gradients* over all ranks before the step (so a blocking DASO epoch is
  exactly an SSGD epoch) instead of averaging parameters after it: the same for SGD with identical
  replicas in exact arithmetic, one collective instead of three;
* group j is round-robin per send within an epoch ((send index) mod L), starting at 0 each epoch;
* the plateau detector's baseline is the first *cycling* epoch's loss: warm-up losses never enter
  it. Heat's ``epoch_loss_logic`` also skips warm-up epochs, except the call that ends warm-up,
  which feeds the last warm-up epoch's loss to its detector, so Heat's first "best" is a blocking
  epoch's loss (and the first cycling epoch must beat it by 5 % to count as progress).
"""
from __future__ import annotations

import logging
from typing import NamedTuple

from ..errors import ConfigError
from .plateau import PlateauDetector

log = logging.getLogger(__name__)

WARMUP, CYCLING, COOLDOWN = "warmup", "cycling", "cooldown"


class Knobs(NamedTuple):
    global_skip: int        # gs: batches between global sends
    local_skip: int         # ls: batches between node-local gradient averages
    batches_to_wait: int    # B: batches between a send and its merge


class BatchPlan(NamedTuple):
    """What one batch does after its backward pass (see module doc)."""
    batch: int
    grad_sync: str                  # "global" | "local" | "none"
    receive_group: int | None       # global group that completes + merges + node-broadcasts
    send_group: int | None          # global group that starts a send
    average: str                    # "none" | "buffers" | "all" (blocking, over all ranks)


def phase_of(epoch: int, *, total_epochs: int, warmup_epochs: int, cooldown_epochs: int) -> str:
    """``"warmup"``, ``"cycling"`` or ``"cooldown"`` for 1-based ``epoch``."""
    if epoch <= warmup_epochs:
        return WARMUP
    if epoch > total_epochs - cooldown_epochs:
        return COOLDOWN
    return CYCLING


def plan_batch(batch: int, *, nbatches: int, phase: str, knobs: Knobs,
               num_groups: int) -> BatchPlan:
    """The :class:`BatchPlan` of batch ``batch`` (0-based) of an epoch of ``nbatches`` batches."""
    if not 0 <= batch < nbatches:
        raise ConfigError(f"batch {batch} is outside an epoch of {nbatches} batches")
    last = batch == nbatches - 1
    if phase != CYCLING:
        return BatchPlan(batch, "global", None, None, "buffers" if last else "none")
    gs, ls, wait = knobs
    sync = "local" if batch % ls == 0 else "none"
    if last:
        return BatchPlan(batch, sync, None, None, "all")
    sent = batch - wait
    receive = (sent // gs) % num_groups if sent >= 0 and sends_at(sent, nbatches, knobs) else None
    send = (batch // gs) % num_groups if sends_at(batch, nbatches, knobs) else None
    return BatchPlan(batch, sync, receive, send, "none")


def sends_at(batch: int, nbatches: int, knobs: Knobs) -> bool:
    """True when a cycling epoch starts a global send at ``batch``."""
    return batch % knobs.global_skip == 0 and batch + knobs.batches_to_wait <= nbatches - 2


def next_knobs(knobs: Knobs, *, max_global_skips: int) -> Knobs:
    """Knobs after a plateau: halve gs and ls, decrement B (each >= 1); (1,1,1) resets."""
    if knobs == (1, 1, 1):
        low = max(1, max_global_skips // 4)
        return Knobs(max_global_skips, low, low)
    gs, ls, wait = knobs
    return Knobs(max(1, gs // 2), max(1, ls // 2), max(1, wait - 1))


def _count(name: str, value, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"DASO {name} must be an integer >= {low}, got {value!r}")
    return value


class DasoSchedule:
    """Epoch phases, cycling knobs and the per-batch plan; one counter that moves in ``advance``.

    Args (tunables, validated here):
        total_epochs: E, the number of epochs of the run (needed for the cool-down).
        num_groups: L, global groups = ranks per node.
        warmup_epochs / cooldown_epochs: blocking epochs at the start / end (default 4 / 4).
        global_skip / local_skip / batches_to_wait: knobs of the first cycling epoch (4 / 1 / 1).
        max_global_skips: gs after a reset from (1, 1, 1) (default 8).
        plateau_patience / plateau_threshold: see :class:`PlateauDetector` (3 / 0.05).
    """

    def __init__(self, *, total_epochs: int, num_groups: int, warmup_epochs: int = 4,
                 cooldown_epochs: int = 4, global_skip: int = 4, local_skip: int = 1,
                 batches_to_wait: int = 1, max_global_skips: int = 8, plateau_patience: int = 3,
                 plateau_threshold: float = 0.05):
        # tunables
        self.total_epochs = _count("total_epochs", total_epochs, 1)
        self.num_groups = _count("num_groups", num_groups, 1)
        self.warmup_epochs = _count("warmup_epochs", warmup_epochs, 0)
        self.cooldown_epochs = _count("cooldown_epochs", cooldown_epochs, 0)
        self.max_global_skips = _count("max_global_skips", max_global_skips, 1)
        start = Knobs(_count("global_skip", global_skip, 1), _count("local_skip", local_skip, 1),
                      _count("batches_to_wait", batches_to_wait, 1))
        if start.global_skip > self.max_global_skips:
            raise ConfigError(f"DASO global_skip {start.global_skip} exceeds max_global_skips "
                              f"{self.max_global_skips}; raise max_global_skips or lower "
                              f"global_skip")
        self.plateau = PlateauDetector(patience=plateau_patience, threshold=plateau_threshold)
        # internals
        self.knobs = start
        self.epoch = 1              # current epoch (1-based)
        self.batch = 0              # batches done in the current epoch
        self.nbatches: int | None = None

    @property
    def degenerate(self) -> bool:
        """True when no epoch is cycling (warm-up + cool-down cover the run): DASO = SSGD."""
        return self.warmup_epochs + self.cooldown_epochs >= self.total_epochs

    @property
    def phase(self) -> str:
        return phase_of(self.epoch, total_epochs=self.total_epochs,
                        warmup_epochs=self.warmup_epochs, cooldown_epochs=self.cooldown_epochs)

    def advance(self, nbatches: int) -> BatchPlan:
        """The plan of the next batch of the current epoch (``nbatches`` batches); moves the
        counter."""
        if self.nbatches is None:
            self.nbatches = _count("batches per epoch", nbatches, 1)
        elif nbatches != self.nbatches:
            raise ConfigError(f"DASO epoch {self.epoch} began with {self.nbatches} batches, "
                              f"now {nbatches}: the batch count must stay fixed within an epoch")
        if self.batch >= self.nbatches:
            raise ConfigError(f"DASO step {self.batch + 1} in epoch {self.epoch} of "
                              f"{self.nbatches} batches: call epoch_end(loss) on the DASO optimizer after the "
                              "last batch of every epoch")
        plan = plan_batch(self.batch, nbatches=self.nbatches, phase=self.phase, knobs=self.knobs,
                          num_groups=self.num_groups)
        self.batch += 1
        return plan

    def recount(self, nbatches: int) -> None:
        """The world changed inside the epoch (an elastic reset dealt the rest of the epoch over
        another number of ranks): the epoch has ``nbatches`` batches in all from now on, the
        ``batch`` done included. The plans of the batches left follow the new count (sends that
        would not be merged before its last batch are not started; its last batch averages)."""
        if self.batch == 0:
            self.nbatches = None                # not begun: the first advance counts it
            return
        if not isinstance(nbatches, int) or nbatches < self.batch:
            raise ConfigError(f"DASO epoch {self.epoch}: {self.batch} batches are done, the "
                              f"recounted epoch has {nbatches!r}")
        self.nbatches = nbatches

    def end_epoch(self, loss: float) -> dict:
        """Close the epoch with its rank-averaged loss; adapt knobs; returns the epoch's record
        (``daso_epoch``, ``daso_batches``: the schedule's own count of the epoch it closes and of
        that epoch's batches, which a recovery must leave as an undisturbed run has them)."""
        if self.nbatches is None or self.batch != self.nbatches:
            raise ConfigError(f"DASO end_epoch() after {self.batch} of {self.nbatches or '?'} "
                              f"batches of epoch {self.epoch}")
        phase, knobs = self.phase, self.knobs
        plateau = False
        if phase == CYCLING:
            plateau = self.plateau.update(loss)
            if plateau:
                self.knobs = next_knobs(knobs, max_global_skips=self.max_global_skips)
                log.info("DASO: loss plateau after epoch %d, knobs (gs, ls, B) %s -> %s",
                         self.epoch, tuple(knobs), tuple(self.knobs))
        record = {"daso_phase": phase, "daso_plateau": plateau, **self.knob_record(phase, knobs),
                  "daso_epoch": self.epoch, "daso_batches": self.nbatches}
        self.epoch += 1
        self.batch, self.nbatches = 0, None
        if self.epoch <= self.total_epochs and self.phase != phase:
            log.info("DASO: epoch %d enters the %s phase", self.epoch, self.phase)
        return record

    @staticmethod
    def knob_record(phase: str, knobs: Knobs) -> dict:
        """(gs, ls, B) of an epoch for the metrics; blocking epochs report (1, 1, 0)."""
        if phase != CYCLING:
            return {"daso_global_skip": 1, "daso_local_skip": 1, "daso_batches_to_wait": 0}
        return {"daso_global_skip": knobs.global_skip, "daso_local_skip": knobs.local_skip,
                "daso_batches_to_wait": knobs.batches_to_wait}

    def state_dict(self) -> dict:
        """The schedule at any batch: the epoch, the batches done in it and its batch count,
        the knobs, the plateau detector."""
        return {"epoch": self.epoch, "batch": self.batch, "nbatches": self.nbatches,
                "knobs": list(self.knobs), "plateau": self.plateau.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state.get("batch", 0))
        self.nbatches = state.get("nbatches") if self.batch else None
        self.knobs = Knobs(*(int(v) for v in state["knobs"]))
        self.plateau.load_state_dict(state["plateau"])
