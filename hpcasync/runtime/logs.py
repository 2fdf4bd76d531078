"""The run's log lines: one format, the report rank at INFO and every other rank at WARNING.

Called at start-up (``train``), and again when the reporting rank changes: a survivor taking over
after rank 0's death (:mod:`.recovery`, :mod:`hpcasync.ps.takeover`), a joiner that takes rank 0's
place (:mod:`.join`)::

    from hpcasync.runtime.logs import setup_logging
    setup_logging(rank, report_rank=0)      # [12:00:00 r0] ... on rank 0 only
"""
from __future__ import annotations

import logging
import sys


def setup_logging(rank: int, verbose: bool = False, *, report_rank: int = 0) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level if rank == report_rank else logging.WARNING, stream=sys.stderr,
                        format=f"[%(asctime)s r{rank}] %(message)s", datefmt="%H:%M:%S", force=True)
