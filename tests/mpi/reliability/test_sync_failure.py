"""A rank of a synchronous run dies (real SIGKILLs, ``mpirun --with-ft ulfm``): the survivors
revoke and shrink the world, adopt the most advanced state, re-shard the rest of the epoch and
train on (:mod:`hpcasync.runtime.recovery`) — exit 0, the summary and a ``rank_failed`` record say
who died and what recovery cost, the survivors' replicas are bitwise identical.

Kills: ``HPCASYNC_INJECT_KILL_AT=RANK:PHASE:N`` (that rank SIGKILLs itself the N-th time it
reaches PHASE: startup, step, epoch_end, checkpoint, final). Every job runs under a timeout; ULFM
is Open-MPI-only (these tests skip under MPICH, where a dead rank ends the job at once).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import pytest

from hpcasync.checkpoint import load_checkpoint
from hpcasync.metrics import read_metrics
from hpcasync.launch import OPEN_MPI
from tests.mpi_util import REPO, VENDOR, clean_env, last_summary, mpiexec, need_ulfm

TRAIN = 6000                             # the whole mini training set
DATA = ["train", "--dataset", "fashion-mnist-mini", "--train-limit", str(TRAIN), "--epochs", "2",
        "--progress", "off"]                 # (and its whole test set, 1000 images)
JOB_TIMEOUT = 120
ODSGD = ["--odsgd-warmup-iters", "10"]       # a kill at step 30 falls in the one-step-delay phase


def _run(tmp_path, algorithm: str, kill: str = "", *, extra=(), n: int = 4, ft: bool = True,
         env=None):
    """One job of ``n`` ranks on the data slice, ``kill`` as HPCASYNC_INJECT_KILL_AT."""
    metrics = tmp_path / f"{algorithm}-{kill.replace(':', '_').replace(',', '+') or 'none'}.jsonl"
    cmd = [*mpiexec(n, ft=ft), sys.executable, "-m", "hpcasync.cli", *DATA, "--algorithm",
           algorithm, "--metrics", str(metrics), *extra]
    env = {"HPCASYNC_INJECT_KILL_AT": kill, "HPCASYNC_INJECT_KILL_LOG": str(tmp_path / "kills"),
           **(env or {})}
    t0 = time.time()
    out = subprocess.run(cmd, env=clean_env(**env), cwd=REPO, capture_output=True, text=True,
                         timeout=JOB_TIMEOUT)
    return out, metrics, time.time() - t0


_undisturbed: dict = {}      # (algorithm, extra) -> (out, metrics): one undisturbed run per setting


def _base(tmp_path, algorithm: str, extra=()):
    """The undisturbed run of ``algorithm`` (deterministic: same arguments, same run), made once
    per setting for the module: both DASO kills compare against one."""
    key = (algorithm, tuple(extra))
    if key not in _undisturbed:
        out, metrics, _ = _run(tmp_path, algorithm, extra=extra)
        assert out.returncode == 0, out.stderr[-3000:]
        _undisturbed[key] = (out, metrics)
    return _undisturbed[key]


def _survived(out, metrics, dead: list[int], *, params_digest: bool = True) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    s = last_summary(metrics)
    assert s["fault_tolerance"] == "ulfm"
    assert s["failed_ranks"] == sorted(dead)
    assert s["world_size"] == 4 - len(dead)
    digests = s["replica_sha256"]
    assert len(digests) == 4 - len(dead) and len(set(digests)) == 1, digests   # bitwise equal
    if params_digest:                  # (DASO's digests are of its packed state)
        assert digests[0] == s["params_sha256"]
    records = read_metrics(metrics)
    failed = [r for r in records if r["event"] == "rank_failed"]
    assert sorted(r for f in failed for r in f["dead_ranks"]) == sorted(dead)
    assert [r["epoch"] for r in records if r["event"] == "epoch"] == [1, 2]
    for f in s["rank_failures"]:
        assert 0 <= f["recovery_s"] < 2.0
        assert f["next_step_s"] is None or f["next_step_s"] >= f["recovery_s"]
    return s


# -- SSGD -----------------------------------------------------------------------------------------

@pytest.mark.rank0
def test_ssgd_survives_a_rank_sigkilled_mid_epoch(tmp_path):
    """The done-bar on a data slice: rank 2 of 4 dies after step 30 of epoch 1; exit 0, the rest
    of epoch 1 is re-sharded over 3 ranks (steps counted exactly), replicas bitwise equal, test
    accuracy within 3 points of the undisturbed run (the full-size runs: experiments/)."""
    need_ulfm()
    _, mbase = _base(tmp_path, "ssgd")
    out, metrics, _ = _run(tmp_path, "ssgd", "2:step:30")
    s = _survived(out, metrics, [2])
    rest = (TRAIN // 4 - 30 * 32) * 4 // 3 // 32          # the rest of epoch 1 over 3 ranks
    assert s["steps"] == 30 + rest + (TRAIN // 3) // 32, s["steps"]
    [f] = s["rank_failures"]
    assert f["position"] == [1, 30, 1] and f["survivors"] == [0, 1, 3]
    assert "rank(s) 2 died; going on with 3 ranks" in out.stderr
    kill_time = float((tmp_path / "kills").read_text().split()[-1])
    assert f["detected_unix"] - kill_time < 5.0
    acc0 = last_summary(mbase)["test_accuracy"]
    assert abs(s["test_accuracy"] - acc0) <= 0.03, (s["test_accuracy"], acc0)
    assert s["test_accuracy"] >= 0.65


@pytest.mark.rank0
def test_ssgd_with_powersgd_survives_a_rank_sigkilled_mid_epoch(tmp_path):
    """--compress powersgd (rank 4, compressed from step 10): rank 2 dies at step 30; the survivors
    adopt the most advanced state (step count, P, Q, the draw order; each keeps its own error
    memory), their replicas end bitwise equal and the run learns."""
    need_ulfm()
    out, metrics, _ = _run(tmp_path, "ssgd", "2:step:30",
                           extra=["--compress", "powersgd", "--powersgd-start-iter", "10",
                                  "--powersgd-rank", "4"])
    s = _survived(out, metrics, [2])
    assert s["rank_failures"][0]["position"] == [1, 30, 1]
    assert s["bytes_communicated"] < 0.2 * 4 * 4 * s["steps"] * 61706       # LeNet, compressed
    assert s["test_accuracy"] >= 0.65          # (undisturbed: 72.7 %, without compression 72.5)


@pytest.mark.rank0
def test_localsgd_survives_a_rank_sigkilled_between_two_averages(tmp_path):
    """localsgd (SSGD for 10 steps, then averages every 4): rank 2 dies at step 30, two local
    steps after the average at step 26 (0-based); the survivors take the most advanced replica,
    train on, average at each epoch's end: their replicas end bitwise equal, and it learns."""
    need_ulfm()
    out, metrics, _ = _run(tmp_path, "localsgd", "2:step:30",
                           extra=["--localsgd-period", "4", "--localsgd-warmup-steps", "10"])
    s = _survived(out, metrics, [2])
    assert s["rank_failures"][0]["position"] == [1, 30, 1]
    assert s["test_accuracy"] >= 0.65


