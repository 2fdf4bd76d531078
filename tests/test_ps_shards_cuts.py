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


@pytest.mark.rank0
@pytest.mark.timeout(600)
def test_resume_from_a_cut_the_shards_took_apart(tmp_path):
    from hpcasync.checkpoint import read_checkpoint, save_checkpoint

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
    std = ("format", "version", "algorithm", "model", "world_size", "epoch", "step", "created",
           "hpcasync", "torch")
    save_checkpoint(ck / "shard-1" / e1.name, s1, algorithm=header1["algorithm"],
                    model=header1["model"], world_size=header1["world_size"],
                    epoch=header1["epoch"], step=header1["step"],
                    extra={k: v for k, v in header1.items() if k not in std})
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
@pytest.mark.parametrize("mode, says", [
    ("fewer", "shard 1's server (rank 1) ended without crossing epoch 2"),
    ("more", "shard 1's server (rank 1) crossed an epoch that shard 0 did not"),
])
def test_shards_that_disagree_on_epochs_end_the_job_with_one_line(mode, says):
    r = run_mpi(4, ["--", sys.executable, "-m", "tests.test_ps_shards_cuts", mode], timeout=90)
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if "hpcasync: error" in ln]
    assert lines and says in lines[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr

