"""A takeover rebuilds θ from what the survivors hold (a real SIGKILL, ``mpirun --with-ft ulfm``),
never from the initial weights (``ps.takeover.take_over``):

* The new parameter server dies while it is being set up: the takeover runs again on the
  survivors from the freshest of their latest replies, at the budget position the first takeover
  agreed (``again=True``). SHAT's workers keep their own local models across both takeovers (the
  new server's leaves the ensemble, one warning line). The first adopter, whichever rank it is,
  is killed by ``HPCASYNC_INJECT_KILL_AT=R:adopt:1`` for every R (every survivor counts the phase,
  it fires on the new server only).
* A shard server dies (``--ps-ranks 2``): its slice is rebuilt from the workers' freshest reply
  for that shard, the other slice is its surviving server's θ, a worker serves the lost shard.

θ is read through the testing hook ``HPCASYNC_DUMP_BUFFERS=DIR``.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hpcasync.metrics import read_metrics
from hpcasync.models import build_model
from hpcasync.ps.shards import shard_bounds
from tests.mpi_util import REPO, clean_env, last_summary, mpiexec, need_ulfm

TRAIN = 3000
ARGS = ["train", "--dataset", "fashion-mnist-mini", "--train-limit", str(TRAIN), "--test-limit",
        "500", "--epochs", "1", "--progress", "off"]


def _initial_theta() -> torch.Tensor:
    torch.manual_seed(0)                                 # make_model's (the default seed)
    model = build_model("lenet", (1, 28, 28), 10)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def _train(tmp_path, algorithm: str, *extra: str, ranks: int = 4, timeout: int = 120, **env):
    """``hpcasync train`` of ``algorithm`` on ``ranks`` ranks under ULFM with ``env`` (the kills,
    the dump directory); returns the finished process and its metrics file."""
    metrics = tmp_path / "m.jsonl"
    out = subprocess.run([*mpiexec(ranks, ft=True), sys.executable, "-m", "hpcasync.cli", *ARGS,
                          "--algorithm", algorithm, *extra, "--metrics", str(metrics)],
                         env=clean_env(**env), cwd=REPO, capture_output=True, text=True,
                         timeout=timeout)
    return out, metrics


@pytest.mark.rank0
def test_the_new_server_dies_in_its_set_up_and_the_next_one_goes_on_from_the_workers_theta(
        tmp_path):
    """The server (rank 0) dies at its 40th accepted push (of 3 x 31); the rank that takes over
    dies before its first broadcast. The two survivors take over again: the second adopter's
    model is bitwise the freshest of their latest replies (version > 0, not the initial θ), the
    budget position is the first takeover's; the remaining worker goes on from its own local
    model (bitwise, not the new server's θ); the run ends with exit 0 above 35 % accuracy (46 %
    measured, 30 % when the second adopter restarted from the initial θ)."""
    need_ulfm()
    dump = tmp_path / "dump"
    out, metrics = _train(tmp_path, "shat", HPCASYNC_INJECT_KILL="0:40",
                          HPCASYNC_INJECT_KILL_AT="1:adopt:1,2:adopt:1,3:adopt:1",
                          HPCASYNC_DUMP_BUFFERS=str(dump))
    assert out.returncode == 0, out.stderr[-3000:]
    s = last_summary(metrics)
    first, second = s["server_failures"]
    assert first["dead_ranks"] == [0] and first["phase"] == "training"
    assert second["dead_ranks"] == [first["new_server"]] and second["phase"] == "setup"
    assert second["workers"] == 1 and second["share_done"] == first["share_done"]
    survivors = sorted({1, 2, 3} - {first["new_server"]})
    replies = {r: torch.load(dump / f"takeover2-reply-{r}.pt") for r in survivors}
    freshest = max(survivors, key=lambda r: (replies[r]["version"], -r))
    assert second["new_server"] == freshest and replies[freshest]["version"] > 0
    adopted = torch.load(dump / f"adopted2-{freshest}.pt")["theta"]
    assert torch.equal(adopted, replies[freshest]["theta"])
    assert not torch.equal(adopted, _initial_theta())
    [worker] = [r for r in survivors if r != freshest]   # SHAT: its own model, not θ
    resumed = torch.load(dump / f"resumed2-{worker}.pt")["local"]
    assert torch.equal(resumed, replies[worker]["local"]) and not torch.equal(resumed, adopted)
    assert out.stderr.count("shat: every worker keeps its local model") == 2
    assert [r["event"] for r in read_metrics(metrics)].count("server_failed") == 2
    assert s["test_accuracy"] > 0.35, s["test_accuracy"]


@pytest.mark.rank0
def test_a_death_after_the_set_ups_broadcast_keeps_each_shat_workers_local_model(tmp_path):
    """The server (rank 0) dies at its 40th accepted push; rank 3 dies in the takeover's set-up
    after its first broadcast (``attach``, its second set-up), which has overwritten the other
    survivors' models with the new server's θ. The takeover runs again; the remaining SHAT
    worker goes on from its own local model as it was at the first takeover (bitwise), not from
    the broadcast's θ. (It went on from the broadcast's θ while the run's optimizer, set up
    again in place, gave its model as the local one.)"""
    need_ulfm()
    dump = tmp_path / "dump"
    out, metrics = _train(tmp_path, "shat", HPCASYNC_INJECT_KILL="0:40",
                          HPCASYNC_INJECT_KILL_AT="3:attach:2", HPCASYNC_DUMP_BUFFERS=str(dump))
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = last_summary(metrics)["server_failures"]
    assert second["phase"] == "setup" and 3 in first["dead_ranks"] + second["dead_ranks"]
    resumed = sorted(dump.glob("resumed2-*.pt"))
    assert len(resumed) == 1, sorted(p.name for p in dump.iterdir())
    worker = int(resumed[0].stem.split("-")[1])
    local = torch.load(resumed[0])["local"]
    assert torch.equal(local, torch.load(dump / f"takeover1-reply-{worker}.pt")["local"])
    assert not torch.equal(local, torch.load(dump / f"adopted2-{second['new_server']}.pt")["theta"])


@pytest.mark.rank0
def test_a_shard_servers_death_rebuilds_its_slice_from_the_freshest_reply(tmp_path):
    """``--ps-ranks 2`` on 4 ranks (servers 0 and 1, workers 2 and 3): shard 1's server dies at
    its 40th accepted push; shard 0's server, waiting on its revoked communicator, joins. The new
    servers start from θ whose shard-1 slice is bitwise the workers' freshest reply for shard 1
    and whose shard-0 slice is bitwise server 0's θ; worker rank 2 serves shard 1, the run ends
    with exit 0 above 35 % accuracy (50 % measured). (Shard 0's death — the follower sees the
    orderer die, the metrics move to rank 1 — passed the same checks by hand: one run is this
    test's CI budget.)"""
    need_ulfm()
    dead = 1
    dump = tmp_path / "dump"
    out, metrics = _train(tmp_path, "asgd", "--ps-ranks", "2", HPCASYNC_INJECT_KILL=f"{dead}:40",
                          HPCASYNC_DUMP_BUFFERS=str(dump))
    assert out.returncode == 0, out.stderr[-3000:]
    s = last_summary(metrics)
    [f] = s["server_failures"]
    alive = 1 - dead
    assert f["dead_ranks"] == [dead] and f["new_server"] == alive and f["workers"] == 1
    held = {r: torch.load(dump / f"takeover1-reply-{r}.pt") for r in (alive, 2, 3)}
    freshest = max((2, 3), key=lambda r: (held[r]["versions"][dead], -r))
    assert held[freshest]["versions"][dead] > 0
    assert f["shard_sources"][dead] == {"rank": freshest, "from": "reply",
                                        "version": held[freshest]["versions"][dead]}
    assert f["shard_sources"][alive]["rank"] == alive
    theta = torch.load(dump / f"adopted1-{alive}.pt")["theta"]
    (lo0, hi0), (lo1, hi1) = shard_bounds(theta.numel(), 2)
    lost, kept = ((lo0, hi0), (lo1, hi1)) if dead == 0 else ((lo1, hi1), (lo0, hi0))
    assert torch.equal(theta[lost[0]:lost[1]], held[freshest]["theta"][lost[0]:lost[1]])
    assert torch.equal(theta[kept[0]:kept[1]], held[alive]["server_theta"])
    assert not torch.equal(theta, _initial_theta())
    assert s["test_accuracy"] > 0.35, s["test_accuracy"]


@pytest.mark.rank0
def test_a_death_inside_the_takeovers_exchange_redoes_it_on_every_survivor(tmp_path):
    """The server (rank 0) dies at its 40th accepted push; rank 3 dies inside the takeover, after
    the survivors' allgather and before the gathers to the new server (kill phase ``takeover``).
    A gather can then complete on its senders and fail on its root: the survivors agree
    (``MPI_Comm_agree``) that the exchange did not complete everywhere, shrink again and redo it.
    One takeover record names both dead ranks; the last two ranks (a server and a worker) finish
    with exit 0 above 35 % accuracy."""
    need_ulfm()
    out, metrics = _train(tmp_path, "asgd", timeout=90, HPCASYNC_INJECT_KILL="0:40",
                          HPCASYNC_INJECT_KILL_AT="3:takeover:1")
    assert out.returncode == 0, out.stderr[-3000:]
    s = last_summary(metrics)
    [f] = s["server_failures"]
    assert f["dead_ranks"] == [0, 3] and f["workers"] == 1 and f["new_server"] in (1, 2), f
    assert "the parameter server (rank(s) 0), and rank(s) 3 during the takeover, died" in out.stderr
    assert s["test_accuracy"] > 0.35, s["test_accuracy"]


@pytest.mark.rank0
def test_the_new_shard_server_dies_in_its_set_up_and_a_worker_serves_both_shards(tmp_path):
    """``--ps-ranks 2`` on 5 ranks (servers 0 and 1, workers 2-4): shard 1's server dies at its
    60th accepted push; the takeover makes rank 0 serve shard 0 and the first worker shard 1.
    Rank 0 then dies in that set-up, after its first broadcast (``attach``, its second set-up):
    the takeover runs again on the three survivors, every slice from the workers' replies (no
    server survived), at the first takeover's share of the budget, and the last worker trains
    the rest of its budget exactly (one ``setup`` record after the ``training`` one)."""
    need_ulfm()
    out, metrics = _train(tmp_path, "asgd", "--ps-ranks", "2", ranks=5,
                          HPCASYNC_INJECT_KILL="1:60", HPCASYNC_INJECT_KILL_AT="0:attach:2")
    assert out.returncode == 0, out.stderr[-3000:]
    s = last_summary(metrics)
    first, second = s["server_failures"]
    assert (first["dead_ranks"], first["phase"], first["workers"]) == ([1], "training", 2), first
    assert first["new_server"] == 0
    assert (second["dead_ranks"], second["phase"], second["workers"]) == ([0], "setup", 1), second
    assert second["share_done"] == first["share_done"] and second["new_server"] in (2, 3, 4)
    assert [x["from"] for x in second["shard_sources"]] == ["reply", "reply"], second
    budget = TRAIN // 32                     # the last worker's: every example, one epoch
    assert s["num_workers"] == 1 and s["pushes_per_worker"] == [budget], s["pushes_per_worker"]
    assert [w["worker_start_step"] for w in s["workers"]] == [int(first["share_done"] * budget)]
    assert s["rejected_pushes"] == 0 and s["test_accuracy"] > 0.35, s["test_accuracy"]