@pytest.mark.rank0
def test_slowmo_survives_a_rank_sigkilled_between_two_syncs(tmp_path):
    """slowmo (a sync with the slow momentum after every 8th step): rank 2 dies at step 30; the
    survivors take the most advanced replica with its x0 and u, train on: replicas bitwise
    equal at the end, and it learns."""
    need_ulfm()
    out, metrics, _ = _run(tmp_path, "slowmo", "2:step:30", extra=["--slowmo-period", "8"])
    s = _survived(out, metrics, [2])
    assert s["rank_failures"][0]["position"] == [1, 31, 1]     # (as diloco's: 32 syncs)
    assert s["test_accuracy"] >= 0.6          # (undisturbed: 68.9 %; this run: 63.1)


@pytest.mark.rank0
def test_diloco_survives_a_rank_sigkilled_between_two_outer_steps(tmp_path):
    """diloco (an outer step every 8 inner steps, outer lr 0.4): rank 2 dies at step 30, before
    the outer step after step 32; the survivors take the most advanced replica with its
    global parameters and outer momentum, train on, end on the global model: their replicas are
    bitwise equal, and it learns."""
    need_ulfm()
    out, metrics, _ = _run(tmp_path, "diloco", "2:step:30",
                           extra=["--diloco-sync-every", "8", "--diloco-outer-lr", "0.4"])
    s = _survived(out, metrics, [2])
    # the inner steps need no peer: the survivors finish 31 before the outer step after the
    # 32nd meets the death
    assert s["rank_failures"][0]["position"] == [1, 31, 1]
    assert s["test_accuracy"] >= 0.6


