"""OD-SGD runtime: the global model is SSGD's on the same gradients, staleness is exactly one round,
warm-up is bitwise SSGD, the progress mode does not change the math, the simulator's round function
matches the MPI runtime, and a 4-rank CLI run ends cleanly with its timing breakdown.

Every collective test runs on however many ranks the job has (1 under plain pytest, 4 under
``mpiexec -n 4``); each rank owns gradient row ``RANK`` of a sequence all ranks can generate."""
from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

from hpcasync.comm import FlatModel
from hpcasync.config import TrainConfig
from hpcasync.data import load_dataset
from hpcasync.errors import ConfigError
from hpcasync.metrics import read_metrics
from hpcasync.models import build_model
from hpcasync.odsgd.steps import global_step, local_step
from hpcasync.odsgd.runtime import (GlobalState, ODSGDHyper, ODSGDWorker, WorkerState,
                                    hyper_from_config, simulate_round, validate)
from hpcasync.ssgd import DistributedOptimizer
from tests.mpi_util import COMM, RANK, SIZE, clean_env, run_cli, run_mpi

f64 = torch.float64


def _flat_linear(seed: int = 7) -> FlatModel:
    """A 4920-parameter model (large enough for the shm allreduce path), identical on all ranks."""
    torch.manual_seed(seed)
    return FlatModel(torch.nn.Linear(40, 120))


