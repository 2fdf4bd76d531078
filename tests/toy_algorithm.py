"""Two new algorithms written outside hpcasync, to show what adding one takes (docs/design/
new-algorithm.md): a class and one registry entry each, with CLI options of their own. Nothing
else: the CLI, recovery, grow-back and checkpoints come with the family.

- ``toy-asgd`` (the parameter-server family): ``ScaledASGD``, ASGD with the gradient scaled by
  ``scale`` before the step (``--toy-scale``).
- ``toy-localsgd`` (the ``ssgd`` family, beside local SGD, SlowMo and DiLoCo):
  ``GrowingLocalSGD``, local SGD whose period grows by ``growth`` steps after each average
  (``--toy-period``, ``--toy-growth``): state of its own (the period, the next average's step)
  that a checkpoint, a reset and a replacement must carry.

Run as a script, it registers both and runs ``hpcasync`` (every rank, and a replacement spawned
by a grow-back, runs this same command)::

    mpiexec -n 4 python tests/toy_algorithm.py train --algorithm toy-asgd --toy-scale 0.5 ...
"""
from __future__ import annotations

import sys

from hpcasync.rules.asgd import ASGD
from hpcasync.ssgd.localsgd import LocalSGD


class ScaledASGD(ASGD):
    """ASGD on ``scale`` times the pushed gradient."""

    name = "toy-asgd"

    def __init__(self, theta0, num_workers: int, *, lr: float, weight_decay: float = 0.0,
                 momentum: float = 0.0, scale: float = 1.0):
        super().__init__(theta0, num_workers, lr=lr, weight_decay=weight_decay,
                         momentum=momentum)
        self.scale = float(scale)

    def _update(self, worker, grad, meta):
        super()._update(worker, grad * self.scale, meta)

    def _summary(self) -> dict:
        return {"toy_scale": self.scale}


class GrowingLocalSGD(LocalSGD):
    """Local SGD (no warm-up) averaging at step 0, then after ``period`` steps, the period then
    growing by ``growth`` after each average."""

    algorithm = "toy-localsgd"

    def __init__(self, optimizer, model, comm=None, *, period: int = 2, growth: int = 1):
        super().__init__(optimizer, model, comm, period=period, warmup_steps=0)
        self.growth, self.next_average = int(growth), 0

    def step(self, closure=None):
        averages = self.steps == self.next_average
        with self._undone_on_failure(averages):
            result = super(LocalSGD, self).step(closure)      # the inner step (no warm-up)
            if averages:
                self._average(only_with_grad=True)
                self.next_average += self.period
                self.period += self.growth
        return result

    def _counters(self) -> dict:
        return {**super()._counters(), "period": self.period, "next_average": self.next_average}

    def _set_counters(self, c: dict) -> None:
        super()._set_counters(c)
        self.period, self.next_average = c["period"], c["next_average"]

    def _extra_state(self) -> dict:
        return {**super()._extra_state(), "period": self.period,
                "next_average": self.next_average}

    def _load_extra(self, extra: dict) -> None:
        super()._load_extra(extra)
        self.period, self.next_average = int(extra["period"]), int(extra["next_average"])


def schedule(steps: int, period: int = 2, growth: int = 1) -> tuple[int, int]:
    """``(period, next_average)`` of :class:`GrowingLocalSGD` after ``steps`` steps."""
    nxt = 0
    for k in range(steps):
        if k == nxt:
            nxt, period = nxt + period, period + growth
    return period, nxt


def register() -> None:
    from hpcasync import registry

    registry.register(registry.ps_algorithm(
        "toy-asgd", "tests.toy_algorithm:ScaledASGD", "ASGD on a scaled gradient (a test's)",
        options=(registry.Option("toy_scale", "scale", float, "the gradient's factor (1.0)"),)))
    registry.register(registry.sync_method(
        "toy-localsgd", "tests.toy_algorithm:GrowingLocalSGD",
        "local SGD with a growing period (a test's)",
        options=(registry.Option("toy_period", "period", int, "the first period (2)"),
                 registry.Option("toy_growth", "growth", int, "the period's growth (1)"))))


if __name__ == "__main__":
    register()
    from hpcasync.cli import main

    sys.exit(main())
