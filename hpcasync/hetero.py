"""Heterogeneity and delay models, shared by the real runtimes and the simulator.

One :class:`DelayModel` answers "how long does worker w's step s take, relative to its natural
time, and how long does its push travel?"::

    factor(w, s) = k_w · m(w, s)          k_w: straggler factor (1 unless set)
                                           m(w, s) ~ Gamma, log-normal or Pareto, mean 1
                                                     (``COMPUTE_TIMES``), or 1
    step time    = natural · factor(w, s)
    push delay   = d  (a fixed extra latency per push, in ms)

Example::

    delay = DelayModel.from_options({"hetero": "HE1"}, worker_ranks=[1, 2, 3], seed=0)
    delay.factor(2, step=0)        # 10.0: the last worker is 10x slower
    delay.sleep_extra(2, 0, natural=0.01)    # sleeps 0.09 s

Design: docs/design/hetero.md#delay-models (seeding, sleeping in a real run, the command-line
forms).
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .errors import ConfigError

log = logging.getLogger(__name__)

HETERO_SETTINGS = {"HO": 1.0, "HE0": 2.0, "HE1": 10.0, "HE2": 100.0}


def parse_straggler(spec: str | None) -> dict[int, float]:
    """``"RANK:FACTOR[,RANK:FACTOR...]"`` -> ``{rank: factor}``; ConfigError on bad input."""
    if spec is None or spec == "":
        return {}
    out: dict[int, float] = {}
    for item in spec.split(","):
        rank_s, sep, factor_s = item.strip().partition(":")
        try:
            rank, factor = int(rank_s), float(factor_s)
        except ValueError:
            rank, factor = -1, math.nan
        if not sep or rank < 0 or not math.isfinite(factor) or factor <= 0:
            raise ConfigError(f"--straggler {spec!r}: each entry must be RANK:FACTOR with RANK >= 0 "
                              f"and FACTOR > 0, got {item.strip()!r}")
        if rank in out:
            raise ConfigError(f"--straggler {spec!r}: rank {rank} is given twice")
        out[rank] = factor
    return out


#: ``--compute-time`` distributions of the per-step multiplier m (each with mean 1) and the
#: range of their parameter: Gamma(shape k, scale 1/k); log-normal exp(N(−σ²/2, σ²)) (heavy
#: tail); Pareto with tail index α > 1 and scale (α − 1)/α (heavy tail: infinite variance for
#: α ≤ 2)
COMPUTE_TIMES = {"gamma": "SHAPE > 0", "lognormal": "SIGMA > 0", "pareto": "ALPHA > 1"}


def parse_compute_time(spec: str | None) -> tuple[str, float] | None:
    """``"fixed"`` -> None; ``"gamma:SHAPE"``, ``"lognormal:SIGMA"``, ``"pareto:ALPHA"`` ->
    ``(kind, parameter)``; ConfigError otherwise."""
    if spec is None or spec == "fixed":
        return None
    kind, _, value_s = spec.partition(":")
    try:
        value = float(value_s)
    except ValueError:
        value = math.nan
    low = 1.0 if kind == "pareto" else 0.0
    if kind not in COMPUTE_TIMES or not math.isfinite(value) or value <= low:
        raise ConfigError(f"--compute-time must be 'fixed', 'gamma:SHAPE' (SHAPE > 0), "
                          f"'lognormal:SIGMA' (SIGMA > 0) or 'pareto:ALPHA' (ALPHA > 1), "
                          f"got {spec!r}")
    return kind, value


@dataclass
class DelayModel:
    """Per-worker step-time factors and push latency (see the module docstring).

    Args:
        factors: straggler factor k_w per worker index (missing: 1).
        compute: the per-step multiplier's distribution, ``(kind, parameter)`` of
            :data:`COMPUTE_TIMES` (mean 1), or None (always 1).
        push_delay_s: extra latency per push, seconds.
        seed: seeds the per-(worker, step) multipliers.
    """

    factors: dict[int, float] = field(default_factory=dict)
    compute: tuple[str, float] | None = None
    push_delay_s: float = 0.0
    seed: int = 0

    @property
    def trivial(self) -> bool:
        """No delay at all (every factor 1, no Gamma, no push delay)."""
        return (all(f == 1.0 for f in self.factors.values()) and self.compute is None
                and self.push_delay_s == 0.0)

    def multiplier(self, worker: int, step: int) -> float:
        """m(w, s): 1, or a draw of mean 1 (:data:`COMPUTE_TIMES`) that depends only on
        (seed, w, s)."""
        if self.compute is None:
            return 1.0
        kind, p = self.compute
        rng = np.random.default_rng([self.seed, worker, step])
        if kind == "gamma":
            return float(rng.gamma(p, 1.0 / p))
        if kind == "lognormal":
            return float(rng.lognormal(-0.5 * p * p, p))
        return float((rng.pareto(p) + 1.0) * (p - 1.0) / p)

    def factor(self, worker: int, step: int) -> float:
        """k_w · m(w, s): how many natural step times worker ``worker``'s step ``step`` takes."""
        return self.factors.get(worker, 1.0) * self.multiplier(worker, step)

    def step_time(self, worker: int, step: int, natural: float) -> float:
        """Duration of the step when its undisturbed compute takes ``natural`` seconds."""
        return natural * self.factor(worker, step)

    def extra(self, worker: int, step: int, natural: float) -> float:
        """Seconds to add after a measured compute of ``natural`` seconds (>= 0)."""
        return max(0.0, natural * (self.factor(worker, step) - 1.0))

    def sleep_extra(self, worker: int, step: int, natural: float) -> float:
        """Real runtimes: sleep for :meth:`extra`; returns the seconds slept."""
        t = self.extra(worker, step, natural)
        if t > 0:
            time.sleep(t)
        return t

    def sleep_push(self) -> None:
        """Real runtimes: sleep for the push latency before a push."""
        if self.push_delay_s > 0:
            time.sleep(self.push_delay_s)

    def describe(self) -> str:
        parts = [f"worker {w} x{f:g}" for w, f in sorted(self.factors.items()) if f != 1.0]
        if self.compute is not None:
            parts.append(f"{self.compute[0]}({self.compute[1]:g}) step times")
        if self.push_delay_s:
            parts.append(f"push delay {1000 * self.push_delay_s:g} ms")
        return ", ".join(parts) or "homogeneous"

    def to_record(self) -> dict[str, Any]:
        return {"factors": {str(w): f for w, f in sorted(self.factors.items())},
                "compute_time": None if self.compute is None else
                "%s:%g" % self.compute, "push_delay_s": self.push_delay_s}

    @classmethod
    def from_options(cls, options: dict[str, Any], *, worker_ranks: Sequence[int],
                     seed: int = 0) -> "DelayModel":
        """Build from the parsed options (``hetero``, ``straggler``, ``compute_time``,
        ``push_delay``) for a job whose workers are ``worker_ranks`` (world ranks, in worker
        order); the model is keyed by worker index. ConfigError names a bad value or a straggler
        rank that is not a worker."""
        check_options(options)
        ranks = list(worker_ranks)
        factors: dict[int, float] = {}
        hetero = options.get("hetero") or "HO"
        if HETERO_SETTINGS[hetero] != 1.0 and ranks:
            factors[len(ranks) - 1] = HETERO_SETTINGS[hetero]
        for rank, f in parse_straggler(options.get("straggler")).items():
            if rank not in ranks:
                raise ConfigError(f"--straggler: rank {rank} is not a worker of this job "
                                  f"(workers: {_ranges(ranks)})")
            w = ranks.index(rank)
            factors[w] = factors.get(w, 1.0) * f
        push_ms = float(options.get("push_delay") or 0.0)
        return cls(factors=factors, compute=parse_compute_time(options.get("compute_time")),
                   push_delay_s=push_ms / 1000.0, seed=seed)