def _grads(T: int, n: int, numel: int, seed: int = 11) -> torch.Tensor:
    """Fixed gradients G[t, k] (same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, n, numel, generator=gen)


def _weight_grad(w: torch.Tensor, k: int, t: int) -> torch.Tensor:
    """A gradient that depends on the weights it is computed on: c_k·(w − k) + a small drift."""
    return (w - float(k)).mul_(0.5 + 0.25 * k).add_(0.01 * math.sin(t + k))


@pytest.mark.parametrize("local_opt, warmup", [("sgd", 0), ("dc-adaptive", 3), ("dc", 20)])
def test_global_model_equals_ssgd_on_same_gradients(local_opt, warmup):
    """With weight-independent gradients the global model after T rounds is momentum SGD on the
    per-round means, whatever the local optimizer and warm-up (they only change where gradients are
    computed); replicas of W are bitwise identical."""
    T, hp = 12, ODSGDHyper(lr=0.1, momentum=0.9, weight_decay=1e-3, local_opt=local_opt,
                           lr_local=0.3, warmup_iters=warmup)
    flat = _flat_linear()
    worker = ODSGDWorker(flat, COMM, hp=hp)
    worker.broadcast_parameters()
    G = _grads(T, SIZE, flat.numel)
    W = flat.params.to(f64).clone()
    buf = torch.zeros_like(W)
    for t in range(T):
        flat.grads.copy_(G[t, RANK])
        worker.step()
        global_step(W, G[t].to(f64).mean(0), buf, lr=hp.lr, momentum=hp.momentum, wd=hp.weight_decay)
    assert worker.rounds == T - (1 if warmup < T else 0)   # the last round is still in flight
    worker.finish()
    assert worker.rounds == T and worker.steps == T
    torch.testing.assert_close(worker.glob.W.to(f64), W, rtol=1e-5, atol=1e-6)
    assert torch.equal(flat.params, worker.glob.W)
    replicas = COMM.allgather(worker.glob.W)
    assert all(torch.equal(replicas[0], r) for r in replicas)


@pytest.mark.parametrize("local_opt, delta", [("sgd", "last-step"), ("dc", "gap"),
                                              ("dc-adaptive", "last-step"), ("dc-adaptive", "gap")])
def test_staleness_is_exactly_one_round(local_opt, delta):
    """Property, for every step s with W_j = the global model after j rounds and P_s = the weights
    gradient g_s was computed on (round s applies g_s to W_s, giving W_{s+1}):
      warm-up (s < w):  P_s = W_s                          (SSGD, staleness 0)
      first OD step:    P_w = W_w
      later (s > w):    P_s = LocalOpt(W_{s−1}, g_{s−1}, Δ)  bitwise — built from the global model
                        one round older than the W_s it is applied to, and ≠ W_s (staleness exactly 1),
    also across an epoch end (``global_weights()`` in the middle)."""
    w, T = 3, 10
    hp = ODSGDHyper(lr=0.05, momentum=0.9, local_opt=local_opt, delta=delta, lr_local=0.2,
                    lam=0.5 if local_opt == "dc" else None, warmup_iters=w)
    flat = _flat_linear()
    worker = ODSGDWorker(flat, COMM, hp=hp)
    worker.broadcast_parameters()
    Ws = {0: flat.params.clone()}          # W_j, j = rounds applied
    P, g = [], []
    ms = torch.zeros_like(flat.params)
    for s in range(T):
        if s == 6:                          # an epoch end: evaluate on W, resume on local weights
            before = flat.params.clone()
            with worker.global_weights() as W:
                assert torch.equal(flat.params, W)
            assert torch.equal(flat.params, before)
        P.append(flat.params.clone())
        g.append(_weight_grad(flat.params.clone(), RANK, s))
        flat.grads.copy_(g[-1])
        worker.step()
        Ws[worker.rounds] = worker.glob.W.clone()
    worker.finish()
    Ws[worker.rounds] = worker.glob.W.clone()
    assert sorted(Ws) == list(range(T + 1))
    for s in range(T):
        if s <= w:
            assert torch.equal(P[s], Ws[s]), f"step {s} should compute on the global model"
            continue
        prev = Ws[s - 2] if delta == "last-step" else P[s - 1]
        d = None if local_opt == "sgd" else Ws[s - 1] - prev
        # the authors' rescale: a worker's own gradient enters its local step as g/N
        ref = local_step(Ws[s - 1], g[s - 1], mode=local_opt, lr_local=hp.lr_local, lam=hp.lam,
                         grad_scale=1.0 / SIZE, delta=d,
                         ms=ms if local_opt == "dc-adaptive" else None)
        assert torch.equal(P[s], ref), f"step {s}: not LocalOpt(W_{s - 1}, g_{s - 1})"
        assert not torch.equal(P[s], Ws[s]) and not torch.equal(P[s], Ws[s - 1])
    # and round s applied the mean of the g_s computed on P_s to W_s
    every = torch.stack(COMM.allgather(torch.stack(g)))            # [rank, step, numel]
    for s in range(T):
        W, buf = Ws[0].to(f64), torch.zeros(flat.numel, dtype=f64)
        for j in range(s + 1):
            global_step(W, every[:, j].to(f64).mean(0), buf, lr=hp.lr, momentum=hp.momentum)
        torch.testing.assert_close(Ws[s + 1].to(f64), W, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def data():
    train, _ = load_dataset("fashion-mnist-mini", train_limit=2048, test_limit=10)
    return train


def _batch(train, step, rank, B=16):
    start = ((step * SIZE + rank) * B) % (len(train) - B)
    return train.images[start:start + B], train.labels[start:start + B]


def test_warmup_is_bitwise_ssgd(data):
    """The first warmup_iters steps equal DistributedOptimizer + torch SGD bit for bit; the next
    step starts the pipeline (its round is in flight, the model moves to local weights)."""
    torch.manual_seed(3 + RANK)
    ours, theirs = build_model("lenet", (1, 28, 28), 10), build_model("lenet", (1, 28, 28), 10)
    fo, ft = FlatModel(ours), FlatModel(theirs)
    hp = ODSGDHyper(lr=0.05, momentum=0.9, weight_decay=1e-4, warmup_iters=6)
    worker = ODSGDWorker(fo, COMM, hp=hp)
    worker.broadcast_parameters()
    ft.params.copy_(fo.params)
    opt = DistributedOptimizer(torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9,
                                               weight_decay=1e-4), ft, COMM)
    opt.broadcast_parameters()
    for step in range(7):
        x, y = _batch(data, step, RANK)
        fo.zero_grad()
        F.cross_entropy(ours(x), y).backward()
        worker.step()
        opt.zero_grad()
        F.cross_entropy(theirs(x), y).backward()
        opt.step()
        if step < 6:
            assert torch.equal(fo.params, ft.params), f"warm-up step {step} differs from SSGD"
            assert worker.round is None and worker.rounds == step + 1
    assert worker.round is not None and worker.rounds == 6
    assert not torch.equal(fo.params, ft.params)
    worker.finish()
    assert torch.equal(worker.glob.W, ft.params)       # W_7 = SSGD's 7th step: the global model is SSGD


def test_progress_modes_give_identical_results():
    """hooks, thread and none only change when the round progresses, never the result."""
    T = 8
    results = []
    for mode in ("hooks", "thread", "none"):
        flat = _flat_linear()
        worker = ODSGDWorker(flat, COMM, hp=ODSGDHyper(lr=0.05, momentum=0.9, lr_local=0.2,
                                                       warmup_iters=2), progress=mode)
        worker.broadcast_parameters()
        for s in range(T):
            flat.grads.copy_(_weight_grad(flat.params.clone(), RANK, s))
            worker.step()
        worker.finish()
        assert worker.times.wait > 0 and worker.times.in_flight >= worker.times.wait
        assert 0.0 <= worker.times.overlap() <= 1.0
        results.append(worker.glob.W.clone())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_simulate_round_matches_runtime():
    """N virtual workers through simulate_round = the N-rank runtime on the same gradient function
    (to reduction rounding; bitwise with one worker)."""
    T, hp = 9, ODSGDHyper(lr=0.05, momentum=0.9, local_opt="dc-adaptive", lr_local=0.2, warmup_iters=2)
    flat = _flat_linear()
    theta0 = flat.params.clone()
    worker = ODSGDWorker(flat, COMM, hp=hp)
    worker.broadcast_parameters()
    glob = GlobalState.create(theta0)
    sims = [WorkerState.create(theta0.clone(), hp) for _ in range(SIZE)]
    for s in range(T):
        flat.grads.copy_(_weight_grad(flat.params.clone(), RANK, s))
        worker.step()
        grads = [_weight_grad(ws.local.clone(), k, s) for k, ws in enumerate(sims)]
        simulate_round(glob, sims, grads, hp=hp, warmup=s < hp.warmup_iters)
        # the runtime's params are the simulator's local weights of this worker
        torch.testing.assert_close(flat.params, sims[RANK].local, rtol=1e-5, atol=1e-6)
        if SIZE == 1:
            assert torch.equal(flat.params, sims[RANK].local)
    worker.finish()
    torch.testing.assert_close(worker.glob.W, glob.W, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="2 gradients for 1 workers"):
        simulate_round(glob, sims[:1], [grads[0], grads[0]], hp=hp)


def _cfg(**options):
    return TrainConfig(algorithm="odsgd", options=options)


@pytest.mark.parametrize("options, needle", [
    ({"odsgd_local_opt": "adam"}, "--odsgd-local-opt: local optimizer must be one of"),
    ({"odsgd_local_lr": -1.0}, "--odsgd-local-lr: lr_local must be >= 0"),
    ({"odsgd_delta": "both"}, "--odsgd-delta: delta must be one of"),
    ({"odsgd_warmup_iters": -2}, "--odsgd-warmup-iters: warmup_iters must be >= 0"),
    ({"odsgd_lambda": float("nan")}, "--odsgd-lambda: lambda must be a finite number"),
    ({"odsgd_ms_momentum": 1.0}, "--odsgd-ms-momentum: ms_momentum must be < 1"),
    ({"odsgd_progress": "poll"}, "--odsgd-progress 'poll' is not one of"),
])
def test_bad_options_name_the_flag(options, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        validate(_cfg(**options))


def test_hyper_from_config_defaults():
    hp = hyper_from_config(TrainConfig(algorithm="odsgd", lr=0.1, momentum=0.95))
    assert (hp.lr, hp.momentum, hp.local_opt, hp.delta, hp.warmup_iters) == \
        (0.1, 0.95, "dc-adaptive", "last-step", 200)


@pytest.mark.rank0
@pytest.mark.one_mpi       # MPICH: its MPI paths are the in-process OD-SGD tests'
def test_cli_run_ends_cleanly_with_timing_breakdown(tmp_path):
    out = tmp_path / "od.jsonl"
    r = run_mpi(4, ["train", "--algorithm", "odsgd", "--dataset", "fashion-mnist-mini",
                    "--train-limit", "2048", "--test-limit", "500", "--epochs", "1",
                    "--batch-size", "64", "--progress", "off", "--odsgd-warmup-iters", "2",
                    "--metrics", str(out)],
                timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    records = read_metrics(out)
    assert [rec["event"] for rec in records] == ["config", "epoch", "summary"]
    epoch, summary = records[1], records[2]
    assert summary["algorithm"] == "odsgd" and summary["world_size"] == 4
    assert summary["steps"] == 8 and summary["rounds"] == 8 and summary["warmup_steps"] == 2
    for key in ("compute_time_s", "wait_time_s", "round_time_s", "compute_ms_per_step",
                "wait_ms_per_step"):
        assert epoch[key] > 0, key
    assert 0.0 <= epoch["overlap_fraction"] <= 1.0 and epoch["warmup_steps"] == 2
    assert epoch["round_time_s"] >= epoch["wait_time_s"]
    assert math.isfinite(epoch["train_loss"])
    # 8 steps of 256 images cannot learn to an accuracy bar (11.2 / 17.2 / 14.6 % at seeds
    # 0 / 1 / 2, deterministic), but the evaluated global model moved downhill from the untrained
    # LeNet's test loss (2.3088 / 2.3033 / 2.3038 on these 500 images) to 2.2908 / 2.2814 / 2.2920;
    # a run that evaluates the initial weights (or never applies a global update) fails this
    assert summary["test_loss"] < 2.30, summary


@pytest.mark.rank0
def test_cli_bad_option_and_crash_with_round_in_flight():
    """A bad option fails with one line before MPI; a rank failing while its progress thread
    drives a round ends the whole job quickly (the thread cannot keep it alive)."""
    r = run_cli(["train", "--algorithm", "odsgd", "--odsgd-delta", "both"])
    assert r.returncode == 2 and "--odsgd-delta: delta must be one of" in r.stderr
    assert "Traceback" not in r.stderr
    t0 = time.time()
    r = run_mpi(4, ["train", "--algorithm", "odsgd", "--dataset", "fashion-mnist-mini",
                    "--train-limit", "2048", "--test-limit", "500", "--epochs", "3",
                    "--batch-size", "64", "--progress", "off", "--odsgd-warmup-iters", "2"],
                timeout=120, env=clean_env(HPCASYNC_INJECT_FAULT="2:5"))
    assert r.returncode != 0
    assert "rank 2 failed" in r.stderr and "injected fault" in r.stderr, r.stderr[-2000:]
    assert time.time() - t0 < 60
