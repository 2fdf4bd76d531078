"""Declarative experiments: a TOML file names a matrix of runs; a runner executes it (simulator or
real MPI), resuming a half-done matrix; a report turns the runs into markdown tables and PNG plots.

    spec = load_spec("experiments/shat.toml", mini=True)      # -> Spec with .runs
    run_experiment(spec, "out/shat")                         # out/shat/runs/<id>.jsonl
    write_report("out/shat")                                 # out/shat/report.md + *.png

The file format is documented in ``experiments/README.md`` and in :mod:`.spec`.
"""
from .spec import Run, Spec, load_spec

__all__ = ["Run", "Spec", "load_spec", "run_experiment", "write_report"]


def run_experiment(*args, **kwargs):
    from .runner import run_experiment as _run

    return _run(*args, **kwargs)


def write_report(*args, **kwargs):
    from .report import write_report as _write

    return _write(*args, **kwargs)