def check_options(options: dict[str, Any]) -> None:
    """Validate the heterogeneity options without knowing the job size (pre-MPI)."""
    hetero = options.get("hetero") or "HO"
    if hetero not in HETERO_SETTINGS:
        raise ConfigError(f"--hetero {hetero!r} is not one of: {', '.join(HETERO_SETTINGS)}")
    parse_straggler(options.get("straggler"))
    parse_compute_time(options.get("compute_time"))
    push = options.get("push_delay") or 0.0
    if not isinstance(push, (int, float)) or not math.isfinite(push) or push < 0:
        raise ConfigError(f"--push-delay must be a finite number of ms >= 0, got {push!r}")


def add_arguments(parser) -> None:
    """The heterogeneity option group (idempotent: a second call adds nothing)."""
    if "--hetero" in getattr(parser, "_option_string_actions", {}):
        return
    g = parser.add_argument_group("heterogeneity (real runs and the simulator)")
    g.add_argument("--hetero", default="HO", metavar="HO|HE0|HE1|HE2",
                   help="SHAT's settings: homogeneous, or the last worker 2x/10x/100x slower")
    g.add_argument("--straggler", default=None, metavar="RANK:FACTOR[,...]",
                   help="these ranks' steps take FACTOR x their natural time")
    g.add_argument("--compute-time", default="fixed",
                   metavar="fixed|gamma:SHAPE|lognormal:SIGMA|pareto:ALPHA",
                   help="per-step time multiplier of mean 1, seeded per worker/step: Gamma(SHAPE), "
                        "or heavy-tailed: log-normal (SIGMA) or Pareto (tail index ALPHA > 1)")
    g.add_argument("--push-delay", type=float, default=0.0, metavar="MS",
                   help="extra latency per push (ms)")


