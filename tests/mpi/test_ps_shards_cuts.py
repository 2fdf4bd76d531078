"""The sharded parameter server when its shards disagree (``hpcasync.ps.shards``).

**Resume from a cut the shards took apart**: with 2 workers, an epoch checkpoint of shard 0 and
shard 1 may hold different worker positions (each shard writes at its own 20th accepted push, in
its own push order). Rank 0 runs a 4-rank ``--ps-ranks 2`` job (servers 0, 1; workers 2, 3) with
epoch checkpoints, keeps the epoch-1 cut, moves shard 1's positions by one push (as if shard 1
had taken worker 0's 11th push before worker 1's 10th) and resumes: every worker must start after
the latest push any shard holds from it, each shard must report one lost push
(``resume_lost_pushes``), and the run must end with every budgeted push taken (exit 0).

**Shards that disagree on the epochs crossed** end the job within seconds with one line naming the
shard, instead of server 0 waiting for a slice that will not come: a 4-rank job of
``ParameterServer`` (this module's ``__main__``) where server 1 counts epochs differently, once
crossing fewer epochs than server 0 and once more.
"""
from __future__ import annotations

import sys

import pytest


def _disagree(mode: str) -> None:
    """Servers 0 and 1, workers 2 and 3, 10 pushes each; server 1's epoch clock is off."""
    import torch
    from mpi4py import MPI

    import hpcasync
    from hpcasync.ps.optimizer import ParameterServer

    hpcasync.install_fail_fast()
    rank = MPI.COMM_WORLD.Get_rank()
    steps, epochs = 5, 2                        # 2 workers: epoch e at 10·e accepted pushes
    if rank == 1:
        steps, epochs = (5, 1) if mode == "fewer" else (3, 3)   # crosses 10 / 6, 12, 18
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 3)
    opt = ParameterServer(model, "asgd", lr=0.1, comm=MPI.COMM_WORLD, ps_rank=0, ps_ranks=2,
                          steps_per_epoch=steps, epochs=epochs)
    if opt.is_server:
        opt.serve()
    else:
        opt.start()
        for i in range(10):
            opt.push(torch.full((opt.flat.numel,), 0.01 * i), loss=1.0)
        opt.finish()
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    _disagree(sys.argv[1])
    sys.exit(0)


from tests.mpi_util import last_summary, run_mpi  # noqa: E402

COMMON = ["train", "--algorithm", "asgd", "--dataset", "fashion-mnist-mini", "--train-limit", "640",
          "--test-limit", "200", "--batch-size", "32", "--progress", "off", "--seed", "3",
          "--epochs", "2", "--ps-ranks", "2"]


def _rewrite(path, header: dict, state: dict) -> None:
    """Write ``state`` as a checkpoint at ``path`` with ``header``'s fields (a tampered copy)."""
    from hpcasync.checkpoint import save_checkpoint

    std = ("format", "version", "algorithm", "model", "world_size", "epoch", "step", "created",
           "hpcasync", "torch")
    step = int(path.name.split("-s")[1][:-3])
    save_checkpoint(path, state, algorithm=header["algorithm"], model=header["model"],
                    world_size=header["world_size"], epoch=header["epoch"], step=step,
                    extra={k: v for k, v in header.items() if k not in std})


