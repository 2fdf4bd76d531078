"""``hpcasync.environ``: every ``HPCASYNC_*`` name this repository reads is known (so a real one is
never called misspelt), and one that nothing reads is said with the nearest known name."""
from __future__ import annotations

import re
import subprocess
import sys

from hpcasync import environ
from tests.mpi_util import REPO, clean_env

NAME = re.compile(r"HPCASYNC_[A-Z0-9_]*[A-Z0-9]")
#: names in the repository that are not variables read now (a prefix in prose, a removed mark
#: named in the design notes' history, the misspelling the docs show)
NOT_READ = {"HPCASYNC_INJECT", "HPCASYNC_ELASTIC_JOINER", "HPCASYNC_GROW_BAK"}


def test_every_name_the_repository_reads_is_known():
    found = set()
    for path in [*REPO.glob("hpcasync/**/*.py"), *REPO.glob("tests/**/*.py"),
                 *REPO.glob("scripts/*"), *REPO.glob("slurm/*"), *REPO.glob(".ci/*"),
                 *REPO.glob("experiments/**/*.py"), *REPO.glob("docs/**/*.md"),
                 REPO / "README.md"]:
        if path.is_file() and path.name not in ("test_environ.py", "environ.py"):
            found |= set(NAME.findall(path.read_text(errors="replace")))
    assert found - NOT_READ - environ.KNOWN == set()
    assert environ.KNOWN - found == set()         # (none listed that nothing names)


def test_an_unknown_name_is_said_with_the_nearest_known_one():
    env = {"HPCASYNC_GROW_BAK": "1", "HPCASYNC_ARRIVAL_TIMEOUT": "5", "HPCASYNC_ZZZ": "x",
           "PATH": "/bin"}
    assert environ.unknown(env) == [("HPCASYNC_GROW_BAK", "HPCASYNC_GROW_BACK"),
                                    ("HPCASYNC_ZZZ", None)]
    script = ("import hpcasync; hpcasync.init('ssgd'); "
              "hpcasync.init('ssgd')")       # (said once a process)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env=clean_env(HPCASYNC_GROW_BAK="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    said = [ln for ln in out.stderr.splitlines() if "not read by hpcasync" in ln]
    assert len(said) == 1 and "HPCASYNC_GROW_BAK (HPCASYNC_GROW_BACK?)" in said[0], out.stderr


def test_a_timeout_that_is_not_a_number_is_one_line():
    """``HPCASYNC_ARRIVAL_TIMEOUT=abc`` (and ``HPCASYNC_EXIT_TIMEOUT``, read by ``init``): one
    line naming it (they were Python's ValueError, the exit's in an atexit traceback)."""
    import pytest

    from hpcasync.errors import ConfigError

    assert environ.seconds("X", 60, {}) == 60 and environ.seconds("X", 60, {"X": " 2.5 "}) == 2.5
    for bad in ("abc", "-1", "nan"):
        with pytest.raises(ConfigError, match=rf"X='{re.escape(bad)}' is not a number of seconds"):
            environ.seconds("X", 60, {"X": bad})
    out = subprocess.run([sys.executable, "-c", "import hpcasync; hpcasync.init('ssgd')"],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=clean_env(HPCASYNC_EXIT_TIMEOUT="abc"))
    assert out.returncode != 0
    assert "HPCASYNC_EXIT_TIMEOUT='abc' is not a number of seconds" in out.stderr.splitlines()[-1]
