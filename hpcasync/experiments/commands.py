"""The ``hpcasync experiment`` and ``hpcasync report`` commands (options and handlers).

    hpcasync experiment experiments/shat.toml [--mini] [--out DIR] [--only KEY=VAL ...]
                        [--timeout S] [--jobs N] [--no-report]
    hpcasync report experiments/results/shat [--out DIR]

Kept free of heavy imports: ``hpcasync --help`` builds these parsers.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

log = logging.getLogger("hpcasync")


def add_experiment_arguments(p) -> None:
    p.add_argument("file", help="experiment file (TOML), e.g. experiments/shat.toml")
    p.add_argument("--mini", action="store_true",
                   help="the file's [mini] version: the whole study in seconds (CI)")
    p.add_argument("--out", default=None,
                   help="output directory (default: results/<name>/ next to the file; "
                        "results/<name>-mini/ with --mini)")
    p.add_argument("--only", action="append", default=[], metavar="KEY=VAL",
                   help="run only the cells with this axis value (repeatable; same key: any of)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per run (default: the file's timeout, else 1800)")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs at a time, sim experiments only (default: the file's jobs, else 1)")
    p.add_argument("--retry-failed", action="store_true",
                   help="rerun the runs an earlier invocation recorded as failed (<id>.failed)")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")


def add_report_arguments(p) -> None:
    p.add_argument("dir", help="an experiment's output directory (holding experiment.json, runs/)")
    p.add_argument("--out", default=None, help="write report.md and the PNGs here (default: DIR)")


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[%(asctime)s] %(message)s",
                        datefmt="%H:%M:%S", force=True)


def default_out(file: str, name: str, mini: bool) -> Path:
    return Path(file).parent / "results" / (f"{name}-mini" if mini else name)


def experiment_main(ns) -> int:
    from .report import write_report
    from .runner import run_experiment
    from .spec import load_spec

    _logging()
    spec = load_spec(ns.file, mini=ns.mini, check_runs=False)   # the runner checks its runs
    out = Path(ns.out) if ns.out else default_out(ns.file, spec.name, ns.mini)
    log.info("experiment %s%s: %d runs -> %s", spec.name, " (mini)" if ns.mini else "",
             len(spec.runs), out)
    result = run_experiment(spec, out, only=ns.only, timeout=ns.timeout, jobs=ns.jobs,
                            retry_failed=ns.retry_failed)
    log.info("experiment %s: %d ran, %d skipped (finished before), %d failed, %d failed before",
             spec.name, len(result.ran), len(result.skipped), len(result.failed),
             len(result.failed_before))
    if not ns.no_report:
        paths = write_report(out)
        log.info("report: %s", paths[0])
    failed = result.failed + result.failed_before
    if failed:
        log.warning("%d run(s) failed (see %s/runs/*.failed): %s", len(failed), out,
                    ", ".join(failed))
        return 1
    return 0


def report_main(ns) -> int:
    from .report import write_report

    _logging()
    paths = write_report(ns.dir, ns.out)
    log.info("wrote %s", ", ".join(str(p) for p in paths))
    return 0