@pytest.mark.rank0
@pytest.mark.timeout(600)
@pytest.mark.one_mpi       # MPICH: the shard checkpoints are resumed by the death test below
def test_resume_from_a_cut_the_shards_took_apart(tmp_path):
    from hpcasync.checkpoint import read_checkpoint

    ck = tmp_path / "ck"
    r = run_mpi(4, [*COMMON, "--checkpoint-dir", str(ck), "--metrics", str(tmp_path / "a.jsonl")],
                timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    first = last_summary(tmp_path / "a.jsonl")
    assert first["pushes"] == 40 and first.get("resume_lost_pushes") is None
    e1 = sorted(ck.glob("ckpt-e0001*"))[-1]                 # shard 0's epoch-1 checkpoint
    for later in [*ck.glob("ckpt-e0002*"), *(ck / "shard-1").glob("ckpt-e0002*")]:
        later.unlink()
    header, s0 = read_checkpoint(e1)
    header1, s1 = read_checkpoint(ck / "shard-1" / e1.name)
    p0, p1 = s0["ps"]["positions"], s1["ps"]["positions"]
    assert sum(p0) == sum(p1) == 20 and s0["kind"] == s1["kind"] == "epoch"
    print(f"epoch-1 cut as written: shard 0 {p0}, shard 1 {p1}")
    moved = [p0[0] + 1, p0[1] - 1]                          # shard 1 took worker 0's next push
    s1["ps"]["positions"] = moved                           # ... instead of worker 1's last
    _rewrite(ck / "shard-1" / e1.name, header1, s1)
    r = run_mpi(4, [*COMMON, "--checkpoint-dir", str(ck), "--resume", "auto",
                    "--metrics", str(tmp_path / "b.jsonl")], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = last_summary(tmp_path / "b.jsonl")
    aligned = [max(a, b) for a, b in zip(p0, moved)]        # = [p0[0] + 1, p0[1]]
    assert got["resume_lost_pushes"] == [1, 1], got.get("resume_lost_pushes")
    assert [w["worker_start_step"] for w in got["workers"]] == aligned
    assert got["resumed_at_push"] == 21 and got["pushes"] == 40
    assert [w["worker_steps"] for w in got["workers"]] == [20, 20]
    assert "hold different worker positions" in r.stderr


@pytest.mark.rank0
@pytest.mark.timeout(200)
@pytest.mark.one_mpi       # MPICH: the servers' comparison travels as test_ps_shards' bitwise run's
@pytest.mark.parametrize("mode, says", [
    ("fewer", "shard 1's server (rank 1) ended without crossing epoch 2"),
    ("more", "shard 1's server (rank 1) crossed an epoch that shard 0 did not"),
])
def test_shards_that_disagree_on_epochs_end_the_job_with_one_line(mode, says):
    r = run_mpi(4, ["--", sys.executable, "-m", "tests.mpi.test_ps_shards_cuts", mode], timeout=90)
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if "hpcasync: error" in ln]
    assert lines and says in lines[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr



@pytest.mark.rank0
@pytest.mark.timeout(400)
def test_a_worker_death_without_ulfm_leaves_shard_checkpoints_that_resume(tmp_path):
    """Worker rank 3 SIGKILLs itself in its 40th push (epoch 2 of 32 pushes per worker). Open MPI
    then SIGTERMs the survivors: each server writes a SIGTERM checkpoint at its own push count
    (kind ``signal``); MPICH's hydra SIGKILLs at once, leaving epoch 1's cut. Either way
    ``--resume auto`` must pair the shards' files, align the positions and finish every push."""
    import subprocess
    import time

    from hpcasync.checkpoint import checkpoint_name, read_checkpoint
    from hpcasync.launch import OPEN_MPI
    from tests.mpi_util import REPO, VENDOR, clean_env, mpiexec

    ck = tmp_path / "ck"
    args = [*COMMON, "--train-limit", "2048", "--checkpoint-dir", str(ck)]
    t0 = time.time()
    out = subprocess.run([*mpiexec(4), sys.executable, "-m", "hpcasync.cli", *args, "--metrics",
                          str(tmp_path / "a.jsonl")], env=clean_env(HPCASYNC_INJECT_KILL="3:40"),
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and time.time() - t0 < 60, out.stderr[-3000:]
    newest = sorted(ck.glob("ckpt-*.pt"))[-1]
    _, s0 = read_checkpoint(newest)
    kind = "signal" if VENDOR == OPEN_MPI else "epoch"
    assert s0["kind"] == kind, (s0["kind"], out.stderr[-3000:])
    mine = sorted((ck / "shard-1").glob(newest.name[:len("ckpt-e0000")] + "-s*.pt"))
    assert mine, sorted(p.name for p in (ck / "shard-1").iterdir())
    h1, s1 = read_checkpoint(mine[-1])
    print(f"{kind} checkpoints: shard 0 {s0['ps']['positions']}, shard 1 {s1['ps']['positions']}")
    if kind == "signal" and mine[-1].name == newest.name:
        # the two servers stood at the same push when the signal came (worker 2 had finished):
        # make shard 1's as if its signal came one push of worker 3 earlier, under its own name
        ps = s1["ps"]
        ps["positions"][1] -= 1
        ps["stats"]["accepted"] -= 1
        ps["stats"]["per_worker"][1] -= 1
        mine[-1].unlink()
        _rewrite(ck / "shard-1" / checkpoint_name(h1["epoch"], h1["step"] - 1), h1, s1)
    r = run_mpi(4, [*args, "--resume", "auto", "--metrics", str(tmp_path / "b.jsonl")],
                timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = last_summary(tmp_path / "b.jsonl")
    aligned = [max(a, b) for a, b in zip(s0["ps"]["positions"], s1["ps"]["positions"])]
    lost = [sum(a - p for a, p in zip(aligned, s["ps"]["positions"])) for s in (s0, s1)]
    assert [w["worker_start_step"] for w in got["workers"]] == aligned
    assert got["resume_lost_pushes"] == lost
    assert got["pushes"] == 128 and [w["worker_steps"] for w in got["workers"]] == [64, 64]


@pytest.mark.rank0
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kill, taken", [
    ({"HPCASYNC_INJECT_KILL": "3:40"}, 0),      # before its header to shard 0: neither took it
    # its push whole at shard 0 (which announced it to shard 1), not at shard 1: shard 0 took it,
    # and shard 1 drops the announcement once it finds the worker dead (a follower that waited
    # for that header kept the run waiting for good: the random-kill study of 2026-12-04)
    ({"HPCASYNC_INJECT_KILL_AT": "3:shard_push:40"}, 1),
])
def test_a_worker_death_under_ulfm_is_survived_by_every_shard(tmp_path, kill, taken):
    """``--with-ft ulfm``, K = 2: worker 1 (rank 3) dies in its 40th push; both servers retire
    it and the run ends with exit 0, the summary naming it by its world rank."""
    import subprocess

    from tests.mpi_util import REPO, clean_env, mpiexec, need_ulfm

    need_ulfm()
    args = [*COMMON, "--train-limit", "2048", "--metrics", str(tmp_path / "a.jsonl")]
    out = subprocess.run([*mpiexec(4, ft=True), sys.executable, "-m", "hpcasync.cli", *args],
                         env=clean_env(**kill), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    s = last_summary(tmp_path / "a.jsonl")
    [failed] = s["failed_workers"]
    assert (failed["worker"], failed["rank"], failed["pushes"]) == (1, 3, 39 + taken)
    assert s["pushes_per_worker"] == [64, 39 + taken] and s["pushes"] == 103 + taken
    assert s["rule_workers"]["alive"] == [True, False]
    assert out.stderr.count("worker 1 (rank 3) died") == 2, out.stderr[-3000:]   # each shard
