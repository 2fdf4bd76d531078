"""The simulator's server model: FIFO service of ``--sim-ps-service-time`` per push at one server,
1/K of it at each of ``--ps-ranks K`` shard servers; the arithmetic unchanged.

Homogeneous workers (fixed step time T), service S: one push takes T + (wait) + S/K. When the
server is the bottleneck (W / (T + S/K) > K / S pushes/s) the run's simulated time is the pushes
times S/K; when it is not, it is the per-worker steps times T + S/K. Both are checked against the
records, as is ``ps_busy`` (1.0 when saturated)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hpcasync.metrics import read_metrics
from tests.mpi_util import clean_env

pytestmark = pytest.mark.rank0

W, T = 8, 0.01
BASE = ["sim", "--algorithm", "asgd", "--workers", str(W), "--dataset", "fashion-mnist-mini",
        "--train-limit", "2048", "--test-limit", "100", "--epochs", "1", "--batch-size", "32",
        "--sim-step-time", str(T), "--hetero", "HO", "--compute-time", "fixed", "--progress", "off"]
PUSHES = W * ((2048 // W) // 32)                       # 64 pushes, 8 per worker


def sim(tmp_path, *extra) -> tuple[dict, dict]:
    m = tmp_path / f"m{len(list(tmp_path.iterdir()))}.jsonl"
    r = subprocess.run([sys.executable, "-m", "hpcasync", *BASE, *extra, "--metrics", str(m)],
                       env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    records = read_metrics(m)
    return [x for x in records if x["event"] == "epoch"][-1], records[-1]


def test_no_service_time_is_the_old_instant_server(tmp_path):
    epoch, summary = sim(tmp_path)
    _, explicit = sim(tmp_path, "--sim-ps-service-time", "0")
    assert summary["params_sha256"] == explicit["params_sha256"]
    assert "ps_busy" not in epoch
    assert summary["sim_time"] == pytest.approx((PUSHES // W - 1) * T + T)


@pytest.mark.parametrize("service, shards", [(0.01, 1), (0.08, 4)])
def test_a_saturated_server_sets_the_pace(tmp_path, service, shards):
    """Demand W / (T + S/K) exceeds capacity K / S: the epoch lasts ~ pushes x S/K."""
    per_push = service / shards
    assert W / (T + per_push) > 1 / per_push
    epoch, summary = sim(tmp_path, "--sim-ps-service-time", str(service),
                         *(["--ps-ranks", str(shards)] if shards > 1 else []))
    # the first pushes arrive at T; from then on the server never idles: the last reply is
    # back at T + pushes x S/K
    assert summary["sim_time"] == pytest.approx(T + PUSHES * per_push, rel=1e-6)
    assert epoch["ps_busy"] >= 0.95 and epoch["ps_wait_s"] > 0


def test_an_idle_server_adds_only_its_service_time(tmp_path):
    service = 0.0001                       # capacity 10 000 pushes/s, demand ~800/s
    epoch, summary = sim(tmp_path, "--sim-ps-service-time", str(service))
    steps = PUSHES // W
    # a worker's step is T + S; the last of the W simultaneous first pushes waits (W-1) S once
    assert summary["sim_time"] == pytest.approx(steps * (T + service), abs=W * service)
    assert epoch["ps_busy"] < 0.2 and epoch["ps_wait_s"] <= W * service


def test_service_time_changes_time_not_arithmetic_when_the_order_is_kept(tmp_path):
    """With every worker equally slowed, the FIFO order -- hence theta -- is the instant one."""
    _, instant = sim(tmp_path)
    _, served = sim(tmp_path, "--sim-ps-service-time", "0.0001")
    assert served["params_sha256"] == instant["params_sha256"]
    assert served["sim_time"] > instant["sim_time"]


def test_bad_service_options(tmp_path):
    for extra, needle in ((["--sim-ps-service-time", "-1"], "--sim-ps-service-time must be"),
                          (["--sim-ps-service-time", "inf"], "--sim-ps-service-time must be")):
        r = subprocess.run([sys.executable, "-m", "hpcasync", *BASE, *extra], env=clean_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and needle in r.stderr, r.stderr[-1000:]