@pytest.mark.rank0
def test_ssgd_survives_rank_0_and_the_new_rank_0_finishes_the_metrics_stream(tmp_path):
    need_ulfm()
    out, metrics, _ = _run(tmp_path, "ssgd", "0:step:20")
    s = _survived(out, metrics, [0])
    assert s["rank_failures"][0]["survivors"] == [1, 2, 3]
    assert "rank 1 takes over the metrics stream" in out.stderr
    assert metrics.exists()                                 # completed, not .partial


@pytest.mark.rank0
def test_ssgd_survives_two_deaths_one_after_another(tmp_path):
    need_ulfm()
    out, metrics, _ = _run(tmp_path, "ssgd", "3:step:10,1:step:50")
    s = _survived(out, metrics, [1, 3])
    assert [f["survivors"] for f in s["rank_failures"]] == [[0, 1, 2], [0, 2]]


@pytest.mark.rank0
@pytest.mark.parametrize("phase", ["startup", "epoch_end", "checkpoint", "final"])
def test_ssgd_survives_a_death_at_every_phase(tmp_path, phase):
    """Start-up (before the first broadcast), an epoch end (before the evaluation), a checkpoint
    write (rank 0, the writer, dies: the new rank 0 writes it) and the final gathers."""
    need_ulfm()
    rank = 0 if phase == "checkpoint" else 1
    extra = ["--checkpoint-dir", str(tmp_path / "ck")] if phase == "checkpoint" else []
    out, metrics, wall = _run(tmp_path, "ssgd", f"{rank}:{phase}:1", extra=extra)
    _survived(out, metrics, [rank])
    assert wall < 60
    if phase == "checkpoint":          # the epoch-1 file, written by the new rank 0, and epoch 2
        names = sorted(p.name for p in (tmp_path / "ck").glob("ckpt-e*.pt"))
        assert [n[:10] for n in names] == ["ckpt-e0001", "ckpt-e0002"], names
        state = load_checkpoint(tmp_path / "ck" / names[-1])
        assert state["epoch"] == 3 and [f["dead_ranks"] for f in state["rank_failures"]] == [[0]]


ADOPT_SCRIPT = r'''
import json, sys
from types import SimpleNamespace
from hpcasync.metrics import MetricsWriter
from hpcasync.runtime.elastic import FaultTolerance
from hpcasync.runtime.recovery import SyncWorld
from hpcasync.topology import Topology

topo = Topology.build()
ctx = SimpleNamespace(topo=topo, metrics=MetricsWriter(None, enabled=False), history=[])
# ranks at different positions (as after a collective that failed on some ranks only): rank 2 is
# one step ahead, rank 3 one epoch end ahead of rank 1; no one died, so the shrink keeps all
pos = {0: (1, 7, 1), 1: (1, 8, 1), 2: (2, 0, 1), 3: (1, 8, 1)}[topo.rank]
got = []
world = SyncWorld(ctx, state=lambda: {"from": topo.rank, "pos": pos}, load=got.append,
                  adopt=lambda same: None, payload=dict, check=lambda: None)
FaultTolerance(world, ulfm=True, grow_back=False).reset(pos)
adopted = world.position
out = ctx.topo.world.gather([list(adopted), got[0], ctx.topo.size], root=0)
if topo.rank == 0:
    print("RESULT " + json.dumps(out))
'''


