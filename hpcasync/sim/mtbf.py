"""Expected throughput of a long synchronous (SSGD) job that loses ranks: shrink only, grow back,
or restart from a checkpoint — closed forms and a Monte-Carlo check on a simulated clock.

A job needs ``job_s`` seconds of work at full size (``ranks`` ranks). Each live rank dies at an
exponential time of mean ``node_mtbf_s``, independently, so the job's MTBF is
``node_mtbf_s / ranks``. Efficiency = ``job_s / E[wall time to finish]`` (1.0: no failures):

* ``shrink`` (ULFM, the default): a death pauses the job ``shrink_s`` (detect, revoke, shrink,
  adopt) and the survivors go on; SSGD's work rate is proportional to the live ranks (the epoch is
  re-sharded: fewer ranks take more steps of the same time), so capacity is lost until the end.
  The job fails when fewer than ``min_ranks`` are left. Closed form (mean field, the live ranks at
  their expectation; exact as ``ranks`` grows): ``E[T] = -M ln(1 - H/M) + (N H / M) r``, and 0
  when ``N (1 - H/M) < min_ranks``.
* ``grow`` (ULFM, ``--grow-back``): a death pauses the job ``grow_s`` (the shrink, then the
  replacement's start-up, which every survivor waits for) and the job is back at full size:
  ``E[T] = H (1 + Λ c)``, ``Λ = N / M``: exact. Needs a free slot per death (spare nodes).
* ``restart`` (``hpcasync launch --max-restarts``): the job checkpoints every ``τ`` seconds of work
  (cost ``δ`` each); a death throws away the work since the last checkpoint and costs
  ``restart_s`` (the launcher sees it, a new job starts, loads the checkpoint). Per segment of
  length ``s = τ + δ``: ``E = (e^{Λ s} - 1)(1/Λ + R)`` (Daly, *A higher order estimate of the
  optimum checkpoint interval for restart dumps*, 2006, there with failures during the restart
  too); ``τ`` defaults to Daly's optimum for the job MTBF.

Failures happen only while the job trains (not during a pause, a join or a restart): the same
rule as the real-run study (``experiments/probes/mtbf.py``); it underestimates the loss when the
job MTBF comes near the pauses. Costs are taken as independent of the rank count: costs
measured on a few ranks are lower bounds for 1024 (a larger spawn, a larger restart).

Example::

    costs = Costs(shrink_s=0.1, grow_s=6.0, restart_s=15.0, checkpoint_s=0.05)
    efficiency("grow", ranks=1024, node_mtbf_s=365 * 86400, job_s=86400, costs=costs)  # 0.9998
    simulate("grow", ranks=1024, node_mtbf_s=365 * 86400, job_s=86400, costs=costs, reps=200)

Measured inputs and the table at 64-1024 ranks: experiments/results/mtbf/results.md.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

MODES = ("shrink", "grow", "restart")
DAY = 86400.0
YEAR = 365 * DAY


@dataclass(frozen=True)
class Costs:
    """Seconds each event costs. ``checkpoint_every_s``: work between checkpoints (None: Daly's
    optimum for the job's MTBF, at least ``min_interval_s``)."""
    shrink_s: float = 0.0
    grow_s: float = 0.0
    restart_s: float = 0.0
    checkpoint_s: float = 0.0
    checkpoint_every_s: float | None = None
    min_interval_s: float = 1.0

    def __post_init__(self):
        for name in ("shrink_s", "grow_s", "restart_s", "checkpoint_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Costs.{name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.checkpoint_every_s is not None and not self.checkpoint_every_s > 0:
            raise ValueError(f"Costs.checkpoint_every_s must be > 0, got "
                             f"{self.checkpoint_every_s}")


def _check(mode: str, ranks: int, node_mtbf_s: float, job_s: float, min_ranks: int) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if ranks < 1 or not 1 <= min_ranks <= ranks:
        raise ValueError(f"need ranks >= 1 and 1 <= min_ranks <= ranks, got {ranks}, {min_ranks}")
    if not node_mtbf_s > 0 or not job_s > 0:
        raise ValueError(f"node_mtbf_s and job_s must be > 0, got {node_mtbf_s}, {job_s}")


def daly_interval(checkpoint_s: float, job_mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum of the work between checkpoints."""
    d, m = checkpoint_s, job_mtbf_s
    if math.isinf(m):
        return math.inf
    if d >= 2 * m:
        return m
    x = d / (2 * m)
    return math.sqrt(2 * d * m) * (1 + math.sqrt(x) / 3 + x / 9) - d


def interval(costs: Costs, ranks: int, node_mtbf_s: float, job_s: float) -> float:
    """The work between checkpoints the restart mode uses (at most the job)."""
    tau = costs.checkpoint_every_s
    if tau is None:
        tau = max(costs.min_interval_s, daly_interval(costs.checkpoint_s, node_mtbf_s / ranks))
    return min(tau, job_s)


def _segments(job_s: float, tau: float) -> list[tuple[float, int]]:
    k = int(job_s // tau)
    rem = job_s - k * tau
    if rem <= 1e-9 * job_s:
        return [(tau, k)]
    return [(tau, k), (rem, 1)] if k else [(rem, 1)]


def efficiency(mode: str, *, ranks: int, node_mtbf_s: float, job_s: float, costs: Costs,
               min_ranks: int = 1) -> float:
    """``job_s / E[wall time]`` by the closed forms of the module doc (0.0: the job does not
    finish: shrink-only ran out of ranks)."""
    _check(mode, ranks, node_mtbf_s, job_s, min_ranks)
    n, m, h = ranks, node_mtbf_s, job_s
    lam = n / m                                 # the job's failure rate (per second of work)
    if mode == "grow":
        return 1.0 / (1.0 + lam * costs.grow_s)
    if mode == "shrink":
        if math.isinf(m):
            return 1.0
        if n * (1.0 - h / m) < min_ranks:
            return 0.0
        return h / (-m * math.log1p(-h / m) + lam * h * costs.shrink_s)
    tau = interval(costs, n, m, h)
    total = 0.0
    for s, count in _segments(h, tau):
        s += costs.checkpoint_s
        total += count * (s if lam == 0 else math.expm1(lam * s) * (1 / lam + costs.restart_s))
    return h / total


@dataclass
class SimResult:
    """``efficiency``: ``job_s`` / the mean wall time of the replicas that finished; ``finished``:
    their share; ``deaths``: mean deaths per replica; ``stderr``: of the efficiency (delta
    method)."""
    efficiency: float
    finished: float
    deaths: float
    stderr: float


def simulate(mode: str, *, ranks: int, node_mtbf_s: float, job_s: float, costs: Costs,
             min_ranks: int = 1, reps: int = 200, seed: int = 0) -> SimResult:
    """Monte Carlo of the same model, one event at a time on a simulated clock (seeded)."""
    _check(mode, ranks, node_mtbf_s, job_s, min_ranks)
    rng = random.Random(seed)
    n, m, h = ranks, node_mtbf_s, job_s
    lam = n / m
    times, deaths, done = [], 0, 0
    for _ in range(reps):
        t, d, ok = 0.0, 0, True
        if mode == "grow":
            work = 0.0
            while True:
                gap = rng.expovariate(lam) if lam > 0 else math.inf
                if work + gap >= h:
                    t += h - work
                    break
                work += gap
                t += gap + costs.grow_s
                d += 1
        elif mode == "shrink":
            work, alive = 0.0, n
            while True:
                gap = rng.expovariate(alive / m) if lam > 0 else math.inf   # time to a death
                rate = alive / n                                            # work per second
                if work + gap * rate >= h:
                    t += (h - work) / rate
                    break
                work += gap * rate
                t += gap + costs.shrink_s
                alive -= 1
                d += 1
                if alive < min_ranks:
                    ok = False
                    break
        else:
            tau = interval(costs, n, m, h)
            for s, count in _segments(h, tau):
                s += costs.checkpoint_s
                for _ in range(count):
                    while True:
                        x = rng.expovariate(lam) if lam > 0 else math.inf
                        if x >= s:
                            t += s
                            break
                        t += x + costs.restart_s
                        d += 1
        deaths += d
        if ok:
            done += 1
            times.append(t)
    if not times:
        return SimResult(0.0, 0.0, deaths / reps, 0.0)
    mean = sum(times) / len(times)
    var = sum((x - mean) ** 2 for x in times) / max(1, len(times) - 1)
    return SimResult(h / mean, done / reps, deaths / reps,
                     h / mean ** 2 * math.sqrt(var / len(times)))


# --- the table ------------------------------------------------------------------------------------

RANKS = (64, 128, 256, 512, 1024)
NODE_MTBF = (("1 day", DAY), ("1 week", 7 * DAY), ("1 month", 30 * DAY), ("1 year", YEAR),
             ("5 years", 5 * YEAR))


def table(costs: Costs, *, job_s: float = DAY, ranks=RANKS, node_mtbf=NODE_MTBF) -> str:
    """A markdown table of :func:`efficiency` per rank count and node MTBF, the three modes."""
    lines = ["| ranks | node MTBF | job MTBF | deaths per job | shrink (ranks left) | grow back "
             "| restart (τ) | best |", "|---|---|---|---|---|---|---|---|"]
    for n in ranks:
        for name, m in node_mtbf:
            eff = {k: efficiency(k, ranks=n, node_mtbf_s=m, job_s=job_s, costs=costs)
                   for k in MODES}
            best = max(eff, key=eff.get)
            tau = interval(costs, n, m, job_s)
            lines.append(
                f"| {n} | {name} | {_dur(m / n)} | {n * job_s / m:.1f} | {_pct(eff['shrink'])}"
                f"{f' ({n * (1 - job_s / m):.0f})' if eff['shrink'] else ''} | "
                f"{_pct(eff['grow'])} | {_pct(eff['restart'])} ({_dur(tau)}) | "
                f"{'grow back' if best == 'grow' else best} |")
    return "\n".join(lines)


def _pct(x: float) -> str:
    return "does not finish" if x == 0 else f"{100 * x:.1f} %"


def _dur(s: float) -> str:
    for unit, size in (("d", DAY), ("h", 3600.0), ("min", 60.0)):
        if s >= size:
            return f"{s / size:.1f} {unit}"
    return f"{s:.1f} s"


def report(measured: dict) -> str:
    """The model's section of experiments/results/mtbf/results.md, from the measured costs
    (``shrink_r``, ``grow_c``, ``restart_R``, ``delta``; None where not measured)."""
    def get(key, default):
        v = measured.get(key)
        return default if v is None else v
    here = Costs(shrink_s=get("shrink_r", 0.1), grow_s=get("grow_c", 6.0),
                 restart_s=get("restart_R", 15.0), checkpoint_s=get("delta", 0.05))
    scale = Costs(shrink_s=5.0, grow_s=120.0, restart_s=600.0, checkpoint_s=60.0)
    check = [(k, n, m) for k in MODES for n, m in ((1024, DAY), (256, 30 * DAY))]
    mc = []
    for k, n, m in check:
        sim = simulate(k, ranks=n, node_mtbf_s=m, job_s=DAY, costs=here, reps=100, seed=1)
        closed = efficiency(k, ranks=n, node_mtbf_s=m, job_s=DAY, costs=here)
        mc.append(f"{k} at {n} ranks, node MTBF {_dur(m)}: closed form {_pct(closed)}, Monte "
                  f"Carlo {_pct(sim.efficiency)} ± {100 * sim.stderr:.1f} (finished "
                  f"{100 * sim.finished:.0f} % of 100)")
    return "\n".join([
        "## The model at 64-1024 ranks (`hpcasync/sim/mtbf.py`)", "",
        "Efficiency = a 24-hour job's work / its expected wall time (100 %: no failures), for "
        "the three modes, each rank failing at exponential times of mean *node MTBF* (job MTBF = "
        "node MTBF / ranks). Model and assumptions: the module's docstring (shrink: capacity "
        "lost for good, work rate ∝ live ranks; grow back: a pause of c per death, then full "
        "size, a spare slot per death; restart: the work since the last checkpoint lost plus R "
        "per death, checkpoints every τ (Daly's optimum) at δ each; failures only while "
        "training; costs independent of the rank count).", "",
        f"### A. With the costs measured here (4 ranks, LeNet): r = {here.shrink_s:.2f} s, "
        f"c = {here.grow_s:.2f} s, R = {here.restart_s:.2f} s, δ = {here.checkpoint_s:.3f} s",
        "", table(here), "",
        "Closed form against the Monte-Carlo simulation (`mtbf.simulate`, 100 jobs each): "
        + "; ".join(mc) + ".", "",
        "### B. Assumed costs of a large job (not measured: a 1024-rank job of a model whose "
        f"checkpoint takes a minute): r = {scale.shrink_s:.0f} s, c = {scale.grow_s:.0f} s, "
        f"R = {scale.restart_s:.0f} s, δ = {scale.checkpoint_s:.0f} s", "", table(scale),
    ])


if __name__ == "__main__":
    print(report({}))
