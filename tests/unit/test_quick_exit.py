"""hpcasync.quick_exit: ``import hpcasync`` makes Python's exit skip finalization's garbage
collections, and nothing a script wrote is lost, its exit status is kept."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.mpi_util import REPO

SCRIPT = textwrap.dedent("""
    import atexit, gc, sys
    atexit.register(lambda: print("frozen", gc.get_freeze_count(), flush=True))  # runs last
    import hpcasync

    class Holder:                       # a file inside a reference cycle
        def __init__(self, path):
            self.me, self.f = self, open(path, "w", buffering=1 << 16)

    kept = Holder(sys.argv[1])          # alive at exit: a cycle only once the module is torn down
    kept.f.write("kept\\n")
    how = sys.argv[2]
    if how == "raise":
        raise RuntimeError("the script's own error")
    sys.exit(int(how))
""")


def _run(tmp_path, how: str, **env: str):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    a = tmp_path / "a.txt"
    out = subprocess.run([sys.executable, str(script), str(a), how], cwd=REPO,
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **env})
    return out, a.read_text()


@pytest.mark.parametrize("how,status", [("0", 0), ("3", 3), ("raise", 1)])
def test_the_exit_keeps_every_write_and_the_status(tmp_path, how, status):
    out, a = _run(tmp_path, how)
    assert out.returncode == status, out.stderr
    assert a == "kept\n"                     # the hook flushed it: the cycle is never collected
    frozen = int(out.stdout.split()[-1])
    assert frozen > 0                        # the hook ran: finalization skipped those objects
    if how == "raise":
        assert "RuntimeError: the script's own error" in out.stderr


def test_hpcasync_full_exit_leaves_pythons_exit_alone(tmp_path):
    out, a = _run(tmp_path, "0", HPCASYNC_FULL_EXIT="1")
    assert out.returncode == 0 and a == "kept\n"      # (finalization's collection closed it)
    assert out.stdout.split()[-1] == "0"