@pytest.mark.rank0
@pytest.mark.parametrize("algorithm", ["ssgd", pytest.param("odsgd", marks=pytest.mark.one_mpi)])
def test_a_checkpoint_inside_the_re_sharded_epoch_resumes_bitwise(tmp_path, algorithm):
    """Rank 2 of 4 dies after step 30 of epoch 1; the rest of the epoch is re-sharded over 3
    ranks and the run checkpoints at step 40 (10 batches into the re-sharded plan). That
    checkpoint resumed on 3 ranks (without ULFM) trains the rest of the same plan (its
    ``shards``), not a fresh 3-way deal of the epoch, and ends bitwise where the recovered run
    ended, epoch 1's mean loss included (each rank's own sum). Both runs sum gradients with
    ``MPI_Allreduce``: the recovered world does, a fresh 3-rank job would take the shared-memory
    reduction (another summation order)."""
    need_ulfm()
    mpi = {"HPCASYNC_ALLREDUCE": "mpi"}
    ckpt = tmp_path / "ckpt"
    keep = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "10", "--checkpoint-keep",
            "100", *(ODSGD if algorithm == "odsgd" else [])]
    out, metrics, _ = _run(tmp_path, algorithm, "2:step:30", extra=keep, env=mpi)
    assert out.returncode == 0, out.stderr[-3000:]
    recovered = last_summary(metrics)
    assert recovered["world_size"] == 3 and recovered["rank_failures"][0]["position"][:2] == [1, 30]
    mid = ckpt / "ckpt-e0001-s00000040.pt"
    state = load_checkpoint(mid)
    assert state["batch"] == 10 and len(state["shards"]) == 3, sorted(state)
    again = tmp_path / "again"
    again.mkdir()
    shutil.copy(mid, again)
    out, metrics2, _ = _run(tmp_path / "again", algorithm, n=3, ft=False, extra=[
        "--checkpoint-dir", str(again), "--resume", "auto",
        *(ODSGD if algorithm == "odsgd" else [])], env=mpi)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = last_summary(metrics2)
    assert resumed["steps"] == recovered["steps"], (resumed["steps"], recovered["steps"])
    assert resumed["params_sha256"] == recovered["params_sha256"]
    losses = [[r["train_loss"] for r in read_metrics(m) if r["event"] == "epoch"]
              for m in (metrics, metrics2)]
    assert losses[0] == losses[1], losses       # (each rank's own loss sum and count resumed)


