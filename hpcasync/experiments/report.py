"""``hpcasync report DIR``: an experiment's runs -> ``report.md`` (tables) and PNG plots.

Reads ``DIR/experiment.json`` (written by the runner: axes, runs, report settings) and the runs'
metrics streams ``DIR/runs/<id>.jsonl`` (plus ``<id>.failed``). Runs that differ only in ``seed``
form a group; each group's row gives mean ± sample standard deviation over its finished seeds (n
shown) of:

* final test accuracy (the summary's, else the last epoch's);
* time: ``sim_time`` (simulated seconds) or the run's wall time (``[report] time``), in total and
  per epoch;
* time to the target accuracy (``[report] target``): the time of the first epoch record at or above
  it, "not reached" when no seed got there ("k/n" when some did);
* PS memory: the rule's state bytes and, where the runs record them, the transport's bytes and
  the total (``ps_transport_bytes``, ``ps_total_bytes``: ``ps.memory``); mean staleness (from
  the staleness histogram) where the runs record it.
* bytes sent (MPI runs that record ``bytes_communicated``: the sum over the ranks).

The output is a function of the files only: sorted keys, fixed number formats, no clock, PNGs
without the ``Software`` metadata — two reports of the same runs are byte-identical.

Example::

    write_report("experiments/results/shat")      # -> [report.md, accuracy_vs_time.png, ...]
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .spec import PIVOT_NAMES, option_args

TIME_KEYS = {"sim_time": "sim_time", "wall": "wall_time_s"}
TIME_NAMES = {"sim_time": "sim time", "wall": "wall time"}
SEED = "seed"


@dataclass
class RunStats:
    """What the report needs from one finished run."""

    id: str
    axes: dict[str, Any]
    final_acc: float | None
    time: float | None
    wall: float | None
    epochs: int
    curve: list[tuple[int, float | None, float]]          # (epoch, time, test accuracy)
    time_to_target: float | None
    ps_state_bytes: float | None
    staleness: dict[int, int]
    breakdown: dict[str, float]                            # field -> mean seconds per epoch
    ps_transport_bytes: float | None = None                # None: the run does not record it
    ps_total_bytes: float | None = None
    ps_busy: float | None = None                           # simulated server: busy share, mean
    ps_wait: float | None = None                           # ... and mean wait per push (s)
    bytes_sent: float | None = None                        # the summary's bytes_communicated


@dataclass
class Group:
    key: tuple                                              # ((axis, value), ...) without seed
    runs: list[RunStats] = field(default_factory=list)
    planned: int = 0
    failures: list[str] = field(default_factory=list)        # one-line reasons

    def failure_note(self) -> str:
        """"2 diverged", "1 failed" ... or ""."""
        if not self.failures:
            return ""
        diverged = sum("diverged" in f for f in self.failures)
        parts = [f"{diverged} diverged"] if diverged else []
        if len(self.failures) > diverged:
            parts.append(f"{len(self.failures) - diverged} failed")
        return ", ".join(parts)

    def label(self, skip: tuple[str, ...] = ()) -> str:
        parts = [f"{a}={v}" for a, v in self.key if a not in skip]
        return ", ".join(parts) or "all"

    def value(self, axis: str):
        return dict(self.key).get(axis)


def is_breakdown_field(key: str) -> bool:
    """Epoch fields that are seconds spent in a phase: ``*_s`` but not clocks or maxima
    (``comm_time_s``, ``compute_time_s``, ``daso_blocking_global_s``; not ``wall_time_s``)."""
    return key.endswith("_s") and not key.endswith("_max_s") and key not in ("wall_time_s",
                                                                             "time_s")


def run_stats(rid: str, axes: dict, records: list[dict], time_mode: str,
              target: float | None) -> RunStats:
    tkey = TIME_KEYS[time_mode]
    epochs = [r for r in records if r.get("event") == "epoch"]
    summary = next((r for r in reversed(records) if r.get("event") == "summary"), {})
    last = epochs[-1] if epochs else {}
    acc = summary.get("test_accuracy", last.get("test_accuracy"))
    t = summary.get(tkey, last.get(tkey))
    curve = [(int(r["epoch"]), r.get(tkey), float(r["test_accuracy"])) for r in epochs
             if r.get("test_accuracy") is not None]
    ttt = None
    if target is not None:
        ttt = next((tm for _, tm, a in curve if a >= target and tm is not None), None)
    ps = summary.get("ps_state_bytes", last.get("ps_state_bytes"))
    ps_transport = summary.get("ps_transport_bytes", last.get("ps_transport_bytes"))
    ps_total = summary.get("ps_total_bytes", last.get("ps_total_bytes"))
    hist: dict[int, int] = {}
    if isinstance(summary.get("staleness_histogram"), dict):
        hist = {int(k): int(v) for k, v in summary["staleness_histogram"].items()}
    else:
        for r in epochs:
            for k, v in (r.get("staleness_histogram") or {}).items():
                hist[int(k)] = hist.get(int(k), 0) + int(v)
    fields = sorted({k for r in epochs for k, v in r.items()
                     if is_breakdown_field(k) and isinstance(v, (int, float))})
    breakdown = {k: statistics.fmean(float(r.get(k) or 0.0) for r in epochs) for k in fields}
    return RunStats(id=rid, axes=axes, final_acc=acc, time=t,
                    wall=summary.get("wall_time_s", last.get("wall_time_s")), epochs=len(epochs),
                    curve=curve, time_to_target=ttt, ps_state_bytes=ps, staleness=hist,
                    breakdown=breakdown, ps_transport_bytes=ps_transport, ps_total_bytes=ps_total,
                    ps_busy=_mean_field(epochs, "ps_busy"), ps_wait=_mean_field(epochs, "ps_wait_s"),
                    bytes_sent=_number(summary.get("bytes_communicated")))


def _number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _mean_field(epochs: list[dict], key: str) -> float | None:
    values = [float(r[key]) for r in epochs if isinstance(r.get(key), (int, float))]
    return statistics.fmean(values) if values else None


def load(out: str | Path) -> tuple[dict, list[Group], dict[str, str], list[str]]:
    """(experiment record, groups in matrix order, failures id -> reason, ids not run)."""
    from ..metrics import read_metrics
    from .runner import is_finished, run_dir

    out = Path(out)
    exp_path = out / "experiment.json"
    if not exp_path.is_file():
        raise ConfigError(f"{out}: no experiment.json (run `hpcasync experiment FILE --out {out}`)")
    exp = json.loads(exp_path.read_text(encoding="utf-8"))
    rep = exp.get("report", {})
    rdir = run_dir(out)
    groups: dict[tuple, Group] = {}
    failed: dict[str, str] = {}
    missing: list[str] = []
    for run in exp["runs"]:
        key = tuple((a, run["axes"][a]) for a in exp["axes"] if a != SEED)
        group = groups.setdefault(key, Group(key=key))
        group.planned += 1
        path = rdir / f"{run['id']}.jsonl"
        if is_finished(path):
            load_path = rdir / f"{run['id']}.load"
            if load_path.is_file():
                exp.setdefault("_loads", []).append(json.loads(load_path.read_text(encoding="utf-8")))
            group.runs.append(run_stats(run["id"], run["axes"], read_metrics(path),
                                        rep.get("time", "wall"), rep.get("target")))
        elif (rdir / f"{run['id']}.failed").is_file():
            text = (rdir / f"{run['id']}.failed").read_text(encoding="utf-8", errors="replace")
            failed[run["id"]] = _last_error(text)
            group.failures.append(failed[run["id"]])
        else:
            missing.append(run["id"])
    return exp, list(groups.values()), failed, missing


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    why = lines[0] if lines else "failed"
    errors = [ln for ln in lines if "error" in ln.lower() or "Error" in ln]
    return f"{why}: {errors[-1]}" if errors else why


# ---------------------------------------------------------------------------------- formatting

def _pm(values: list[float], fmt: str, scale: float = 1.0) -> str:
    values = [v * scale for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "–"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.fmean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def _acc(group: Group) -> str:
    """Final accuracy (%) mean ± std; "diverged"/"failed" when no seed finished but some failed."""
    if not group.runs and group.failures:
        return "diverged" if all("diverged" in f for f in group.failures) else "failed"
    return _pm([r.final_acc for r in group.runs], ".2f", 100.0)


def _ttt(group: Group) -> str:
    reached = [r.time_to_target for r in group.runs if r.time_to_target is not None]
    if not group.runs:
        return "–"
    if not reached:
        return "not reached"
    text = _pm(reached, ".2f")
    return text if len(reached) == len(group.runs) else f"{text} ({len(reached)}/{len(group.runs)})"


def _mean_staleness(hist: dict[int, int]) -> float | None:
    n = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / n if n else None


def results_table(exp: dict, groups: list[Group]) -> list[str]:
    rep = exp.get("report", {})
    axes = [a for a in exp["axes"] if a != SEED]
    tname = TIME_NAMES[rep.get("time", "wall")]
    target = rep.get("target")
    runs = [r for g in groups for r in g.runs]
    has_ps = any(r.ps_state_bytes is not None for r in runs)
    has_mem = any(r.ps_transport_bytes is not None for r in runs)
    has_tau = any(r.staleness for r in runs)
    has_bytes = exp["mode"] == "mpi" and any(r.bytes_sent is not None for r in runs)
    sim = exp["mode"] == "sim"
    head = [*axes, "seeds", "final test acc (%)", f"{tname} (s)", f"{tname} / epoch (s)"]
    if target is not None:
        head.append(f"{tname} to {100 * target:g} % (s)")
    if has_ps:
        head.append("PS state (KiB)")
    if has_mem:
        head += ["PS transport (KiB)", "PS total (KiB)"]
    if has_tau:
        head.append("mean staleness")
    if has_bytes:
        head.append("bytes sent, all ranks (MB)")
    if sim:
        head.append("run wall (s)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        rs = g.runs
        row = [str(g.value(a)) for a in axes]
        note = g.failure_note()
        row += [f"{len(rs)}/{g.planned}" + (f" ({note})" if note else ""), _acc(g),
                _pm([r.time for r in rs], ".2f"),
                _pm([r.time / r.epochs for r in rs if r.time is not None and r.epochs], ".3f")]
        if target is not None:
            row.append(_ttt(g))
        if has_ps:
            row.append(_pm([r.ps_state_bytes for r in rs if r.ps_state_bytes is not None], ".1f",
                           1 / 1024))
        if has_mem:
            row += [_pm([r.ps_transport_bytes for r in rs], ".1f", 1 / 1024),
                    _pm([r.ps_total_bytes for r in rs], ".1f", 1 / 1024)]
        if has_tau:
            row.append(_pm([_mean_staleness(r.staleness) for r in rs if r.staleness], ".2f"))
        if has_bytes:
            row.append(_pm([r.bytes_sent for r in rs if r.bytes_sent is not None], ".1f", 1e-6))
        if sim:
            row.append(_pm([r.wall for r in rs], ".1f"))
        lines.append("| " + " | ".join(row) + " |")
    return lines


#: ``[report] pivot`` values: (title, cell formatter)
PIVOTS = {
    "accuracy": ("Final test accuracy (%), mean ± std over seeds", _acc),
    "time_per_epoch": ("Time per epoch (s), mean ± std over seeds",
                       lambda g: _pm([r.time / r.epochs for r in g.runs
                                      if r.time is not None and r.epochs], ".3f")),
    "ps_busy": ("Parameter server busy (% of the time, simulated server), mean over epochs",
                lambda g: _pm([r.ps_busy for r in g.runs if r.ps_busy is not None], ".1f", 100.0)),
    "ps_wait": ("Mean wait of a push for the simulated server (ms)",
                lambda g: _pm([r.ps_wait for r in g.runs if r.ps_wait is not None], ".2f", 1e3)),
}


assert tuple(PIVOTS) == PIVOT_NAMES, "report.PIVOTS and spec.PIVOT_NAMES must list the same pivots"


def pivot_tables(exp: dict, groups: list[Group]) -> list[str]:
    """Rows x columns tables (``[report] pivot``: accuracy by default; time per epoch, PS busy
    share, PS wait), one per value of the remaining axes."""
    rep = exp.get("report", {})
    rows, cols = rep.get("rows"), rep.get("columns")
    if not rows or not cols or rows == cols:
        return []
    return [line for what in rep.get("pivot", ["accuracy"])
            for line in _pivot(exp, groups, rows, cols, *PIVOTS[what])]


def _pivot(exp: dict, groups: list[Group], rows: str, cols: str, heading: str, cell) -> list[str]:
    rest = [a for a in exp["axes"] if a not in (SEED, rows, cols)]
    by_rest: dict[tuple, dict[tuple, Group]] = {}
    for g in groups:
        by_rest.setdefault(tuple(g.value(a) for a in rest), {})[(g.value(rows), g.value(cols))] = g
    out = []
    for rest_key, cells in by_rest.items():
        title = ", ".join(f"{a}={v}" for a, v in zip(rest, rest_key))
        suffix = f": {title}" if title else ""
        out += ["", f"{heading}{suffix}", ""]
        col_vals = [c for c in exp["axes"][cols] if any(k[1] == c for k in cells)]
        row_vals = [r for r in exp["axes"][rows] if any(k[0] == r for k in cells)]
        out.append(f"| {rows} \\ {cols} | " + " | ".join(map(str, col_vals)) + " |")
        out.append("|" + "---|" * (len(col_vals) + 1))
        for rv in row_vals:
            cells_txt = []
            for cv in col_vals:
                g = cells.get((rv, cv))
                cells_txt.append(cell(g) if g else "–")
            out.append(f"| {rv} | " + " | ".join(cells_txt) + " |")
    return out


def render(exp: dict, groups: list[Group], failed: dict[str, str], missing: list[str],
           images: list[tuple[str, str]]) -> str:
    n_runs = sum(g.planned for g in groups)
    n_done = sum(len(g.runs) for g in groups)
    rep = exp.get("report", {})
    mini = " --mini" if exp.get("mini") else ""
    lines = [f"# {exp['name']}{' (mini)' if exp.get('mini') else ''} — results", ""]
    if exp.get("description"):
        lines += [exp["description"], ""]
    if exp.get("claim"):
        lines += [f"**Claim (paper).** {exp['claim']}", ""]
    lines += [f"Mode `{exp['mode']}`; {n_done} of {n_runs} runs finished, {len(failed)} failed, "
              f"{len(missing)} not run. Regenerate: `hpcasync experiment experiments/"
              f"{exp.get('source', exp['name'] + '.toml')}{mini}` then `hpcasync report DIR`.", ""]
    lines += [load_line(exp.get("_loads", []), n_done), ""]
    base = dict(exp.get("base", {}))
    if "ranks" in base:
        lines.append(f"MPI world size: `mpiexec -n {base.pop('ranks')}`.")
    lines.append("Options of every run: `" + " ".join(option_args(base)) + "`")
    for axis, values in exp["axes"].items():
        lines.append(f"- axis `{axis}`: " + ", ".join(f"`{v}`" for v in values))
    for ov in exp.get("overrides", []):
        match = ", ".join(f"{a} in {v}" for a, v in sorted(ov["match"].items()))
        lines.append(f"- where {match or 'always'}: `{' '.join(option_args(ov['set']))}`")
    lines.append("")
    for axis, labels in exp.get("bundles", {}).items():
        lines.append(f"Values of `{axis}`:")
        lines += [f"- `{label}`: `{' '.join(option_args(opts)) or '(base options only)'}`"
                  for label, opts in labels.items()]
        lines.append("")
    time_name = TIME_NAMES[rep.get("time", "wall")]
    lines += ["## Results", "", f"Mean ± sample std over seeds; time = {time_name}"
              f"{' (simulated seconds)' if rep.get('time') == 'sim_time' else ''}.", ""]
    lines += results_table(exp, groups)
    lines += pivot_tables(exp, groups)
    if images:
        lines += ["", "## Plots", ""]
        lines += [f"![{title}]({name})" for name, title in images]
    if failed:
        lines += ["", "## Failed runs", ""]
        lines += [f"- `{rid}`: {why}" for rid, why in sorted(failed.items())]
    if missing:
        lines += ["", "## Not run yet", ""]
        lines += [f"- `{rid}`" for rid in missing]
    return "\n".join(lines) + "\n"


def load_line(loads: list[dict], n_done: int) -> str:
    """The machine's 1-minute load average around the runs (recorded by the runner)."""
    if not loads:
        return "Load average: not recorded (runs from before the runner recorded it)."
    lo = min(min(x["start"], x["end"]) for x in loads)
    hi = max(max(x["start"], x["end"]) for x in loads)
    cpus = sorted({x.get("cpus") for x in loads} - {None})
    return (f"Load average (1 min) at the starts and ends of {len(loads)} of {n_done} runs: "
            f"{lo:.2f}-{hi:.2f} on {'/'.join(map(str, cpus)) or '?'} cores.")


def write_report(out: str | Path, dest: str | Path | None = None) -> list[Path]:
    """Write ``report.md`` and the PNGs of the experiment in ``out`` into ``dest`` (``out``)."""
    from .plots import make_plots

    exp, groups, failed, missing = load(out)
    dest = Path(dest) if dest is not None else Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    images = make_plots(exp, groups, dest)
    report = dest / "report.md"
    report.write_text(render(exp, groups, failed, missing, images), encoding="utf-8")
    return [report, *(dest / name for name, _ in images)]
