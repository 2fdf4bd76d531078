"""The parameter server's memory (``hpcasync.ps.memory``, issue 13) in one process: the pure
formula, the rules' state extrapolation, and the report's columns. (What each transport allocates
on real ranks: tests/mpi/test_ps_memory.py.)"""
from __future__ import annotations

import pytest
import torch

from hpcasync.errors import ConfigError
from hpcasync.ps.memory import (buffer_table_bytes, memory_record, rule_state_bytes,
                                transport_bytes, worker_transport_bytes)
from hpcasync.rules import PushMeta, make_rule


def test_formula_values_and_bad_input():
    n, e = 25_557_032, 53_120                           # ResNet-50
    assert transport_bytes("rma", 64, n, e) == transport_bytes("rma-put", 64, n, e) \
        == 64 * (n + e) * 4
    assert transport_bytes("p2p", 64, n, e) == (n + e) * 4 + 64 * n * 4
    assert transport_bytes("p2p", 64, n, e, reply_buffers=1) == (n + e) * 4 + n * 4
    assert worker_transport_bytes("rma-put", n, e) == n * 4
    assert worker_transport_bytes("rma", n, e) == worker_transport_bytes("p2p", n, e) == 0
    assert buffer_table_bytes(64, e) == 64 * e * 4
    rec = memory_record("rma", 4, 10, 2, 100, peak=7)
    assert rec == {"ps_state_bytes": 100, "ps_transport_bytes": 4 * 12 * 4,
                   "ps_buffers_bytes": 4 * 2 * 4, "ps_total_bytes": 100 + 192 + 32,
                   "ps_transport_peak_bytes": 7}
    with pytest.raises(ConfigError, match="unknown PS transport 'tcp'"):
        transport_bytes("tcp", 4, 10)
    with pytest.raises(ConfigError, match="num_workers must be an integer >= 0"):
        transport_bytes("rma", -1, 10)
    with pytest.raises(ConfigError, match="reply_buffers must be"):
        transport_bytes("p2p", 4, 10, reply_buffers=5)


@pytest.mark.parametrize("name, copies", [("smega2", 3), ("dana", 4 + 2), ("asgd", 1),
                                          ("dcasgd", 4 + 1)])
def test_rule_state_extrapolation_is_the_rule_itself(name, copies):
    """``rule_state_bytes`` (two small rules, extrapolated) equals a real rule's state_bytes()
    after every worker pushed, and counts the documented model copies."""
    n, W = 3001, 4
    rule = make_rule(name, torch.zeros(n), W, lr=0.1)
    for w in range(W):
        rule.initial_reply(w)
        rule.on_push(w, torch.ones(n), PushMeta(version=rule.version, loss=1.0))
    assert rule_state_bytes(name, W, n) == rule.state_bytes()
    assert rule.state_bytes() - copies * n * 4 < 1024          # the rest is scalars


def test_report_shows_transport_and_total_and_reads_old_runs(tmp_path):
    """``hpcasync report``: runs with the memory fields get "PS transport" and "PS total"
    columns; a run from before issue 13 (``ps_state_bytes`` only) still loads and shows "–"."""
    import json

    from hpcasync.experiments.report import write_report

    out, runs = tmp_path / "mem", tmp_path / "mem" / "runs"
    runs.mkdir(parents=True)
    exp = {"name": "mem", "mode": "sim", "mini": False, "source": "mem.toml",
           "axes": {"ps_transport": ["rma", "p2p"], "seed": [0]}, "base": {"epochs": 1},
           "overrides": [], "runs": [], "report": {"time": "sim_time"}}
    fields = {"rma": {"ps_state_bytes": 4096},                       # an old run
              "p2p": memory_record("p2p", 4, 1024, 0, 4096)}
    for kind in ("rma", "p2p"):
        rid = f"ps_transport={kind}__seed=0"
        exp["runs"].append({"id": rid, "axes": {"ps_transport": kind, "seed": 0}, "options": {},
                            "ranks": None, "argv": []})
        recs = [{"event": "config", "config": {}},
                {"event": "epoch", "epoch": 1, "test_accuracy": 0.5, "sim_time": 1.0,
                 **fields[kind]},
                {"event": "summary", "test_accuracy": 0.5, "sim_time": 1.0, **fields[kind]}]
        (runs / f"{rid}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (out / "experiment.json").write_text(json.dumps(exp))
    text = write_report(out)[0].read_text()
    assert "| PS state (KiB) | PS transport (KiB) | PS total (KiB) |" in text
    # p2p, 4 workers, 1024 parameters: transport (1024 + 4·1024)·4 B = 20 KiB; total 4 + 20 KiB
    assert "| p2p | 1/1 | 50.00 | 1.00 | 1.000 | 4.0 | 20.0 | 24.0 |" in text
    assert "| rma | 1/1 | 50.00 | 1.00 | 1.000 | 4.0 | – | – |" in text
