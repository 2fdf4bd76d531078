"""The simulator runs the same rules as the MPI parameter server: with one worker both are
deterministic, so the same options give bitwise the same θ (the SHA-256 of the final parameters in
the summaries) after an epoch, for every rule. Rank 0 launches both sides once for every rule this
session runs, side by side: a 2-rank MPI job (``python -m tests.mpi.test_sim_equals_mpi mpi``) and
one process (``... sim``), each running the command line's own entry point (``hpcasync.cli.main``:
``train`` there, ``sim --workers 1`` here) once per rule, in a row, as tests/mpi/test_resume_all.py
and test_ps_shards.py do. That spares 10 job and 10 process start-ups (each rule was a 2-rank job
and a ``hpcasync sim`` process of its own, ~9 CPU-s a pair).

What this cannot see: learning-rate schedules. Every warm-up starts at lr/N, which is lr at N = 1,
so the factor is 1 throughout (a planted off-by-one in the simulator's warm-up clock passed here);
the server's warm-up is checked in tests/mpi/test_api.py. A planted change of the simulator's data
order fails it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

COMMON = ["--dataset", "fashion-mnist-mini", "--train-limit", "640", "--test-limit", "200",
          "--epochs", "1", "--batch-size", "32", "--progress", "off", "--seed", "3"]


def _args(side: str, algorithm: str, metrics: Path) -> list[str]:
    """The command line of one rule's run on ``side`` ("mpi": the 2-rank job, "sim": the
    simulator with one worker)."""
    head = ["train"] if side == "mpi" else ["sim", "--workers", "1"]
    return [*head, "--algorithm", algorithm, *COMMON, "--metrics", str(metrics)]


# -- the runs (the job's two ranks, or the simulator's one process, run this) ---------------------

def _main(side: str, out: Path, algorithms: list[str]) -> None:
    from hpcasync import cli         # first: it keeps mpi4py from starting MPI at import

    codes: dict[str, int] = {}
    for name in algorithms:
        try:
            code = cli.main(_args(side, name, out / f"{name}-{side}.jsonl"))
        except SystemExit as exc:
            code = exc.code
        codes[name] = code
    every = [codes]
    if side == "mpi":
        from mpi4py import MPI

        every = MPI.COMM_WORLD.gather(codes, root=0)
        if MPI.COMM_WORLD.Get_rank() != 0:
            return
    # a rule's status: its first non-zero one over the ranks (what that rule's own job exited with)
    worst = {name: next((c[name] for c in every if c.get(name)), 0) for name in algorithms}
    (out / f"codes-{side}.json").write_text(json.dumps(worst))


if __name__ == "__main__":
    _main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
    sys.exit(0)


import pytest  # noqa: E402

from hpcasync.ps.optimizer import ALGORITHMS  # noqa: E402
from tests.mpi_util import (REPO, clean_env, last_summary, per_algorithm,  # noqa: E402
                            run_mpi, selected)

_runs: dict = {}


def _both_sides(request, tmp_path_factory) -> Path:
    """Run both sides once for every selected rule (the MPI job and the simulator side by side);
    returns their folder."""
    if "out" not in _runs:
        out = tmp_path_factory.mktemp("sim_equals_mpi")
        rules = selected(request)
        me = [sys.executable, "-m", "tests.mpi.test_sim_equals_mpi"]
        sim = subprocess.Popen([*me, "sim", str(out), *rules], env=clean_env(), cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            mpi = run_mpi(2, ["--", *me, "mpi", str(out), *rules], timeout=90 + 60 * len(rules))
            sim_out, sim_err = sim.communicate(timeout=90 + 60 * len(rules))
        finally:
            if sim.poll() is None:
                sim.kill()
                sim.communicate()
        _runs.update(out=out, mpi=mpi, sim=(sim.returncode, sim_err))
    return _runs["out"]


# per_algorithm: a rule whose MPI traffic is a twin's (tests.mpi_util.MPI_TWINS) is one_mpi: its
# MPI run differs from the twin's only in the server's math (torch, no MPI), and the simulator side
# launches no MPI job, so CI's MPICH pass runs the twins (asgd, lcasgd, shat, smega2) only.
@pytest.mark.rank0
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("algorithm", per_algorithm(ALGORITHMS))
def test_simulator_equals_mpi_runtime_with_one_worker(algorithm, request, tmp_path_factory):
    out = _both_sides(request, tmp_path_factory)
    mpi, (sim_code, sim_err) = _runs["mpi"], _runs["sim"]
    codes = json.loads(p.read_text()) if (p := out / "codes-mpi.json").exists() else {}
    assert mpi.returncode == 0 and codes.get(algorithm) == 0, (codes, mpi.stderr[-2000:])
    codes = json.loads(p.read_text()) if (p := out / "codes-sim.json").exists() else {}
    assert sim_code == 0 and codes.get(algorithm) == 0, (codes, sim_err[-2000:])
    ours = last_summary(out / f"{algorithm}-mpi.jsonl")
    theirs = last_summary(out / f"{algorithm}-sim.jsonl")
    assert ours["test_loss"] == theirs["test_loss"]
    assert ours["params_sha256"] == theirs["params_sha256"]
