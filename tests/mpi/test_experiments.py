"""Experiments: a miniature of each study file runs (``hpcasync experiment --mini``) and reports,
on rank 0 (the runner starts its own processes and MPI jobs). The file format, the runner's resume
after a SIGKILL and the report's figures: tests/unit/test_experiments.py.

The simulated studies launch no MPI job; they are here, not in tests/unit, for the time budget of
tests/unit (about 2 minutes of simulation together), and are marked ``no_mpi``; the MPI studies
are ``one_mpi`` (their runs are CLI jobs of algorithms tested under every MPI): the MPICH pass of
CI (which repeats tests/mpi under another MPI) leaves both out."""
from __future__ import annotations

import re

import pytest

from tests.mpi_util import REPO, run_cli

pytestmark = pytest.mark.rank0

STUDIES = ("shat", "smega2", "delay_compensation", "delay_compensation_64", "odsgd", "daso",
           "heterogeneity", "ps_shards", "async_optimal")


def _studies():
    """Every study file of experiments/, marked ``no_mpi`` when its mode is "sim"."""
    from hpcasync.experiments.spec import load_spec

    for study in STUDIES:
        sim = load_spec(REPO / "experiments" / f"{study}.toml", mini=True,
                        check_runs=False).mode == "sim"
        # an MPI study's runs are CLI jobs whose MPI paths are the algorithms' own tests': one_mpi
        yield pytest.param(study, marks=[pytest.mark.no_mpi if sim else pytest.mark.one_mpi],
                           id=study)


@pytest.mark.parametrize("study", list(_studies()))
def test_mini_study_runs_and_reports(study, tmp_path):
    from hpcasync.experiments.report import write_report
    from hpcasync.experiments.spec import load_spec

    path = REPO / "experiments" / f"{study}.toml"
    spec = load_spec(path, mini=True, check_runs=False)
    full = load_spec(path, check_runs=False)
    assert full.name == study and len(full.runs) > len(spec.runs)
    out = tmp_path / study
    planned = len(spec.runs)
    r = run_cli(["experiment", str(path), "--mini", "--out", str(out)], timeout=400)
    if r.returncode == 2 and "Horovod is not installed" in r.stderr:   # (checked before any run)
        variants = spec.axes["variant"]
        only = [f"--only=variant={v}" for v in variants if "horovod" not in v]
        spec.runs = [r for r in spec.runs if "horovod" not in r.axes["variant"]]
        r = run_cli(["experiment", str(path), "--mini", "--out", str(out), *only], timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    text = (out / "report.md").read_text()
    done = len(spec.runs)
    assert f"{done} of {planned} runs finished, 0 failed, {planned - done} not run" in text
    axes = [a for a in spec.axes if a != "seed"]
    for run in spec.runs:                         # every cell has a row with an accuracy
        cells = " | ".join(str(run.axes[a]) for a in axes)
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| {cells} | ")), None)
        assert row is not None, (cells, text)
        acc = row.split(" | ")[len(axes) + 1]
        assert re.fullmatch(r"\d+\.\d\d", acc), row
    again = write_report(out, tmp_path / "again")  # a second report: the same bytes
    for p in again:
        assert p.read_bytes() == (out / p.name).read_bytes(), p.name
