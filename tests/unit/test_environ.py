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


def test_each_variable_of_a_form_refuses_a_value_of_another():
    """A switch given ``no`` (``HPCASYNC_HOROVOD_AGREE=no`` was read as on), a timeout that is no
    number (``HPCASYNC_STARTUP_TIMEOUT=abc`` fell back to 300 s), a word not among its choices
    (``HPCASYNC_MALLOC=off`` left the tuning on): one ConfigError naming the variable, from
    :func:`environ.check` (``hpcasync.init``'s); the valid forms read as meant."""
    import pytest

    from hpcasync.errors import ConfigError

    bad = {"seconds": "abc", "switch": "maybe"}
    for name, form in environ.FORMS.items():
        environ.check({name: "" if form != "seconds" else "5"})
        with pytest.raises(ConfigError, match=re.escape(name)):
            environ.check({name: bad.get(form, "nonsense")})
    assert [environ.switch("S", d, {"S": v}) for d, v in
            ((True, "no"), (True, "OFF"), (False, "yes"), (False, "1"), (True, ""))] == \
        [False, False, True, True, True]
    assert environ.word("HPCASYNC_MALLOC", {"HPCASYNC_MALLOC": "Default"}) == "default"
    # every variable the package reads as a number, switch or word is in FORMS (a read outside
    # the helpers would skip the check)
    helpers = re.compile(r"environ\.(seconds|switch|word)\(\s*\"(HPCASYNC_[A-Z_]+)\"|"
                         r"(?:seconds|switch)\(\s*\"(HPCASYNC_[A-Z_]+)\"")
    read = set()
    for path in REPO.glob("hpcasync/**/*.py"):
        for m in helpers.finditer(path.read_text()):
            read.add(m.group(2) or m.group(3))
    assert read and read <= set(environ.FORMS), read - set(environ.FORMS)


def test_a_bad_value_ends_init_and_the_cli_in_one_line():
    for env in ({"HPCASYNC_HOROVOD_AGREE": "no way"}, {"HPCASYNC_STARTUP_TIMEOUT": "abc"}):
        name = next(iter(env))
        out = subprocess.run([sys.executable, "-c", "import hpcasync; hpcasync.init('ssgd')"],
                             cwd=REPO, capture_output=True, text=True, timeout=120,
                             env=clean_env(**env))
        assert out.returncode != 0 and name in out.stderr.splitlines()[-1], out.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "hpcasync", "train", "--algorithm", "ssgd",
                          "--epochs", "1", "--train-limit", "256"], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env=clean_env(HPCASYNC_MALLOC="off"))
    assert out.returncode != 0, out.stderr[-2000:]
    assert "HPCASYNC_MALLOC='off'" in out.stderr.splitlines()[-1], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
