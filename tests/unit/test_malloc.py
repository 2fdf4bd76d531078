"""``hpcasync.runtime.malloc``: the allocator settings apply once, on glibc, unless turned off or
already set by the user (each case in a fresh interpreter: mallopt is per process)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.mpi_util import REPO, clean_env

PROBE = ("from hpcasync.runtime.malloc import tune_malloc; "
         "a = tune_malloc(); b = tune_malloc(); print(a, b)")


def _run(**env) -> str:
    r = subprocess.run([sys.executable, "-c", PROBE], env=clean_env(**env), cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.rank0
def test_applied_once_on_glibc_and_left_alone_when_asked():
    import platform

    glibc = platform.libc_ver()[0] == "glibc"
    assert _run() == f"{glibc} {glibc}"
    assert _run(HPCASYNC_MALLOC="default") == "False False"
    assert _run(MALLOC_MMAP_THRESHOLD_="65536") == "False False"
    assert _run(MALLOC_TRIM_THRESHOLD_="65536") == "False False"
