"""Experiments: the file format (one-line errors, the matrix it expands to), the runner's resume
after a SIGKILL (finished runs untouched, every run done exactly once, no orphan left; simulated
runs, no MPI job) and the report (hand-computed figures, byte-identical output). A miniature of
each study: tests/mpi/test_experiments.py."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpcasync.errors import ConfigError
from tests.mpi_util import REPO, clean_env, run_cli, wait_for

TINY_BASE = {"dataset": "fashion-mnist-mini", "train_limit": 256, "test_limit": 100, "epochs": 1}


def _spec(**top):
    from hpcasync.experiments.spec import parse_spec

    data = {"name": "t", "mode": "sim", "base": dict(TINY_BASE),
            "matrix": {"seed": [0, 1], "algorithm": ["asgd", "ssgd"]}}
    data.update(top)
    return parse_spec(data, source="t.toml", check_runs=False)


@pytest.mark.parametrize("top, needle", [
    ({"colour": "red"}, "t.toml: unknown key(s): colour"),
    ({"mode": "gpu"}, "t.toml: mode 'gpu' is not one of: sim, mpi"),
    ({"matrix": {"seed": []}}, "t.toml: [matrix] seed is empty"),
    ({"matrix": {}}, "t.toml: [matrix] is empty"),
    ({"base": {"lrr": 0.1}}, "t.toml: [base] unknown option 'lrr'"),
    ({"base": {"metrics": "x.jsonl"}}, "[base] metrics: set by the runner"),
    ({"matrix": {"sed": [0]}}, "[matrix] unknown option 'sed'"),
    ({"mode": "mpi"}, "mode mpi needs ranks"),
    ({"report": {"rows": "workers"}}, "[report] rows = 'workers' is not an axis"),
    ({"report": {"target": 85}}, "[report] target must be an accuracy in (0, 1]"),
    ({"report": {"columns": "seed"}}, "[report] columns cannot be seed"),
    ({"mini": {"matrix": {"workers": [2]}}}, "[mini.matrix] workers: no such axis"),
    ({"overrides": [{"match": {"lr": 1}, "set": {"lr": 0.1}}]}, "no such axis 'lr'"),
    ({"matrix": [{"seed": [0]}, {"algorithm": ["asgd"]}]}, "must name the same axes"),
])
def test_spec_errors_are_one_line_config_errors(top, needle):
    with pytest.raises(ConfigError) as info:
        _spec(**top)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_spec_run_checks_and_cli_error(tmp_path):
    from hpcasync.experiments.spec import parse_spec

    data = {"name": "t", "base": {**TINY_BASE, "lc_predictor": "lstm"},   # lcasgd's, given asgd
            "matrix": {"algorithm": ["asgd"]}}
    with pytest.raises(ConfigError, match=r"run algorithm=asgd: --lc-predictor applies to lcasgd"):
        parse_spec(data, source="t.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\nmode = "sim"\n[matrix]\nseed = []\n')
    r = run_cli(["experiment", str(bad), "--out", str(tmp_path / "o")], timeout=60)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("hpcasync: error")]
    assert r.returncode == 2 and errors == [f"hpcasync: error: {bad}: [matrix] seed is empty"]


def test_matrix_blocks_variants_overrides_and_ids():
    spec = _spec(matrix=[{"seed": [0, 1], "workers": [2, 4]}, {"seed": [0], "workers": [8]}],
                 variants=[{"label": "plain", "algorithm": "asgd"},
                           {"label": "lc-oracle", "algorithm": "lcasgd", "lc_predictor": "oracle"}],
                 overrides=[{"match": {"workers": 8, "variant": ["plain"]}, "set": {"lr": 0.01}}],
                 mini={"base": {"epochs": 3}, "matrix": {"seed": [5], "variant": ["plain"]}})
    assert [r.id for r in spec.runs][:3] == ["seed=0__variant=plain__workers=2",
                                             "seed=0__variant=lc-oracle__workers=2",
                                             "seed=0__variant=plain__workers=4"]
    assert len(spec.runs) == 2 * 2 * 2 + 2 and spec.axes["workers"] == [2, 4, 8]
    by_id = {r.id: r for r in spec.runs}
    assert by_id["seed=0__variant=plain__workers=8"].options["lr"] == 0.01
    assert "lr" not in by_id["seed=0__variant=lc-oracle__workers=8"].options
    assert by_id["seed=1__variant=lc-oracle__workers=4"].options == {
        **TINY_BASE, "seed": 1, "workers": 4, "algorithm": "lcasgd", "lc_predictor": "oracle"}
    from hpcasync.experiments.spec import parse_spec

    mini = parse_spec({"name": "t", "base": dict(TINY_BASE), "matrix": {"seed": [0, 1]},
                       "variants": [{"label": "a", "algorithm": "asgd"},
                                    {"label": "b", "algorithm": "ssgd"}],
                       "mini": {"base": {"epochs": 3}, "matrix": {"seed": [5], "variant": ["b"]}}},
                      mini=True, check_runs=False)
    assert [(r.id, r.options["epochs"]) for r in mini.runs] == [("seed=5__variant=b", 3)]
    # [[mini.overrides]]: for --mini only, after the others (an option one algorithm owns)
    table = {"overrides": [{"match": {"algorithm": "asgd"}, "set": {"lr": 0.2}}],
             "mini": {"overrides": [{"match": {"algorithm": "asgd"}, "set": {"lr": 0.3}},
                                    {"match": {"algorithm": "ssgd"}, "set": {"epochs": 2}}]}}
    for mini, want in ((False, {"asgd": (0.2, 1), "ssgd": (None, 1)}),
                       (True, {"asgd": (0.3, 1), "ssgd": (None, 2)})):
        spec = _spec(**table) if not mini else parse_spec(
            {"name": "t", "mode": "sim", "base": dict(TINY_BASE),
             "matrix": {"seed": [0], "algorithm": ["asgd", "ssgd"]}, **table},
            mini=True, check_runs=False)
        got = {r.axes["algorithm"]: (r.options.get("lr"), r.options["epochs"])
               for r in spec.runs if r.axes["seed"] == 0}
        assert got == want, (mini, got)
    with pytest.raises(ConfigError, match="no such axis 'workers'"):
        _spec(mini={"overrides": [{"match": {"workers": 2}, "set": {"lr": 0.1}}]})


@pytest.mark.parametrize("argv, line", [
    (["--checkpoint-dir", "."], "--checkpoint-dir applies to hpcasync train"),
    (["--grow-back"], "--grow-back applies to hpcasync train"),
    (["--ssgd-bucket-mb", "1"], "--ssgd-bucket-mb applies to hpcasync train"),
    (["--device", "cuda"], "--device cuda applies to hpcasync train"),
    (["--daso-cast", "fp16"], "--daso-cast applies to daso, not ssgd"),
])
def test_the_simulator_refuses_what_it_would_ignore(argv, line):
    """An ``hpcasync train`` option the simulator has no use for (checkpoints, grow-back, SSGD's
    buckets, a GPU, another family's): one line, not a run that ignored it."""
    from hpcasync import config
    from hpcasync.options import command_parser
    from hpcasync.sim.driver import check

    def cfg(*more):
        return config.config_from_args(command_parser("sim").parse_args(
            ["--algorithm", "ssgd", "--workers", "2", *more, *[
                f"--{k.replace('_', '-')}={v}" for k, v in TINY_BASE.items()]]))

    with pytest.raises(ConfigError, match=line):
        check(cfg(*argv))
    check(cfg("--device", "cpu", "--ps-ranks", "1"))


# ------------------------------------------------------------------------------------ resume

def _runner_log(text: str, what: str) -> list[str]:
    return re.findall(rf"\] {what} (\S+)", text)


def _procs_mentioning(needle: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle in (d / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(d.name))
            except OSError:
                continue
    return [p for p in pids if p != os.getpid()]


def test_resume_after_sigkill_redoes_nothing_finished(tmp_path):
    exp = tmp_path / "tiny.toml"
    exp.write_text('name = "tiny"\nmode = "sim"\n[base]\ndataset = "fashion-mnist-mini"\n'
                   'train_limit = 512\ntest_limit = 100\nepochs = 1\n'
                   '[matrix]\nseed = [0, 1]\nalgorithm = ["asgd", "ssgd"]\n')
    out = tmp_path / "out"
    runs = out / "runs"
    log1 = tmp_path / "first.log"
    with open(log1, "w") as fh:
        first = subprocess.Popen([sys.executable, "-m", "hpcasync", "experiment", str(exp),
                                  "--out", str(out), "--no-report"], cwd=REPO, env=clean_env(),
                                 stdout=fh, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: any(p.suffix == ".jsonl" for p in runs.glob("*.jsonl")), 120,
                 "a first finished run")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    # the child that was running dies with the runner (no orphan can finish a run later)
    wait_for(lambda: not _procs_mentioning(str(out)), 20, "the killed runner's children to end")
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in runs.glob("*.jsonl")}
    started1 = _runner_log(log1.read_text(), "start")
    assert finished and len(finished) < 4, (finished, log1.read_text())

    second = subprocess.run([sys.executable, "-m", "hpcasync", "experiment", str(exp),
                             "--out", str(out)], cwd=REPO, env=clean_env(), capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    started2 = _runner_log(second.stderr, "start")
    skipped2 = _runner_log(second.stderr, "skip")
    all_ids = {f"algorithm={a}__seed={s}" for a in ("asgd", "ssgd") for s in (0, 1)}
    done_before = {n[:-len(".jsonl")] for n in finished}
    assert set(skipped2) == done_before and done_before <= set(started1)
    assert sorted(started2) == sorted(all_ids - done_before)      # each once, none finished again
    for name, stat in finished.items():                           # finished files untouched
        p = runs / name
        assert (p.stat().st_ino, p.stat().st_mtime_ns) == stat
    names = {p.name for p in runs.iterdir()}
    assert {n for n in names if not n.endswith(".load")} == {f"{i}.jsonl" for i in all_ids}
    # + the load-average record of each run the runner saw end (a run that ended as the first
    # runner was killed may have none)
    assert {f"{i}.load" for i in started2} <= names <= {f"{i}.{e}" for i in all_ids
                                                         for e in ("jsonl", "load")}
    from hpcasync.experiments.runner import is_finished
    assert all(is_finished(runs / f"{i}.jsonl") for i in all_ids)
    report = (out / "report.md").read_text()
    assert "4 of 4 runs finished, 0 failed, 0 not run" in report


# ------------------------------------------------------------------------------------ report

def _synthetic(out: Path) -> None:
    """Hand-made records: asgd 2 seeds finished; ssgd 1 finished, 1 diverged; dana 1 diverged;
    the rest not run."""
    runs = out / "runs"
    runs.mkdir(parents=True)
    exp = {"name": "syn", "mode": "sim", "mini": False, "source": "syn.toml",
           "axes": {"algorithm": ["asgd", "ssgd", "dana"], "seed": [0, 1, 2], "workers": [4]},
           "base": {"epochs": 2}, "overrides": [], "runs": [],
           "report": {"time": "sim_time", "target": 0.8, "rows": "algorithm", "columns": "workers"}}
    accs = {("asgd", 0): (0.70, 0.80), ("asgd", 1): (0.75, 0.84), ("ssgd", 0): (0.78, 0.79)}
    for a in ("asgd", "ssgd", "dana"):
        for s in (0, 1, 2):
            rid = f"algorithm={a}__seed={s}__workers=4"
            exp["runs"].append({"id": rid, "axes": {"algorithm": a, "seed": s, "workers": 4},
                                "options": {}, "ranks": None, "argv": []})
            if (a, s) in accs:
                recs = [{"event": "config", "config": {}}]
                for e, acc in enumerate(accs[(a, s)], 1):
                    recs.append({"event": "epoch", "epoch": e, "test_accuracy": acc,
                                 "sim_time": 1.5 * e + s, "wall_time_s": 9.0,
                                 "compute_time_s": 0.5 * e, "wait_time_s": 0.25,
                                 **({"staleness_histogram": {"0": 1, "3": 3},
                                     "ps_state_bytes": 2048} if a == "asgd" else {})})
                recs.append({"event": "summary", "test_accuracy": accs[(a, s)][1],
                             "sim_time": 3.0 + s, "wall_time_s": 9.0})
                (runs / f"{rid}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    for rid in ("algorithm=ssgd__seed=1__workers=4", "algorithm=dana__seed=0__workers=4"):
        (runs / f"{rid}.failed").write_text(
            "exit status 2\ncommand: x\nhpcasync: error: training diverged at step 3\n")
    (out / "experiment.json").write_text(json.dumps(exp))


def test_report_figures_and_byte_identical_output(tmp_path):
    from hpcasync.experiments.report import write_report

    out = tmp_path / "syn"
    _synthetic(out)
    first = write_report(out)
    second = write_report(out, tmp_path / "again")
    assert [p.name for p in first] == [p.name for p in second] == [
        "report.md", "accuracy_vs_time.png", "accuracy_vs_epoch.png", "staleness.png",
        "time_breakdown.png"]
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes(), a.name
    text = first[0].read_text()
    # asgd: acc (0.80, 0.84) -> 82.00 ± 2.83; sim time (3, 4) -> 3.50 ± 0.71, per epoch 1.750 ±
    # 0.354; 80 % first reached at epoch 2 (3.0) and epoch 2 (4.0) -> 3.50 ± 0.71; PS 2 KiB;
    # staleness (0·1 + 3·3)/4 = 2.25
    assert ("| asgd | 4 | 2/3 | 82.00 ± 2.83 | 3.50 ± 0.71 | 1.750 ± 0.354 | 3.50 ± 0.71 | "
            "2.0 ± 0.0 | 2.25 ± 0.00 | 9.0 ± 0.0 |") in text
    assert ("| ssgd | 4 | 1/3 (1 diverged) | 79.00 | 3.00 | 1.500 | not reached | – | – | 9.0 |"
            in text)
    assert "| dana | 4 | 0/3 (1 diverged) | diverged | – | – | – | – | – | – |" in text
    assert ("| algorithm \\ workers | 4 |\n|---|---|\n| asgd | 82.00 ± 2.83 |\n| ssgd | 79.00 |\n"
            "| dana | diverged |") in text
    assert ("- `algorithm=ssgd__seed=1__workers=4`: exit status 2: hpcasync: error: training "
            "diverged") in text
    assert "## Not run yet\n\n- `algorithm=asgd__seed=2__workers=4`\n" in text



def test_a_boolean_option_is_a_switch():
    from hpcasync.experiments.spec import option_args

    assert option_args({"ringmaster_stop": True, "rennala_stop": False, "workers": 4}) == [
        "--ringmaster-stop", "--workers", "4"]
