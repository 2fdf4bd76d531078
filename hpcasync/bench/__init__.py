"""Benchmarks behind ``hpcasync bench``: each module exposes ``add_arguments(parser)`` and
``run(args)`` (every rank calls ``run``; rank 0 prints a markdown table).

* :mod:`.allreduce` — MPI_Allreduce vs hpcasync's allreduce (auto, window, hierarchical) vs Horovod.
* :mod:`.ssgd` — SSGD ms/step: ours vs PyTorch DDP vs Horovod vs compute-only.
* :mod:`.daso` — DASO vs SSGD vs Horovod: time per epoch and to accuracy.
* :mod:`.ps` — parameter-server pushes/s (transports, shard servers) vs a one-process bound.
"""
from __future__ import annotations

import os
import sys


def emit(text: str, out: str | None) -> None:
    """Print a report (rank 0) and, with ``out``, write it to that file atomically."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    if out:
        tmp = f"{out}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, out)


def idle_barrier(comm, poll: float = 0.001) -> None:
    """A barrier that sleeps while it waits, so waiting ranks leave the cores to the others."""
    import time

    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll)


def standalone(module, prog: str, description: str, argv: list[str] | None = None) -> int:
    """``python -m hpcasync.bench.X``: parse ``module.add_arguments`` and call ``module.run``."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description)
    module.add_arguments(parser)
    return module.run(parser.parse_args(argv))
