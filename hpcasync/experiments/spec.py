"""Experiment files: a TOML description of a matrix of runs, validated into a list of :class:`Run`.

The format is documented in ``experiments/README.md``. In short: ``name``, ``description``,
``claim``, ``mode`` ("sim": ``hpcasync sim``; "mpi": ``mpiexec -n RANKS hpcasync train``),
optional ``timeout`` and ``jobs``; ``[base]`` options of every run (option names of ``hpcasync
sim``/``train``, ``_`` or ``-``; ``ranks`` = world size in mpi mode); ``[matrix]`` axes whose
cartesian product gives the runs: a scalar axis sets the option of its name, a bundle axis lists
labelled tables of options (``link = [{label = "slow", link_delay_us_per_mb = 5e4}, ...]``);
``[[matrix]]`` blocks are joined (same axes in each); ``[[variants]]`` is a bundle axis named
``variant``; ``[[overrides]]`` ``match`` axis values and ``set`` options; ``[mini]`` replaces
``base`` options, scalar axes' values and keeps bundle labels, and adds its own
``[[mini.overrides]]`` (``--mini``); ``[report]`` rows, columns, facet, target, time.
Precedence: base < mini.base < axes < overrides < mini.overrides. A run's id is the
slug of its axis values sorted by axis name: ``algorithm=shat__seed=0__workers=4``.

Example::

    spec = load_spec("experiments/shat.toml", mini=True)
    [r.id for r in spec.runs]       # ['algorithm=ensemble__hetero=HO__seed=0__workers=2', ...]
"""
from __future__ import annotations

import functools
import itertools
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

#: ``[report] pivot`` values (their titles and formatters: ``report.PIVOTS``)
PIVOT_NAMES = ("accuracy", "time_per_epoch", "ps_busy", "ps_wait")

MODES = ("sim", "mpi")
TOP_KEYS = ("name", "description", "claim", "mode", "timeout", "jobs", "base", "matrix",
            "variants", "overrides", "mini", "report")
MINI_KEYS = ("base", "matrix", "overrides", "timeout")
REPORT_KEYS = ("rows", "columns", "facet", "target", "time", "pivot")
RUNNER_SET = ("metrics", "progress", "config", "resume", "checkpoint_dir")   # the runner's business
DEFAULT_TIMEOUT_S = 1800.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_SCALARS = (str, int, float, bool)


@dataclass(frozen=True)
class Run:
    """One cell of the matrix: its id, its axis values (labels for bundles) and its options."""

    id: str
    axes: dict[str, Any]
    options: dict[str, Any]
    ranks: int | None = None            # world size (mpi mode)

    def to_record(self, command: str) -> dict[str, Any]:
        return {"id": self.id, "axes": self.axes, "options": self.options, "ranks": self.ranks,
                "argv": ["hpcasync", command, *option_args(self.options)]}


@dataclass
class Spec:
    """A validated experiment file (its ``runs`` in matrix order)."""

    source: str
    name: str
    description: str
    claim: str
    mode: str
    mini: bool
    timeout: float
    jobs: int
    axes: dict[str, list]              # axis -> its values (labels for bundles), in file order
    base: dict[str, Any]
    overrides: list[dict]
    report: dict[str, Any]
    runs: list[Run]
    bundles: dict[str, dict[str, dict]]     # bundle axis -> label -> its options


    @property
    def command(self) -> str:
        return "sim" if self.mode == "sim" else "train"

    def to_record(self) -> dict[str, Any]:
        """What the runner stores as ``experiment.json`` (no paths, no times: deterministic)."""
        return {"name": self.name, "description": self.description, "claim": self.claim,
                "mode": self.mode, "mini": self.mini, "source": Path(self.source).name,
                "axes": self.axes, "base": self.base, "overrides": self.overrides,
                "report": self.report, "bundles": self.bundles,
                "runs": [r.to_record(self.command) for r in self.runs]}


def option_args(options: dict[str, Any]) -> list[str]:
    """``{"train_limit": 512}`` -> ``["--train-limit", "512"]`` (sorted; ``ranks`` excluded); a
    switch: ``{"ringmaster_stop": true}`` -> ``["--ringmaster-stop"]``, ``false`` -> nothing."""
    out: list[str] = []
    for key in sorted(options):
        flag, value = f"--{key.replace('_', '-')}", options[key]
        if isinstance(value, bool):
            out += [flag] if value else []
        else:
            out += [flag, str(value)]
    return out


