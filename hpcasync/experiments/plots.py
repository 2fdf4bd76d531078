"""The report's PNG plots (matplotlib, Agg backend), byte-identical for identical runs.

* ``accuracy_vs_time.png`` / ``accuracy_vs_epoch.png``: test accuracy, one line per group (mean over
  its seeds at each epoch all seeds reached), one subplot per value of ``[report] facet``;
* ``staleness.png``: the groups' staleness histograms (fraction of pushes, all seeds pooled), for
  runs that record one (the asynchronous algorithms);
* ``time_breakdown.png``: seconds per epoch spent in each phase the runs record (the ``*_s``
  fields of the epoch records other than clocks and maxima: compute, wait, communication, DASO's
  blocking/local/global phases...),
  mean over epochs and seeds; absent for simulated runs, whose records have no such fields.
"""
from __future__ import annotations

import statistics
from pathlib import Path

TIME_LABELS = {"sim_time": "simulated time (s)", "wall": "wall time (s)"}
PLOT_NAMES = ("accuracy_vs_time.png", "accuracy_vs_epoch.png", "staleness.png",
              "time_breakdown.png")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcdefaults()
    plt.rcParams.update({"font.size": 8, "axes.grid": True, "grid.alpha": 0.3,
                         "svg.hashsalt": "hpcasync", "path.simplify": False})
    return plt


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=100, format="png", metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)


def _facets(exp: dict, groups) -> tuple[str | None, list]:
    facet = exp.get("report", {}).get("facet")
    if not facet:
        return None, [None]
    return facet, [v for v in exp["axes"][facet] if any(g.value(facet) == v for g in groups)]


def _colors(labels: list[str]) -> dict[str, tuple]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {label: cmap(i % cmap.N) for i, label in enumerate(labels)}


def _grid(plt, n: int, width: float = 4.2, height: float = 3.2):
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols + 2.2, height * rows),
                             squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def mean_curve(group, use_time: bool) -> tuple[list[float], list[float]]:
    """(x, accuracy) averaged over the group's seeds at the epochs every seed reached."""
    curves = [{e: (t, a) for e, t, a in r.curve} for r in group.runs]
    if not curves:
        return [], []
    common = sorted(set.intersection(*(set(c) for c in curves)))
    xs, ys = [], []
    for e in common:
        times = [c[e][0] for c in curves]
        if use_time and any(t is None for t in times):
            continue
        xs.append(statistics.fmean(times) if use_time else float(e))
        ys.append(100 * statistics.fmean(c[e][1] for c in curves))
    return xs, ys


def _faceted(plt, exp, groups, path: Path, draw, *, xlabel: str, ylabel: str,
             log_y: bool = False, target: float | None = None) -> None:
    """One subplot per facet value, ``draw(ax, group, color, label)`` for each of its groups, one
    legend for the figure (a colour per label, the same in every subplot)."""
    facet, values = _facets(exp, groups)
    skip = ("seed", facet) if facet else ("seed",)
    colors = _colors(list(dict.fromkeys(g.label(skip) for g in groups)))
    fig, axes = _grid(plt, len(values))
    for ax, value in zip(axes, values):
        for g in groups:
            if facet and g.value(facet) != value:
                continue
            draw(ax, g, colors[g.label(skip)], g.label(skip))
        if log_y:
            ax.set_yscale("log")
        ax.set_title(f"{facet} = {value}" if facet else exp["name"])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if target is not None:
            ax.axhline(100 * target, color="grey", linestyle=":", linewidth=1)
    handles = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="center left", fontsize=7,
                   bbox_to_anchor=(1 - 2.1 / fig.get_figwidth(), 0.5))
    fig.tight_layout(rect=(0, 0, 1 - 2.2 / fig.get_figwidth(), 1))
    _save(fig, path)


def _accuracy(plt, exp, groups, path: Path, use_time: bool) -> None:
    def draw(ax, g, color, label):
        xs, ys = mean_curve(g, use_time)
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, color=color, label=label)

    _faceted(plt, exp, groups, path, draw,
             xlabel=TIME_LABELS[exp["report"].get("time", "wall")] if use_time else "epoch",
             ylabel="test accuracy (%)", target=exp["report"].get("target"))


def _staleness(plt, exp, groups, path: Path) -> bool:
    with_hist = [g for g in groups if any(r.staleness for r in g.runs)]
    if not with_hist:
        return False

    def draw(ax, g, color, label):
        pooled: dict[int, int] = {}
        for r in g.runs:
            for k, v in r.staleness.items():
                pooled[k] = pooled.get(k, 0) + v
        n = sum(pooled.values())
        ks = sorted(pooled)
        ax.step(ks, [pooled[k] / n for k in ks], where="mid", color=color, label=label)

    _faceted(plt, exp, with_hist, path, draw, xlabel="staleness τ (updates)",
             ylabel="fraction of pushes", log_y=True)
    return True


def _breakdown(plt, exp, groups, path: Path) -> bool:
    fields = sorted({k for g in groups for r in g.runs for k in r.breakdown})
    shown = [g for g in groups if g.runs]
    if not fields or not shown:
        return False
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.22 * len(shown) * (len(fields) + 1)))
    height = 0.8 / len(fields)
    colors = _colors(fields)
    for j, name in enumerate(fields):
        ys = [i + j * height for i in range(len(shown))]
        vals = [statistics.fmean(r.breakdown.get(name, 0.0) for r in g.runs) for g in shown]
        ax.barh(ys, vals, height=height, color=colors[name], label=name)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(shown))])
    ax.set_yticklabels([g.label(("seed",)) for g in shown])
    ax.invert_yaxis()
    ax.set_xlabel("seconds per epoch (mean over epochs and seeds; phases may overlap)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"{exp['name']}: time breakdown")
    fig.tight_layout()
    _save(fig, path)
    return True


def make_plots(exp: dict, groups, dest: Path) -> list[tuple[str, str]]:
    """Write the plots into ``dest``; returns (file name, title) of each one written."""
    plt = _plt()
    for name in PLOT_NAMES:                       # no stale plot of an earlier report stays
        (dest / name).unlink(missing_ok=True)
    out = []
    if any(g.runs for g in groups):
        _accuracy(plt, exp, groups, dest / PLOT_NAMES[0], use_time=True)
        _accuracy(plt, exp, groups, dest / PLOT_NAMES[1], use_time=False)
        out += [(PLOT_NAMES[0], "test accuracy vs time"), (PLOT_NAMES[1], "test accuracy vs epoch")]
    if _staleness(plt, exp, groups, dest / PLOT_NAMES[2]):
        out.append((PLOT_NAMES[2], "staleness histograms"))
    if _breakdown(plt, exp, groups, dest / PLOT_NAMES[3]):
        out.append((PLOT_NAMES[3], "time breakdown"))
    return out
