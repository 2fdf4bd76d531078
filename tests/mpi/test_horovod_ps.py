"""A parameter-server algorithm under the Horovod facade ends with every worker holding the
server's final model, although a Horovod script never calls ``finish()``: given ``epochs=`` and
``steps_per_epoch=``, each worker finishes after its last step; without them one warning line
says what to pass (or call). Runs its own 4-rank jobs (1 server + 3 workers)."""
from __future__ import annotations

import re

import pytest

from tests.mpi_util import REPO, run_mpi

SCRIPT = str(REPO / "tests" / "horovod_ps_script.py")


def _digests(out: str) -> dict[int, str]:
    return {int(r): d for r, d in re.findall(r"^DIGEST (\d+) (\w+)$", out, re.M)}


@pytest.mark.rank0
@pytest.mark.timeout(200)
@pytest.mark.one_mpi       # MPICH: the PS front door's MPI paths are test_ps_practices' and test_ps's
def test_workers_end_with_the_servers_model():
    import sys

    r = run_mpi(4, ["--", sys.executable, SCRIPT, "smega2", "2", "5"], timeout=150)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    digests = _digests(r.stdout)
    assert len(digests) == 3 and len(set(digests.values())) == 1, digests


@pytest.mark.rank0
@pytest.mark.timeout(200)
@pytest.mark.one_mpi       # MPICH: the PS front door's MPI paths are test_ps_practices' and test_ps's
def test_without_the_runs_length_one_line_says_what_to_do():
    import sys

    r = run_mpi(4, ["--", sys.executable, SCRIPT, "smega2", "1", "4", "--no-length"], timeout=150)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    said = [line for line in r.stderr.splitlines() if "own copy of the model" in line]
    assert len(said) == 1 and "epochs= and steps_per_epoch=" in said[0], r.stderr[-3000:]