def slug(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", str(value)) or "_"


def run_id(axes: dict[str, Any]) -> str:
    return "__".join(f"{axis}={slug(axes[axis])}" for axis in sorted(axes))


@functools.lru_cache(maxsize=None)
def _parser(command: str):
    from ..options import command_parser

    return command_parser(command)


@functools.lru_cache(maxsize=None)
def known_options(command: str) -> frozenset[str]:
    """Option names (argparse dests) of ``hpcasync sim`` or ``hpcasync train``."""
    return frozenset(a.dest for a in _parser(command)._actions if a.dest != "help")  # noqa: SLF001


def load_spec(path: str | Path, *, mini: bool = False, check_runs: bool = True) -> Spec:
    """Read and validate an experiment file; every problem is a one-line :class:`ConfigError`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: no such experiment file")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {str(exc).splitlines()[0]}") from None
    return parse_spec(data, source=str(path), mini=mini, check_runs=check_runs)


def parse_spec(data: dict, *, source: str = "<experiment>", mini: bool = False,
               check_runs: bool = True) -> Spec:
    """Validate the parsed TOML ``data`` and expand its matrix (see the module docstring)."""
    where = source

    def fail(msg: str):
        raise ConfigError(f"{where}: {msg}")

    _no_unknown(data, TOP_KEYS, "", fail)
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        fail(f"name must be a word of letters, digits, _ . - (got {name!r})")
    mode = data.get("mode", "sim")
    if mode not in MODES:
        fail(f"mode {mode!r} is not one of: {', '.join(MODES)}")
    command = "sim" if mode == "sim" else "train"
    for key in ("description", "claim"):
        if not isinstance(data.get(key, ""), str):
            fail(f"{key} must be a string")
    known = known_options(command) | ({"ranks"} if mode == "mpi" else set())
    opts = functools.partial(_options, known=known, fail=fail)
    base = opts(data.get("base", {}), "[base]")
    mini_t = _table(data.get("mini", {}), "[mini]", fail)
    _no_unknown(mini_t, MINI_KEYS, "[mini] ", fail)
    timeout = _timeout(data.get("timeout", DEFAULT_TIMEOUT_S), "timeout", fail)
    mini_base = opts(mini_t.get("base", {}), "[mini.base]")     # checked with or without --mini
    mini_timeout = _timeout(mini_t.get("timeout", timeout), "[mini] timeout", fail)
    jobs = data.get("jobs", 1)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        fail(f"jobs must be a positive integer, got {jobs!r}")
    if jobs > 1 and mode == "mpi":
        fail("jobs > 1 is for sim experiments only (MPI runs are timed)")
    if mini:
        base.update(mini_base)
        timeout = mini_timeout

    blocks, bundles = _blocks(data, opts, fail)
    mini_matrix = _table(mini_t.get("matrix", {}), "[mini.matrix]", fail)
    mini_blocks = [_shrink(b, bundles, mini_matrix, fail) for b in blocks]
    if mini:
        blocks = mini_blocks
    axes = _axis_values(blocks)
    bundle_opts = {name: {label: o for b in blocks for label, o in b[name]} for name in axes
                   if name in bundles}
    overrides = _overrides(data.get("overrides", []), axes, opts, fail)
    mini_overrides = _overrides(mini_t.get("overrides", []), _axis_values(mini_blocks), opts,
                                fail)          # checked with or without --mini
    if mini:
        overrides += mini_overrides
    report = _report(data.get("report", {}), axes, mode, fail)

    runs: dict[str, Run] = {}
    for block in blocks:
        names = list(block)
        for combo in itertools.product(*(block[n] for n in names)):
            run = _make_run(dict(zip(names, combo)), base, overrides, mode, fail)
            old = runs.get(run.id)
            if old is not None and old.options != run.options:
                fail(f"two runs share the id {run.id} with different options")
            runs.setdefault(run.id, run)
    if not runs:
        fail("the matrix has no runs")
    spec = Spec(source=source, name=name, description=data.get("description", "").strip(),
                claim=" ".join(data.get("claim", "").split()), mode=mode, mini=mini,
                timeout=timeout, jobs=jobs, axes=axes, base=base, overrides=overrides,
                report=report, runs=list(runs.values()), bundles=bundle_opts)
    if check_runs:
        for run in spec.runs:
            check_run(spec, run)
    return spec


def check_run(spec: Spec, run: Run) -> None:
    """Parse and pre-check a run's options as ``hpcasync sim|train`` would (no MPI, no data)."""
    from ..config import config_from_args

    try:
        ns = _parser(spec.command).parse_args(option_args(run.options))
        cfg = config_from_args(ns)
        if spec.mode == "sim":
            from ..sim.driver import check
            check(cfg)
        else:
            from ..train import precheck
            precheck(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{spec.source}: run {run.id}: {exc}") from None


# ------------------------------------------------------------------------------------------------

def _no_unknown(table: dict, allowed, prefix: str, fail) -> None:
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        fail(f"{prefix}unknown key(s): {', '.join(unknown)} (known: {', '.join(allowed)})")


def _table(value, what: str, fail) -> dict:
    if not isinstance(value, dict):
        fail(f"{what} must be a table")
    return value


def _timeout(value, what: str, fail) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e7:
        fail(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)


def _options(table, what: str, *, known, fail) -> dict[str, Any]:
    """Normalise option names (``-`` -> ``_``), refuse unknown ones and non-scalar values."""
    table = _table(table, what, fail)
    out = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name in RUNNER_SET:
            fail(f"{what} {key}: set by the runner, not by the experiment file")
        if name not in known:
            fail(f"{what} unknown option {key!r}")
        if not isinstance(value, _SCALARS):
            fail(f"{what} {key}: a value must be a string, number or boolean")
        out[name] = value
    return out


def _axis(name: str, values, opts, fail) -> list:
    """An axis as a list of (shown value, options) pairs."""
    if not isinstance(values, list):
        fail(f"[matrix] {name} must be a list of values")
    if not values:
        fail(f"[matrix] {name} is empty")
    if all(isinstance(v, dict) for v in values):
        out, labels = [], set()
        for v in values:
            label = v.get("label")
            if not isinstance(label, str) or not label:
                fail(f"[matrix] {name}: every table needs a label")
            if label in labels:
                fail(f"[matrix] {name}: label {label!r} appears twice")
            labels.add(label)
            out.append((label, opts({k: x for k, x in v.items() if k != "label"},
                                    f"[matrix] {name} {label!r}:")))
        return out
    if any(isinstance(v, (dict, list)) for v in values):
        fail(f"[matrix] {name}: values must be all scalars or all labelled tables")
    opts({name: values[0]}, "[matrix]")          # the axis name is an option
    if len(set(map(repr, values))) != len(values):
        fail(f"[matrix] {name}: a value appears twice")
    return [(v, {name.replace("-", "_"): v}) for v in values]


def _blocks(data: dict, opts, fail) -> tuple[list[dict[str, list]], set[str]]:
    """The matrix blocks (axis -> [(shown value, options)]) and the names of the bundle axes."""
    matrix = data.get("matrix")
    if matrix is None:
        fail("no [matrix]")
    tables = [matrix] if isinstance(matrix, dict) else matrix
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        fail("[matrix] must be a table or a non-empty array of tables")
    variants = data.get("variants")
    if variants is not None and (not isinstance(variants, list) or not variants):
        fail("[[variants]] must be a non-empty array of tables")
    blocks = []
    for t in tables:
        if not t:
            fail("[matrix] is empty")
        block = {name.replace("-", "_"): _axis(name, vals, opts, fail) for name, vals in t.items()}
        if variants is not None:
            if "variant" in block:
                fail("[matrix] variant: the axis name is taken by [[variants]]")
            block["variant"] = _axis("variant", variants, opts, fail)
        blocks.append(block)
    names = set(blocks[0])
    if any(set(b) != names for b in blocks):
        fail("every [[matrix]] block must name the same axes")
    bundles = {name for b in blocks for name, pairs in b.items()
               if any(opts_ != {name: shown} for shown, opts_ in pairs)}
    return blocks, bundles


def _shrink(block: dict, bundles: set[str], mini_matrix: dict, fail) -> dict:
    """Apply ``[mini.matrix]``: new values of scalar axes, kept labels of bundle axes."""
    out = dict(block)
    for key, values in mini_matrix.items():
        name = key.replace("-", "_")
        if name not in block:
            fail(f"[mini.matrix] {key}: no such axis")
        if not isinstance(values, list) or not values:
            fail(f"[mini.matrix] {key} must be a non-empty list")
        if name in bundles:
            labels = {label for label, _ in block[name]}
            missing = [v for v in values if v not in labels]
            if missing:
                fail(f"[mini.matrix] {key}: no such label(s): {', '.join(map(str, missing))}")
            out[name] = [pair for pair in block[name] if pair[0] in values]
        else:
            out[name] = [(v, {name: v}) for v in values]
    return out


def _axis_values(blocks: list[dict]) -> dict[str, list]:
    axes: dict[str, list] = {}
    for block in blocks:
        for name, pairs in block.items():
            seen = axes.setdefault(name, [])
            for shown, _ in pairs:
                if shown not in seen:
                    seen.append(shown)
    return axes


def _overrides(value, axes: dict, opts, fail) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        fail("[[overrides]] must be an array of tables")
    out = []
    for i, t in enumerate(value, 1):
        _no_unknown(t, ("match", "set"), f"[[overrides]] #{i}: ", fail)
        match = _table(t.get("match", {}), f"[[overrides]] #{i} match", fail)
        for axis in match:
            if axis.replace("-", "_") not in axes:
                fail(f"[[overrides]] #{i}: no such axis {axis!r}")
        match = {k.replace("-", "_"): (v if isinstance(v, list) else [v]) for k, v in match.items()}
        out.append({"match": match, "set": opts(t.get("set", {}), f"[[overrides]] #{i} set")})
    return out


def _report(value, axes: dict, mode: str, fail) -> dict:
    report = _table(value, "[report]", fail)
    _no_unknown(report, REPORT_KEYS, "[report] ", fail)
    out = dict(report)
    for key in ("rows", "columns", "facet"):
        if key in out and out[key] not in axes:
            fail(f"[report] {key} = {out[key]!r} is not an axis")
        if out.get(key) == "seed":
            fail(f"[report] {key} cannot be seed: the report averages over seeds")
    target = out.get("target")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not 0 < target <= 1):
        fail(f"[report] target must be an accuracy in (0, 1], got {target!r}")
    out.setdefault("time", "sim_time" if mode == "sim" else "wall")
    if out["time"] not in ("sim_time", "wall"):
        fail(f"[report] time {out['time']!r} is not one of: sim_time, wall")
    if out["time"] == "sim_time" and mode == "mpi":
        fail("[report] time = sim_time needs mode = sim")
    if "facet" not in out and "rows" in out:
        out["facet"] = out["rows"]

    pivot = out.get("pivot", ["accuracy"])
    if not isinstance(pivot, list) or not pivot or any(p not in PIVOT_NAMES for p in pivot):
        fail(f"[report] pivot must be a list of: {', '.join(PIVOT_NAMES)}; got {pivot!r}")
    return out


def _make_run(cell: dict[str, tuple], base: dict, overrides: list[dict], mode: str, fail) -> Run:
    options = dict(base)
    setters: dict[str, str] = {}
    for axis, (_, opts) in cell.items():
        for key, value in opts.items():
            if key in setters:
                fail(f"option {key} is set by two axes: {setters[key]} and {axis}")
            setters[key] = axis
            options[key] = value
    shown = {axis: value for axis, (value, _) in cell.items()}
    for ov in overrides:
        if all(shown.get(axis) in values for axis, values in ov["match"].items()):
            options.update(ov["set"])
    ranks = options.pop("ranks", None)
    if mode == "mpi" and (not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1):
        fail(f"mode mpi needs ranks (the world size) as a positive integer in [base] or "
             f"[matrix], got {ranks!r}")
    rid = run_id(shown)
    return Run(id=rid, axes=shown, options=options, ranks=ranks)
