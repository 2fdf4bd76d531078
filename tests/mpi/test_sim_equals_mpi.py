"""The simulator runs the same rules as the MPI parameter server: with one worker both are
deterministic, so the same options give bitwise the same θ (the SHA-256 of the final parameters in
the summaries) after an epoch, for every rule. Rank 0 launches both (a 2-rank MPI job and
``hpcasync sim --workers 1``).

What this cannot see: learning-rate schedules. Every warm-up starts at lr/N, which is lr at N = 1,
so the factor is 1 throughout (a planted off-by-one in the simulator's warm-up clock passed here);
the server's warm-up is checked in tests/mpi/test_api.py. A planted change of the simulator's data
order fails it."""
from __future__ import annotations

import pytest

from hpcasync.ps.optimizer import ALGORITHMS
from tests.mpi_util import last_summary, per_algorithm, run_cli, run_mpi

COMMON = ["--dataset", "fashion-mnist-mini", "--train-limit", "640", "--test-limit", "200",
          "--epochs", "1", "--batch-size", "32", "--progress", "off", "--seed", "3"]


# per_algorithm: a rule whose MPI traffic is a twin's (tests.mpi_util.MPI_TWINS) is one_mpi: its
# MPI run differs from the twin's only in the server's math (torch, no MPI), and the simulator side
# launches no MPI job, so CI's MPICH pass runs the twins (asgd, lcasgd, shat, smega2) only.
@pytest.mark.rank0
@pytest.mark.parametrize("algorithm", per_algorithm(ALGORITHMS))
def test_simulator_equals_mpi_runtime_with_one_worker(algorithm, tmp_path):
    extra: list[str] = []
    mpi, sim = tmp_path / "mpi.jsonl", tmp_path / "sim.jsonl"
    a = run_mpi(2, ["train", "--algorithm", algorithm, *COMMON, *extra, "--metrics", str(mpi)],
                timeout=180)
    assert a.returncode == 0, a.stderr[-2000:]
    b = run_cli(["sim", "--workers", "1", "--algorithm", algorithm, *COMMON, *extra,
                 "--metrics", str(sim)], timeout=180)
    assert b.returncode == 0, b.stderr[-2000:]
    ours, theirs = last_summary(mpi), last_summary(sim)
    assert ours["test_loss"] == theirs["test_loss"]
    assert ours["params_sha256"] == theirs["params_sha256"]
