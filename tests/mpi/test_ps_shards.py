"""The sharded parameter server (``--ps-ranks K``, ``hpcasync.ps.shards``).

**K = 2 equals K = 1, bitwise, for every rule** (one worker: the push order is fixed, so both are
deterministic). Rank 0 launches two MPI jobs that each run the command line's entry point
(``hpcasync.cli.main``) once per rule the session's tests read, as tests/mpi/test_resume_all.py
does: a 3-rank job with ``--ps-ranks 2`` (servers 0 and 1, worker 2) and a 2-rank job with one
server. Each rule's final
parameters (``params_sha256``) and test loss must be equal: every rule is elementwise in θ apart
from scalars that sharding keeps per shard, so cutting θ in two must not change a bit. The 3-rank job
also stops a K = 2 run of asgd and smega2 by a signal at the worker (``HPCASYNC_INJECT_SIGNAL``:
stop checkpoints written by both servers) and resumes it: the result must equal the uninterrupted
K = 2 run bitwise.

**In-process** (the 4-rank pytest world: servers 0 and 1, workers 2 and 3, ``ParameterServer`` with
``ps_ranks=2``): every reply slice is its shard's θ at the version in its header (digests, as
tests/mpi/test_ps_replies.py); a push with one NaN in one shard's slice is rejected by both shards
and the rest is applied exactly once.

**Errors**: a checkpoint written with K = 2 resumed with K = 1 is a one-line CheckpointError;
K >= the world size or K < 1 is a one-line error before any MPI work (exit status 2).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

COMMON = ["--dataset", "fashion-mnist-mini", "--train-limit", "640", "--test-limit", "200",
          "--batch-size", "32", "--progress", "off", "--seed", "3"]
RESUMED = ("asgd", "smega2")
EXTRA = {"smega2": ["--momentum", "0.9"], "dana": ["--momentum", "0.9"],
         "nag": ["--momentum", "0.9"], "asgd": ["--ps-momentum", "0.5"]}
SIGNAL_STEP = 25             # the worker signals itself at its 25th step (epoch 2 of 20 per epoch)


def _args(algorithm: str, epochs: int) -> list[str]:
    return ["train", "--algorithm", algorithm, *COMMON, "--epochs", str(epochs),
            *EXTRA.get(algorithm, [])]


# -- the jobs (every rank runs this) ------------------------------------------------------------

def _main(out: Path, shards: int, algorithms: list[str]) -> None:
    from mpi4py import MPI

    from hpcasync import cli

    codes: dict[str, list] = {}

    def run(name: str, label: str, args: list[str], signal: str = "") -> None:
        os.environ["HPCASYNC_INJECT_SIGNAL"] = signal
        try:
            code = cli.main([*args, "--ps-ranks", str(shards),
                             "--metrics", str(out / f"{name}-{label}.jsonl")])
        except SystemExit as exc:
            code = exc.code
        codes.setdefault(name, []).append(code)

    for name in algorithms:
        run(name, f"k{shards}", _args(name, 1))
        if shards == 2 and name in RESUMED:
            ck = str(out / f"{name}-ck")
            run(name, "ref", _args(name, 2))
            run(name, "a", [*_args(name, 2), "--checkpoint-dir", ck], f"2:{SIGNAL_STEP}")
            run(name, "b", [*_args(name, 2), "--checkpoint-dir", ck, "--resume", "auto"])
    if MPI.COMM_WORLD.Get_rank() == 0:
        (out / f"codes-k{shards}.json").write_text(json.dumps(codes))


if __name__ == "__main__":
    _main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
    sys.exit(0)


from hpcasync.ps.optimizer import ALGORITHMS, ParameterServer  # noqa: E402
from tests.mpi_util import COMM, SIZE, last_summary, run_mpi, selected  # noqa: E402

needs4 = pytest.mark.skipif(SIZE != 4, reason="needs 4 MPI ranks")
_jobs: dict = {}


def _needed(request) -> tuple[list[str], bool]:
    """The rules the session's tests of the two jobs read, and whether they read the one-server
    job (CI's MPICH pass selects only the another-K test: asgd's K = 2 stop checkpoint)."""
    equal = selected(request, "test_two_shards_equal_one_server_bitwise")
    names = {*equal, *selected(request, "test_resume_of_two_shard_checkpoint_is_bitwise")}
    if selected(request, "test_resume_with_another_k_is_one_line_error"):
        names.add("asgd")
    return [a for a in ALGORITHMS if a in names], bool(equal)


def _jobs_out(request, tmp_path_factory) -> Path:
    if "out" not in _jobs:
        out = tmp_path_factory.mktemp("shards")
        names, one_server = _needed(request)
        for n, k in ((3, 2), (2, 1))[:2 if one_server else 1]:
            r = run_mpi(n, ["--", sys.executable, "-m", "tests.mpi.test_ps_shards", str(out), str(k),
                            *names], timeout=560)
            _jobs[k] = r
        _jobs["out"] = out
    for k in (2, 1):
        assert k not in _jobs or _jobs[k].returncode == 0, _jobs[k].stderr[-4000:]
    return _jobs["out"]


@pytest.mark.rank0
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.one_mpi       # MPICH: the shards' MPI paths are the in-process shard tests' below
def test_two_shards_equal_one_server_bitwise(algorithm, request, tmp_path_factory):
    out = _jobs_out(request, tmp_path_factory)
    for k in (1, 2):
        codes = json.loads((out / f"codes-k{k}.json").read_text())[algorithm]
        assert codes[0] == 0, codes
    one = last_summary(out / f"{algorithm}-k1.jsonl")
    two = last_summary(out / f"{algorithm}-k2.jsonl")
    assert one["pushes"] == two["pushes"] == 20 and two["rejected_pushes"] == 0
    assert two["test_loss"] == one["test_loss"]
    assert two["params_sha256"] == one["params_sha256"]


@pytest.mark.rank0
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("algorithm", RESUMED)
@pytest.mark.one_mpi       # MPICH: the shards' MPI paths are the in-process shard tests' below
def test_resume_of_two_shard_checkpoint_is_bitwise(algorithm, request, tmp_path_factory):
    from hpcasync.checkpoint import read_checkpoint

    out = _jobs_out(request, tmp_path_factory)
    codes = json.loads((out / "codes-k2.json").read_text())[algorithm]
    assert codes == [0, 0, 75, 0], codes
    from hpcasync.metrics import read_metrics

    resume = [r for r in read_metrics(out / f"{algorithm}-b.jsonl") if r["event"] == "resume"]
    main = Path(resume[0]["path"])                      # shard 0's stop checkpoint
    shard = main.parent / "shard-1" / main.name
    header, state = read_checkpoint(main)
    _, state1 = read_checkpoint(shard)                  # the second server's, same point
    assert state["kind"] == state1["kind"] == "stop" and state["ps_ranks"] == 2
    assert state["ps"]["positions"] == state1["ps"]["positions"] == [SIGNAL_STEP + 1]
    assert state["ps"]["rule"]["version"] == state1["ps"]["rule"]["version"] == SIGNAL_STEP + 1
    (lo0, hi0), (lo1, hi1) = state["bounds"]
    assert lo0 == 0 and hi0 == lo1 and hi1 - lo1 in (hi0 - lo0, hi0 - lo0 - 1)
    ref = last_summary(out / f"{algorithm}-ref.jsonl")
    got = last_summary(out / f"{algorithm}-b.jsonl")
    assert got["resumed_at_push"] == SIGNAL_STEP + 1 and got["pushes"] == ref["pushes"] == 40
    assert got["test_loss"] == ref["test_loss"]
    assert got["params_sha256"] == ref["params_sha256"]


@pytest.mark.rank0
@pytest.mark.timeout(1200)
def test_resume_with_another_k_is_one_line_error(request, tmp_path_factory):
    out = _jobs_out(request, tmp_path_factory)
    ck = str(out / "asgd-ck")
    r = run_mpi(3, [*_args("asgd", 2), "--ps-ranks", "1", "--checkpoint-dir", ck,
                    "--resume", "auto"], timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if "--ps-ranks" in ln]
    assert lines and "written by 2 server ranks (--ps-ranks), this run has 1" in lines[0], \
        r.stderr[-2000:]


@pytest.mark.rank0
@pytest.mark.parametrize("k", ["3", "0", pytest.param("-1", marks=pytest.mark.one_mpi)])
def test_bad_k_is_one_line_error_before_mpi(k):      # -1: the parser's check of 0 (its twin)
    r = run_mpi(3, [*_args("asgd", 1), "--ps-ranks", k], timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    want = "leaves no worker in a world of 3 ranks" if k == "3" else "must be a positive integer"
    assert want in r.stderr
    assert "Traceback" not in r.stderr and "hpcasync asgd" not in r.stderr    # no run started


# -- in-process: replies per shard, a NaN in one shard's slice ----------------------------------

def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(100, 7)            # 707 parameters: shards of 354 and 353


def _sharded_run(pushes: int, grad_of, *, lr: float = 0.5, seen=None, got=None, theta0=None):
    """Servers 0, 1 and workers 2, 3 run asgd; returns (opt, heads per worker step)."""
    model = _model()
    if theta0 is not None:
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(theta0, model.parameters())
    opt = ParameterServer(model, "asgd", lr=lr, comm=COMM, ps_rank=0, ps_ranks=2)
    heads = []
    if opt.is_server:
        rule = opt.rule
        if seen is not None:
            seen[(opt.shard, 0)] = _digest(rule.theta)
        opt.serve(on_push=lambda w, tau, loss: seen is not None and seen.__setitem__(
            (opt.shard, rule.version), _digest(rule.theta)))
    else:
        L = opt.layout
        opt.start()
        if got is not None:
            got.extend((s, opt.versions[s], _digest(L.slice(opt._reply, s))) for s in range(2))
        for step in range(pushes):
            time.sleep(0.002 * opt.worker)
            g = grad_of(opt.worker, step, opt.flat.numel)
            head = opt.push(g, loss=1.0)
            heads.append(head.accepted)
            if got is not None:
                got.extend((s, opt.versions[s], _digest(L.slice(opt._reply, s)))
                           for s in range(2))
        opt.finish()
    return opt, heads


@needs4
def test_every_reply_slice_is_its_shards_theta_at_its_version():
    seen: dict = {}
    got: list = []
    opt, _ = _sharded_run(10, lambda w, s, n: torch.linspace(-1, 1, n) * (0.01 * (w + 1) + s),
                          seen=seen, got=got)
    assert opt.layout.bounds == [(0, 354), (354, 707)]
    seen_all: dict = {}
    for part in COMM.allgather(seen):
        seen_all.update(part)
    bad = []
    for r, part in enumerate(COMM.allgather(got)):
        for shard, version, digest in part:
            if seen_all.get((shard, version)) != digest:
                bad.append(f"rank {r}: shard {shard}'s reply at version {version} is not its θ")
    assert not bad, bad[:5]
    assert sum(len(p) for p in COMM.allgather(got)) == 2 * 2 * 11


@needs4
def test_nan_in_one_shard_is_rejected_by_every_shard():
    n, bad_step = 707, 3

    def grad(w, s, numel):
        g = torch.full((numel,), float(w))           # worker w pushes w: exact in fp32
        if w == 0 and s == bad_step:
            g[600] = float("nan")                    # in shard 1's slice only
        return g
    theta0 = torch.zeros(n)
    opt, heads = _sharded_run(6, grad, lr=0.5, theta0=theta0)
    if opt.is_server:
        st = opt.server.stats
        info = (opt.shard, st.accepted, st.rejected, opt.rule.version)
    else:
        info = (opt.worker, heads)
    infos = COMM.allgather(info)
    assert infos[0][1:] == infos[1][1:] == (11, 1, 11), infos          # both shards: same verdict
    assert infos[2] == (0, [s != bad_step for s in range(6)]), infos   # the worker was told
    assert infos[3] == (1, [True] * 6), infos
    # every rank holds the final θ: worker 1's 6 pushes of 1.0 and worker 0's 5 pushes of 0.0
    want = torch.full((n,), -0.5 * 6 * 1.0)
    params = torch.nn.utils.parameters_to_vector(opt.flat.module.parameters())
    assert torch.equal(params, want)
