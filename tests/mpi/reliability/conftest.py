"""Every test here launches its own MPI jobs from rank 0 (marked ``rank0``), or starts none
(``no_mpi``): scripts/test.sh runs this directory in one process, a world of 1. A test that uses
the pytest job's own ranks would pass there without checking anything, so collecting one is an
error: it belongs in tests/mpi."""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items):
    here = [i for i in items if "/reliability/" in str(i.path).replace("\\", "/")]
    stray = [i.nodeid for i in here
             if not (i.get_closest_marker("rank0") or i.get_closest_marker("no_mpi"))]
    if stray:
        raise pytest.UsageError("tests/mpi/reliability runs in one process: mark these rank0 "
                                "(they launch their own jobs) or move them to tests/mpi: "
                                + ", ".join(stray))
