"""A new algorithm written outside hpcasync, to show what adding one takes (docs/design/
new-algorithm.md): its update rule (a class) and one registry entry, with a CLI option of its own.
Nothing else: the CLI, the parameter server, recovery, grow-back and checkpoints come with the
family.

``ScaledASGD`` is ASGD with the gradient scaled by ``scale`` before the step (``--toy-scale``).
Run as a script, it registers ``toy-asgd`` and runs ``hpcasync`` (every rank, and a replacement
spawned by a grow-back, runs this same command)::

    mpiexec -n 4 python tests/toy_algorithm.py train --algorithm toy-asgd --toy-scale 0.5 ...
"""
from __future__ import annotations

import sys

from hpcasync.rules.asgd import ASGD


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


def register() -> None:
    from hpcasync import registry

    registry.register(registry.ps_algorithm(
        "toy-asgd", "tests.toy_algorithm:ScaledASGD", "ASGD on a scaled gradient (a test's)",
        options=(registry.Option("toy_scale", "scale", float, "the gradient's factor (1.0)"),)))


if __name__ == "__main__":
    register()
    from hpcasync.cli import main

    sys.exit(main())
