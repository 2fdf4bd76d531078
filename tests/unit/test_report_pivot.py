"""``[report] pivot``: rows x columns tables of accuracy, time per epoch and the simulated
server's load, built from the runs' epoch records."""
from __future__ import annotations

import pytest

from hpcasync.errors import ConfigError
from hpcasync.experiments.report import Group, RunStats, pivot_tables


def _run(acc, t, epochs, busy, wait):
    return RunStats(id="r", axes={}, final_acc=acc, time=t, wall=None, epochs=epochs, curve=[],
                    time_to_target=None, ps_state_bytes=None, staleness={}, breakdown={},
                    ps_busy=busy, ps_wait=wait)


def test_pivot_tables_of_time_and_server_load():
    exp = {"axes": {"seed": [0, 1], "workers": [16, 64], "ps_ranks": [1, 4]},
           "report": {"rows": "workers", "columns": "ps_ranks",
                      "pivot": ["time_per_epoch", "ps_busy", "ps_wait"]}}
    groups = []
    for w in (16, 64):
        for k in (1, 4):
            g = Group(key=(("workers", w), ("ps_ranks", k)), planned=2)
            g.runs = [_run(0.8, 10.0 * w / k, 2, 1.0 / k, 0.01 * w), _run(0.8, 10.0 * w / k, 2,
                                                                          1.0 / k, 0.01 * w)]
            groups.append(g)
    text = "\n".join(pivot_tables(exp, groups))
    assert "Time per epoch (s)" in text and "| 64 | 320.000 ± 0.000 | 80.000 ± 0.000 |" in text
    assert "busy" in text and "| 16 | 100.0 ± 0.0 | 25.0 ± 0.0 |" in text
    assert "| 64 | 640.00 ± 0.00 | 640.00 ± 0.00 |" in text          # wait in ms


def test_bad_pivot_is_a_one_line_error(tmp_path):
    from hpcasync.experiments.spec import load_spec

    p = tmp_path / "x.toml"
    p.write_text('name = "x"\nmode = "sim"\n[base]\nepochs = 1\n[matrix]\nseed = [0]\n'
                 'workers = [2, 4]\nalgorithm = ["asgd", "ssgd"]\n'
                 '[report]\nrows = "workers"\ncolumns = "algorithm"\npivot = ["speed"]\n')
    with pytest.raises(ConfigError, match="pivot must be a list of: accuracy, time_per_epoch"):
        load_spec(p, check_runs=False)