def _ranges(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ", ".join(map(str, ranks))


class StepDelay:
    """Heterogeneity for a synchronous runtime: after rank ``rank``'s compute, sleep
    ``natural · (factor − 1)`` and the push delay (:class:`~hpcasync.hetero.DelayModel`, worker
    index = rank). ``natural`` is the median of the last 15 steps' forward/backward times: CPU time
    of the process on a CPU device (a rank the OS kept waiting is not slow), wall time on a GPU.

    Example::

        delay = StepDelay.from_config(cfg, rank=topo.rank, size=topo.size, device=topo.device)
        delay.begin(); loss.backward(); delay.end(step)      # sleeps if this rank is slow
        opt.step()                                           # everyone waits for it here
    """

    def __init__(self, model: DelayModel, rank: int, device: str = "cpu"):
        self.model, self.rank = model, rank
        self.active = not model.trivial
        import torch

        self.cpu_clock = torch.device(device).type == "cpu"
        self.recent: deque[float] = deque(maxlen=15)
        self.slept = 0.0          # seconds slept so far
        self._t0 = self._c0 = 0.0

    @classmethod
    def from_config(cls, cfg, *, rank: int, size: int, device: str = "cpu") -> "StepDelay":
        return cls(DelayModel.from_options(cfg.options, worker_ranks=range(size), seed=cfg.seed),
                   rank, device)

    def begin(self) -> None:
        if self.active:
            self._t0, self._c0 = time.perf_counter(), time.process_time()

    def end(self, step: int) -> float:
        """After the compute of step ``step``: sleep as the model says; returns seconds slept."""
        if not self.active:
            return 0.0
        natural = (time.process_time() - self._c0 if self.cpu_clock
                   else time.perf_counter() - self._t0)
        self.recent.append(natural)
        t = self.model.sleep_extra(self.rank, step, statistics.median(self.recent))
        if self.model.push_delay_s:
            self.model.sleep_push()
            t += self.model.push_delay_s
        self.slept += t
        return t

    def record(self) -> dict:
        """Summary fields: the delay model (as recorded and in words)."""
        return {"hetero": self.model.to_record(), "hetero_describe": self.model.describe()}