@pytest.mark.rank0
def test_recovery_adopts_the_most_advanced_survivors_state(tmp_path):
    """Positions that differ (a collective failed on some ranks only): every rank loads the state
    of the rank furthest on, rank 2 at the start of epoch 2, and gets its position."""
    need_ulfm()
    script = tmp_path / "adopt.py"
    script.write_text(ADOPT_SCRIPT)
    out = subprocess.run([*mpiexec(4, ft=True), sys.executable, str(script)], env=clean_env(),
                         cwd=REPO, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    [line] = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    rows = json.loads(line[7:])
    assert rows == [[[2, 0, 1], {"from": 2, "pos": [2, 0, 1]}, 4]] * 4, rows


@pytest.mark.rank0
# MPICH: the launcher's kill of every rank is ssgd's case; odsgd's is the same kill
@pytest.mark.parametrize("algorithm", ["ssgd", pytest.param("odsgd", marks=pytest.mark.one_mpi)])
def test_without_ulfm_a_death_ends_the_job_within_30_s_naming_the_rank(tmp_path, algorithm):
    """The launcher ends the job (Open MPI: SIGTERM then SIGKILL to every survivor; MPICH's
    hydra: SIGKILL at once): non-zero exit within 30 s of the death (the kill log's time, not the
    launch: start-up and 30 steps took 30.6 s of a loaded 2-core box under MPICH); Open MPI's line
    names the dead rank."""
    out, metrics, _ = _run(tmp_path, algorithm, "2:step:30", ft=False,
                           extra=ODSGD if algorithm == "odsgd" else ())
    ended = time.time()
    killed_at = float((tmp_path / "kills").read_text().split()[-1])
    assert out.returncode != 0 and ended - killed_at < 30, (out.returncode, ended - killed_at)
    if VENDOR == OPEN_MPI:
        assert re.search(r"process rank 2 with PID \d+ on node \S+ exited on\s+signal 9",
                         out.stderr), out.stderr[-2000:]
    assert not metrics.exists()                           # the stream stays .partial


# -- OD-SGD ---------------------------------------------------------------------------------------



@pytest.mark.rank0
def test_odsgd_survives_a_rank_sigkilled_mid_epoch(tmp_path):
    """The round in flight is lost (its gradients), the survivors adopt the global model of the
    most advanced rank, restart their local weights from it and go on: exit 0, the global model
    bitwise equal on every survivor, accuracy within 3 points of the undisturbed run."""
    need_ulfm()
    _, mbase = _base(tmp_path, "odsgd", extra=ODSGD)
    out, metrics, _ = _run(tmp_path, "odsgd", "2:step:30", extra=ODSGD)
    s = _survived(out, metrics, [2])
    [f] = s["rank_failures"]
    assert f["position"][:3] == [1, 30, 1] and f["survivors"] == [0, 1, 3]
    rest = (TRAIN // 4 - 30 * 32) * 4 // 3 // 32
    assert s["steps"] == 30 + rest + (TRAIN // 3) // 32, s["steps"]
    acc0 = last_summary(mbase)["test_accuracy"]
    assert abs(s["test_accuracy"] - acc0) <= 0.03, (s["test_accuracy"], acc0)


@pytest.mark.rank0
@pytest.mark.parametrize("phase", ["startup", "epoch_end"])
def test_odsgd_survives_a_death_at_start_up_and_at_an_epoch_end(tmp_path, phase):
    need_ulfm()
    out, metrics, wall = _run(tmp_path, "odsgd", f"3:{phase}:1", extra=ODSGD)
    _survived(out, metrics, [3])
    assert wall < 60


# -- DASO -----------------------------------------------------------------------------------------

DASO = ["--ranks-per-node", "2", "--daso-warmup-epochs", "0", "--daso-cooldown-epochs", "1"]


@pytest.mark.rank0
@pytest.mark.parametrize("kill,phase", [("3:step:30", "cycling"), ("1:step:60", "cooldown")])
def test_daso_survives_a_rank_sigkilled_on_two_virtual_nodes(tmp_path, kill, phase):
    """2 virtual nodes of 2, epoch 1 cycling, epoch 2 blocking (cool-down). A death leaves nodes
    of 2 and 1, and the survivors keep them (uneven nodes; the node-local groups in detail:
    test_daso_after_death.py), drop the global messages in flight, finish the epoch on their own
    shards (DASO's schedule keeps the epoch's batch count) and go on: exit 0, replicas bitwise
    equal at the end, accuracy within 5 points of the undisturbed run on this slice (its
    seed-to-seed spread is about 4)."""
    need_ulfm()
    _, mbase = _base(tmp_path, "daso", extra=DASO)
    out, metrics, _ = _run(tmp_path, "daso", kill, extra=DASO)
    dead = int(kill.split(":")[0])
    s = _survived(out, metrics, [dead], params_digest=False)
    assert s["replicas_identical"]
    assert s["daso_node_sizes"] == ([2, 1] if dead == 3 else [1, 2])
    assert [row[1] for row in s["daso_schedule"]] == ["cycling", "cooldown"]
    per_epoch = TRAIN // 4 // 32
    assert s["steps"] == per_epoch + (TRAIN // 3 // 32 if phase == "cycling" else per_epoch)
    [f] = s["rank_failures"]
    assert f["position"][0] == (1 if phase == "cycling" else 2)
    acc0 = last_summary(mbase)["test_accuracy"]
    assert abs(s["test_accuracy"] - acc0) <= 0.05, (s["test_accuracy"], acc0)
