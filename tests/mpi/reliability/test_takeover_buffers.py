"""BatchNorm state across failures of a parameter-server run (ULFM, real SIGKILLs, ResNet-20).

* The server dies: the new server's model buffers are not a fresh model's (running_var all ones,
  running_mean all zeros) but the mean of the remaining workers' current buffers, bitwise as
  ``load_theta`` computes it; each worker keeps its own buffers (``ParameterServer.take_over(survivors=)``).
* A worker dies (the server lives): its last buffers leave the server's average.

The state is read through the testing hook ``HPCASYNC_DUMP_BUFFERS=DIR`` (``ps.takeover``).
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hpcasync.metrics import read_metrics
from hpcasync.models import build_model
from tests.mpi_util import REPO, clean_env, last_summary, mpiexec, need_ulfm

ARGS = ["train", "--dataset", "fashion-mnist-mini", "--model", "resnet20", "--train-limit", "768",
        "--test-limit", "64", "--batch-size", "32", "--epochs", "1", "--progress", "off",
        "--algorithm", "asgd"]


def _run(tmp_path, **env):
    metrics = tmp_path / "m.jsonl"
    out = subprocess.run([*mpiexec(4, ft=True), sys.executable, "-m", "hpcasync.cli", *ARGS,
                          "--metrics", str(metrics)],
                         env=clean_env(HPCASYNC_DUMP_BUFFERS=str(tmp_path / "dump"), **env),
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out, metrics


def _fresh_buffers() -> torch.Tensor:
    model = build_model("resnet20", (1, 28, 28), 10)
    return torch.cat([b.flatten() for b in model.buffers() if b.is_floating_point()])


@pytest.mark.rank0
def test_the_new_server_takes_the_survivors_mean_buffers_not_fresh_ones(tmp_path):
    """The server (rank 0) dies at its 12th accepted push (of 3 x 8): the new server's buffers
    right after the takeover are the bitwise mean of the two remaining workers' buffers
    (``stack(rows).mean(0)``, worker order), which are trained statistics, not 0/1; each worker
    kept its own (and its num_batches_tracked); the server's num_batches_tracked is the
    survivors' max."""
    need_ulfm()
    out, metrics = _run(tmp_path, HPCASYNC_INJECT_KILL="0:12")
    [f] = last_summary(metrics)["server_failures"]
    server = f["new_server"] - 1                         # its rank in the shrunk world (0 died)
    dump = tmp_path / "dump"
    s = torch.load(dump / f"takeover-server-{server}.pt")
    rows = torch.stack([s["survivors"][r] for r in s["worker_ranks"]])
    fresh = _fresh_buffers()
    assert s["model"].shape == fresh.shape
    assert torch.equal(s["model"], rows.mean(0))
    assert not torch.equal(s["model"], fresh)
    for row in rows:                                     # trained, each its own
        assert not torch.equal(row, fresh)
    assert not torch.equal(rows[0], rows[1])
    counts = []
    for r in s["worker_ranks"]:                          # a worker keeps its own buffers
        w = torch.load(dump / f"takeover-worker-{r}.pt")
        assert torch.equal(w["model"], s["survivors"][r])
        counts.append(int(w["ints"]["bn1.num_batches_tracked"]))
    # num_batches_tracked: each worker its own count, the server the survivors' max
    assert min(counts) > 0 and int(s["ints"]["bn1.num_batches_tracked"]) >= max(counts)
    assert any(r["event"] == "server_failed" for r in read_metrics(metrics))


@pytest.mark.rank0
def test_a_dead_workers_buffers_leave_the_servers_average(tmp_path):
    """Worker 1 (rank 2) dies at its 4th push: at its death the server's average is the mean of
    the two other workers' latest buffers only."""
    need_ulfm()
    out, metrics = _run(tmp_path, HPCASYNC_INJECT_KILL="2:4")
    [failed] = last_summary(metrics)["failed_workers"]
    assert failed["worker"] == 1
    d = torch.load(tmp_path / "dump" / "worker-failed-1.pt")
    assert d["seen"] == [1, 0, 1]
    table = d["buffers"]
    assert torch.equal(d["model"], table[[0, 2]].mean(0))
    assert not torch.equal(d["model"], table.mean(0))   # its rows were there, and differ
