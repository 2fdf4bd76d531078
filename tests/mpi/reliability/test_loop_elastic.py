"""``hpcasync.elastic`` (issue 23 item 5): a user's own SSGD loop (examples/train_mnist_elastic.py)
survives a SIGKILLed rank under ULFM and resumes the epoch's data where the survivors committed.

Under ``mpirun --with-ft ulfm -n 4`` rank 3 kills itself before step 3 (counted from 0; the
survivors block in that step's allreduce), rank 2 before step 9; commits every 2 steps and at
each epoch's end. 384 images, batches of 16. Expected: exit 0; two survivors at size 2, two
resets each (3, then 2 ranks); epoch 0 = 2 committed steps on 4 ranks (128 samples) + the other
256 dealt over 3 ranks = 5 steps (240; the last 16 are the epoch's tail); epoch 1 = 1 committed
step on 3 ranks (48) + 336 over 2 = 10 steps (320): 18 steps in the state, 20 executed (one step
redone after each rollback); replicas bitwise equal. Data: the indices each rank logged at each commit, the dead rank's
included, cover each epoch's order π_e (``ElasticSampler``) from 0 to its end exactly once.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict

import pytest
import torch

from hpcasync.data.sharding import epoch_permutation
from tests.mpi_util import REPO, clean_env, mpiexec, need_ulfm

SCRIPT = str(REPO / "examples" / "train_mnist_elastic.py")
LENGTH, BATCH, SEED = 384, 16, 1
pytestmark = pytest.mark.timeout(300)


def _run(tmp_path, *, ft: bool, n: int = 4, timeout: float = 240, kill_at=3, kill_rank=None,
         env=None, extra=()):
    kill_rank = n - 1 if kill_rank is None else kill_rank
    cmd = [*mpiexec(n, ft=ft), sys.executable, SCRIPT, "--out", str(tmp_path),
           f"--kill-rank={kill_rank}", f"--kill-at={kill_at}", "--commit-every", "2",
           "--limit", str(LENGTH), "--batch-size", str(BATCH), *extra]
    out = subprocess.run(cmd, env=clean_env(**(env or {})), cwd=REPO, capture_output=True, text=True,
                         timeout=timeout)
    return out


def _check_windows(tmp_path, order=None, *, partial=()) -> dict:
    """The commit windows of every rank: per epoch, a chain from 0 whose every link is trained by
    its world's ranks on disjoint indices that together are π_e[start:end] (``order(epoch)``,
    default the sampler's permutation of ``LENGTH``). Links in ``partial`` ((epoch, start,
    end)) were committed by some ranks only (DASO: the survivors adopted the commit of the ones
    that got further): their parts are disjoint shares of the slice. Returns
    ``{epoch: [(start, end, size), ...]}`` (also test_elastic_grow's)."""
    if order is None:
        def order(epoch):
            return epoch_permutation(LENGTH, seed=SEED, epoch=epoch).tolist()
    links = defaultdict(list)
    for f in tmp_path.glob("windows*.jsonl"):
        for line in f.read_text().splitlines():
            w = json.loads(line)
            if w["end"] > w["start"]:
                links[(w["epoch"], w["start"], w["end"], w["size"])].append(w["indices"])
    chains = defaultdict(list)
    for (epoch, start, end, size), parts in sorted(links.items()):
        flat = [i for p in parts for i in p]
        if (epoch, start, end) in partial:
            assert len(parts) < size and len(flat) == len(set(flat)), (epoch, start, end, size)
            assert set(flat) <= set(order(epoch)[start:end]), (epoch, start, end)
        else:
            assert len(parts) == size, (epoch, start, end, size, len(parts))
            assert len(flat) == len(set(flat)) == end - start, (epoch, start, end)
            assert sorted(flat) == sorted(order(epoch)[start:end]), (epoch, start, end)
        chains[epoch].append((start, end, size))
    for epoch, chain in chains.items():
        assert chain[0][0] == 0 and all(a[1] == b[0] for a, b in zip(chain, chain[1:])), chain
    return dict(chains)


@pytest.mark.rank0
def test_own_loop_survives_two_killed_ranks_and_resumes_the_data_under_ulfm(tmp_path):
    need_ulfm()
    out = _run(tmp_path, ft=True, kill_rank="3,2", kill_at="3,9")
    assert out.returncode == 0, out.stderr[-3000:]
    results = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(results) == ["rank0", "rank1"], out.stderr[-3000:]
    for r in results.values():
        assert (r["size"], r["resets"], r["epoch"]) == (2, [3, 2], 2), r
        assert (r["steps"], r["executed"]) == (18, 20), r
    assert len({r["params"] for r in results.values()}) == 1, results
    chains = _check_windows(tmp_path)
    # epoch 0: 128 samples on 4 ranks (rank 3's share logged before it died), then 3 ranks to
    # 368 (the tail of 16 < 3·16 is not trained); epoch 1: 48 on 3 ranks (rank 2's share
    # logged), then 2 ranks to 368
    assert chains[0][0] == (0, 128, 4) and {s for _, _, s in chains[0][1:]} == {3}, chains
    assert chains[1][0] == (0, 48, 3) and {s for _, _, s in chains[1][1:]} == {2}, chains
    assert chains[0][-1][1] == 368 and chains[1][-1][1] == 368, chains


@pytest.mark.rank0
def test_own_odsgd_loop_survives_a_killed_rank_under_ulfm(tmp_path):
    """OD-SGD in your own loop: rank 3 dies before step 3 (past the 2 warm-up steps, so rounds
    are in flight); the survivors roll back to the commit of step 2 (OD-SGD completes its round
    in flight at a commit), reset to 3 ranks (``set_comm`` drops the round on the revoked
    world), sync rank 0's state and go on. Exit 0; the global weights (after ``finish``) bitwise
    equal on every survivor; each epoch's data dealt from the commit exactly once."""
    need_ulfm()
    out = _run(tmp_path, ft=True, kill_at=3, extra=["--algorithm", "odsgd", "--odsgd-warmup", "2"])
    assert out.returncode == 0, out.stderr[-3000:]
    results = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(results) == ["rank0", "rank1", "rank2"], out.stderr[-3000:]
    for r in results.values():
        assert (r["size"], r["resets"], r["epoch"]) == (3, [3], 2), r
        assert r["executed"] > r["steps"], r             # what ran after the commit is redone
    assert len({r["params"] for r in results.values()}) == 1, results
    chains = _check_windows(tmp_path)
    assert chains[0][0] == (0, 128, 4) and {s for _, _, s in chains[0][1:]} == {3}, chains
    assert {s for _, _, s in chains[1]} == {3}, chains


@pytest.mark.rank0
@pytest.mark.parametrize("kill_rank,kill_at,commit_every,steps",
                         [(1, 3, 2, 14), (3, 5, 3, 15)], ids=["node-ahead", "same-commit"])
def test_own_daso_loop_survives_a_killed_rank_keeping_its_nodes_under_ulfm(
        tmp_path, kill_rank, kill_at, commit_every, steps):
    """DASO in your own loop: 2 virtual nodes of 2 ranks, epoch 0 cycling with a global send
    only at batch 0 (global_skip 8; 6 batches on 4 ranks), epoch 1 blocking.

    node-ahead (commits every 2 steps): rank 1 dies before step 3. Rank 0 (its node) fails at
    that step; node 1 never
    talks to node 0 until the epoch's closing average (batch 5), so it commits after step 4 and
    fails there. The survivors hold different commits: the sync root is the lowest survivor
    holding the most (rank 2), no average, and every survivor goes on from node 1's commit
    (128 + 128 samples on 4 ranks, node 0's share of the second window rolled back): 4 + 2 + 8
    steps.

    same-commit (commits every 3 steps): rank 3 dies before step 5 (the closing average):
    every survivor fails there and holds the commit of step 3, inside the cycling epoch where
    the nodes have drifted apart: the survivors average their restored states before the sync
    (every survivor holds the same parameters in its reset callback, which runs before the
    sync). The rest of the epoch, 192 samples over 3 ranks, is 4 batches: DASO recounts the
    epoch as 7 batches (its closing average at the new last one). 3 + 4 + 8 steps.

    Both: exit 0, 3 survivors, replicas bitwise equal, each epoch's data dealt once from the
    adopted commit on."""
    need_ulfm()
    out = _run(tmp_path, ft=True, kill_rank=kill_rank, kill_at=kill_at,
               extra=["--algorithm", "daso", "--ranks-per-node", "2", "--daso-global-skip", "8",
                      "--commit-every", str(commit_every)])
    assert out.returncode == 0, out.stderr[-3000:]
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(results) == sorted({0, 1, 2, 3} - {kill_rank}), out.stderr[-3000:]
    for r in results.values():
        assert (r["size"], r["resets"], r["epoch"], r["steps"]) == (3, [3], 2, steps), r
    assert len({r["params"] for r in results.values()}) == 1, results
    at_reset = {rank: r["reset_params"][0] for rank, r in results.items()}
    if kill_rank == 1:          # node 0 (rank 0) behind node 1: not averaged
        assert at_reset[0] != at_reset[2] == at_reset[3], at_reset
        chains = _check_windows(tmp_path, partial={(0, 128, 256)})
        assert chains[0][:2] == [(0, 128, 4), (128, 256, 4)], chains
        assert {s for _, _, s in chains[0][2:]} == {3} and chains[0][-1][1] == 352, chains
    else:
        assert len(set(at_reset.values())) == 1, at_reset
        chains = _check_windows(tmp_path)
        assert chains[0][0] == (0, 192, 4), chains
        assert {s for _, _, s in chains[0][1:]} == {3} and chains[0][-1][1] == LENGTH, chains
    assert {s for _, _, s in chains[1]} == {3} and chains[1][-1][1] == LENGTH, chains


@pytest.mark.rank0
def test_a_death_inside_the_reset_rebuilds_again_on_the_smaller_world(tmp_path):
    """Rank 3 dies before step 3; rank 2 dies inside the reset, after the shrink, before the
    rebuild (kill phase ``reset``): the rebuild's collectives fail on ranks 0 and 1, the
    agreement that ends the rebuild says so on both, and they shrink again and rebuild on 2 ranks
    — one reset of 2 attempts; the run ends with exit 0, equal replicas and the epoch's data
    dealt from the commit exactly once."""
    need_ulfm()
    out = _run(tmp_path, ft=True, kill_at=3, env={"HPCASYNC_INJECT_KILL_AT": "2:reset:1"})
    assert out.returncode == 0, out.stderr[-3000:]
    results = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(results) == ["rank0", "rank1"], out.stderr[-3000:]
    for r in results.values():
        assert (r["size"], r["resets"], r["epoch"]) == (2, [2], 2), r
        assert r["executed"] == r["steps"] + 1, r            # one step redone after the rollback
    assert len({r["params"] for r in results.values()}) == 1, results
    chains = _check_windows(tmp_path)
    assert chains[0][0] == (0, 128, 4) and {s for _, _, s in chains[0][1:]} == {2}, chains
    assert {s for _, _, s in chains[1]} == {2}, chains


@pytest.mark.rank0
def test_a_death_before_the_loop_began_is_survived_by_the_first_reset(tmp_path):
    """Rank 3 dies after loading its data, before ``hpcasync.optimizer``'s first broadcast (the
    window between ``hpcasync.init`` and ``train(state)``, where a random kill lands most
    often): the broadcast fails on the survivors, which revoke and go on
    (``runtime.elastic.defer_startup_failure``); the first ``state.sync()`` inside ``@run`` then
    fails on every survivor, they reset to 3 ranks and sync rank 0's state. The whole run is on
    3 ranks, nothing redone, replicas equal, each epoch's data dealt once."""
    need_ulfm()
    out = _run(tmp_path, ft=True, kill_at=-1)
    assert out.returncode == 0, out.stderr[-3000:]
    results = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(results) == ["rank0", "rank1", "rank2"], out.stderr[-3000:]
    for r in results.values():
        assert (r["size"], r["resets"], r["epoch"]) == (3, [3], 2), r
        assert r["executed"] == r["steps"], r
    assert len({r["params"] for r in results.values()}) == 1, results
    chains = _check_windows(tmp_path)
    assert {e: {s for _, _, s in c} for e, c in chains.items()} == {0: {3}, 1: {3}}, chains


@pytest.mark.rank0
def test_a_death_after_the_last_step_is_agreed_on_and_nothing_is_trained_again(tmp_path):
    """Rank 3 dies after the run's last step (12 = 6 steps of 64 samples per epoch), when every
    survivor's function returns: the agreement at the end of the attempt reports it, the
    survivors shrink (so that their exit, whose barrier would meet the dead rank, and any
    collective after ``train`` work) and call ``train`` again, which finds the loop done."""
    need_ulfm()
    out = _run(tmp_path, ft=True, kill_at=12)
    assert out.returncode == 0, out.stderr[-3000:]
    results = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(results) == ["rank0", "rank1", "rank2"], out.stderr[-3000:]
    for r in results.values():
        assert (r["size"], r["resets"], r["epoch"], r["steps"], r["executed"]) == \
            (3, [3], 2, 12, 12), r
    assert len({r["params"] for r in results.values()}) == 1, results
    chains = _check_windows(tmp_path)
    assert {e: (c[-1][1], {s for _, _, s in c}) for e, c in chains.items()} == \
        {0: (LENGTH, {4}), 1: (LENGTH, {4})}, chains


@pytest.mark.rank0
def test_own_loop_without_ulfm_ends_fast_on_a_death(tmp_path):
    out = _run(tmp_path, ft=False, n=2, timeout=120)
    ended = time.time()
    assert out.returncode != 0
    assert not list(tmp_path.glob("rank*.json"))          # no survivor finished
    took = ended - float((tmp_path / "killed").read_text())
    assert took < 30, f"the job ended {took:.1f} s after the death"
    assert out.stderr.count("hpcasync: error") <= 1, out.stderr[-3000:]


PS_BUDGET = 16          # pushes per worker: 2 epochs of 384 / 3 workers / batches of 16


def _ps_results(tmp_path, out, survivors, deaths=1):
    assert out.returncode == 0, out.stderr[-3000:]
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(results) == survivors, out.stderr[-3000:]
    assert len({r["params"] for r in results.values()}) == 1, results   # the server's final θ
    assert all(r["size"] == 4 - deaths and len(r["failures"]) == deaths
               for r in results.values()), results
    return results


@pytest.mark.rank0
@pytest.mark.parametrize("algorithm", ["asgd", "smega2", "shat"])
def test_own_ps_loop_survives_worker_deaths_at_set_up_and_in_training_under_ulfm(tmp_path,
                                                                                 algorithm):
    """A parameter-server rule in your own loop (rank 0 serves inside ``train``). Rank 2 dies
    after loading its data, before the server's set-up: the survivors' set-up fails, the
    optimizer stays unattached (``ParameterServer.attached``), the first ``state.sync()`` inside
    ``@run`` resets and the reset sets it up again on 3 ranks, rank 0 still serving. Then rank 3
    (a worker of the 3-rank world) dies before its step 5: the server retires it and the other
    worker never stops; at the end the survivors take the final model over the shrunk world
    (``ParameterServer.close``) and the front door moves onto them (``FaultTolerance.absorb``).
    Exit 0, the server's θ on both survivors, rank 1's whole budget and rank 3's 5 pushes
    served, one set-up record and one ``absorbed`` record, nothing rolled back after the set-up."""
    need_ulfm()
    out = _run(tmp_path, ft=True, kill_rank="2,3", kill_at="-1,5",
               extra=["--algorithm", algorithm])
    results = _ps_results(tmp_path, out, [0, 1], deaths=2)
    setup, absorbed = results[0]["failures"]
    assert (setup["dead_ranks"], setup["server"], setup["set_up_again"]) == ([2], 0, True), setup
    assert (absorbed["dead_ranks"], absorbed["survivors"], absorbed["absorbed"]) == \
        ([3], [0, 1], True), absorbed
    assert results[0]["served"] == PS_BUDGET + 5, results[0]
    assert results[1]["steps"] == PS_BUDGET and results[1]["resets"] == [3], results


def _check_takeover_buffers(dump) -> None:
    """The takeover's dumps (``ParameterServer.take_over``, the example's ``--batchnorm``
    layer): the new server's (shard 0's) buffers are the bitwise mean of the workers' rows in
    its table, each worker kept its own, and its ``num_batches_tracked`` is at least theirs."""
    [s] = [torch.load(f) for f in dump.glob("takeover-server-*.pt")]
    workers = {int(f.stem.rsplit("-", 1)[1]): torch.load(f)
               for f in dump.glob("takeover-worker-*.pt")}
    assert sorted(workers) == s["worker_ranks"], (sorted(workers), s["worker_ranks"])
    rows = torch.stack([s["survivors"][r] for r in s["worker_ranks"]])
    assert torch.equal(s["model"], rows.mean(0))
    counts = []
    for r, w in workers.items():                       # each worker keeps its own
        assert torch.equal(w["model"], s["survivors"][r]), r
        counts.append(int(w["ints"]["1.num_batches_tracked"]))
    assert int(s["ints"]["1.num_batches_tracked"]) >= max(counts), (s["ints"], counts)


@pytest.mark.rank0
@pytest.mark.parametrize("algorithm", ["asgd", "smega2", "shat"])
def test_own_ps_loop_takes_over_a_dead_server_under_ulfm(tmp_path, algorithm):
    """The server (rank 0) dies after its 20th served push: every worker's step fails, the
    workers roll back to their last commits and reset; the survivor holding the newest reply
    (version 20: the last one the dead server sent) serves from it with a fresh rule whose clock
    starts at each worker's committed pushes (``ParameterServer.take_over``; the failure
    record's ``worker_positions``); the other two go on from their commits. Exit 0, the new
    server's θ on every survivor, each remaining worker's whole budget served (the pushes before
    its commit counted, the ones after redone). A BatchNorm layer: right after the takeover the
    new server's buffers are the bitwise mean of the two workers' (their committed ones, each
    worker keeping its own; ``load_theta``'s mean), not its own as a worker, and its
    ``num_batches_tracked`` at least their max."""
    need_ulfm()
    dump = tmp_path / "dump"
    out = _run(tmp_path, ft=True, kill_rank="", kill_at="",
               extra=["--algorithm", algorithm, "--batchnorm"],
               env={"HPCASYNC_INJECT_KILL": "0:20", "HPCASYNC_DUMP_BUFFERS": str(dump)})
    results = _ps_results(tmp_path, out, [1, 2, 3])
    _check_takeover_buffers(dump)
    record = results[1]["failures"][0]
    assert record["dead_ranks"] == [0] and record["server_version"] == 20, record
    server = record["server"]
    assert results[server]["served"] == 2 * PS_BUDGET, results[server]
    assert all(r["steps"] == PS_BUDGET and r["resets"] == [3]
               for rank, r in results.items() if rank != server), results
    # the record names where the new server's clock starts each worker: its committed pushes
    assert dict(record["worker_positions"]) == {
        rank: r["reset_steps"][0] for rank, r in results.items() if rank != server}, record
    checked = 0
    for rank, r in results.items():     # SHAT: each worker goes on from its committed local model
        if rank == server:
            continue
        if algorithm != "shat":
            assert r["reset_local"] == [None], (rank, r)
            continue
        commits = [json.loads(line) for line in
                   (tmp_path / f"windows{rank}.jsonl").read_text().splitlines()]
        committed = [c["params"] for c in commits if c["resets"] == 0]
        # (a worker that starts late, under load, may not commit before the death: its restore
        # is the State's first commit, whose digest the example does not write)
        if committed:
            assert r["reset_local"] == [committed[-1]], (rank, r)
            checked += 1
    assert checked or algorithm != "shat", results


@pytest.mark.rank0
def test_own_ps_loop_sets_the_server_up_on_the_lowest_survivor_after_its_death_at_set_up(
        tmp_path):
    """The server (rank 0) dies before the set-up: the reset sets it up on the lowest survivor
    (every copy of θ is the initial one). Exit 0, its θ everywhere, 2 × 16 pushes served."""
    need_ulfm()
    out = _run(tmp_path, ft=True, kill_rank=0, kill_at=-1, extra=["--algorithm", "smega2"])
    results = _ps_results(tmp_path, out, [1, 2, 3])
    record = results[1]["failures"][0]
    assert (record["dead_ranks"], record["server"], record["set_up_again"]) == ([0], 1, True), \
        record
    assert results[1]["served"] == 2 * PS_BUDGET, results[1]


@pytest.mark.rank0
@pytest.mark.parametrize("algorithm,killed", [("asgd", 1), ("smega2", 0)])
def test_own_ps_loop_takes_over_a_dead_shard_server_under_ulfm(tmp_path, algorithm, killed):
    """Two shard servers (``ps_ranks=2``: ranks 0 and 1), two workers. Shard server ``killed``
    dies after its 20th served push: the workers' steps fail and they revoke every shard's
    communicator, so the other server's loop fails too; the survivors roll back (the surviving
    server keeps what it served: ``State.restore``) and reset. The surviving server serves shard
    0; worker 2 takes the dead one's place; shard 0's slice comes from the surviving server's θ
    or the newest reply, shard 1's likewise (``shard_sources``); the clock starts at the
    remaining worker's committed pushes. Exit 0, one θ on the 3 survivors, the remaining worker's
    whole budget (2 epochs of 384 / 2 workers / 16) pushed and counted by shard 0's server;
    shard 0's server's BatchNorm buffers are the remaining worker's (its table's one row)."""
    need_ulfm()
    dump = tmp_path / "dump"
    out = _run(tmp_path, ft=True, kill_rank="", kill_at="",
               extra=["--algorithm", algorithm, "--ps-ranks", "2", "--batchnorm"],
               env={"HPCASYNC_INJECT_KILL_AT": f"{killed}:served:20",
                    "HPCASYNC_DUMP_BUFFERS": str(dump)})
    results = _ps_results(tmp_path, out, sorted({0, 1, 2, 3} - {killed}))
    _check_takeover_buffers(dump)
    record = results[3]["failures"][0]
    survivor = 1 - killed
    assert (record["dead_ranks"], record["server"]) == ([killed], survivor), record
    sources = record["shard_sources"]         # the old shards: the dead one's from a reply
    assert (sources[survivor]["rank"], sources[survivor]["from"]) == (survivor, "server"), record
    assert sources[survivor]["version"] >= 10, record      # what it served, not rolled back
    assert sources[killed]["rank"] in (2, 3) and sources[killed]["from"] == "reply", record
    budget = 2 * (LENGTH // 2 // BATCH)
    assert results[3]["steps"] == budget and results[survivor]["served"] == budget, results
    assert results[2]["served"] == budget, results     # worker 2 serves the dead one's shard


@pytest.mark.rank0
@pytest.mark.parametrize("algorithm,phase", [("asgd", "takeover"), ("shat", "adopt"),
                                             ("asgd", "attach")])
def test_a_death_inside_the_own_loops_takeover_runs_it_again_on_the_survivors(tmp_path,
                                                                              algorithm, phase):
    """The server (rank 0) dies after its 20th served push, then a second rank inside the
    takeover: ``takeover``: rank 2 between the election's allgather and the rebuild; ``adopt``:
    the elected server, before its first broadcast; ``attach``: rank 3 after the set-up's first
    broadcast, while the windows are made (its second set-up: the first is the constructor's).
    The reset's attempt fails everywhere and
    runs again on the two survivors from what each held before it (``ParameterServer.holding``):
    one of them serves, the other pushes its whole budget. Exit 0, one θ, two attempts."""
    need_ulfm()
    kill = ("2:takeover:1" if phase == "takeover" else "3:attach:2" if phase == "attach" else
            ",".join(f"{r}:adopt:1" for r in (1, 2, 3)))      # (fired on the new server only)
    out = _run(tmp_path, ft=True, kill_rank="", kill_at="", extra=["--algorithm", algorithm],
               env={"HPCASYNC_INJECT_KILL": "0:20", "HPCASYNC_INJECT_KILL_AT": kill})
    assert out.returncode == 0, out.stderr[-3000:]
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert len(results) == 2 and len({r["params"] for r in results.values()}) == 1, results
    record = next(iter(results.values()))["failures"][0]
    assert record["attempts"] == 2 and len(record["dead_ranks"]) == 2, record
    killed = {"takeover": 2, "attach": 3}.get(phase)
    assert 0 in record["dead_ranks"] and killed in (None, *record["dead_ranks"]), record
    server = record["server"]
    worker = next(r for r in results if r != server)
    assert results[server]["served"] == PS_BUDGET and results[worker]["steps"] == PS_BUDGET, \
        results


@pytest.mark.rank0
def test_a_death_inside_a_shard_takeovers_window_set_up_runs_it_again(tmp_path):
    """Two shard servers (ranks 0 and 1), three workers, 5 ranks. Shard server 1 dies after its
    20th served push; in the takeover's set-up (worker 2 elected to serve shard 1), worker 4
    dies after the set-up's first broadcast, while the windows are made (its second ``attach``).
    The reset's attempt fails everywhere and runs again on ranks 0, 2, 3 from what each held
    before it: 0 and 2 serve the two shards, 3 pushes its whole budget. Exit 0, one θ on the
    three, one failure record with two attempts and both deaths."""
    need_ulfm()
    out = _run(tmp_path, ft=True, n=5, kill_rank="", kill_at="",
               extra=["--algorithm", "asgd", "--ps-ranks", "2"],
               env={"HPCASYNC_INJECT_KILL_AT": "1:served:20,4:attach:2"})
    assert out.returncode == 0, out.stderr[-3000:]
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(results) == [0, 2, 3], out.stderr[-3000:]
    assert len({r["params"] for r in results.values()}) == 1, results
    assert all(r["size"] == 3 and len(r["failures"]) == 1 for r in results.values()), results
    record = results[3]["failures"][0]
    assert record["attempts"] == 2 and sorted(record["dead_ranks"]) == [1, 4], record
    assert record["server"] == 0, record
    assert results[3]["steps"] == 2 * (LENGTH // 3 // BATCH), results


REFUSE = """
import torch, hpcasync
ctx = hpcasync.init("asgd", ps_ranks=2)
model = torch.nn.Linear(4, 2)
opt = hpcasync.optimizer("asgd", model, lr=0.1)
hpcasync.elastic.State(model=model, optimizer=opt, epoch=0)
print("unreachable", flush=True)
"""


@pytest.mark.rank0
def test_grow_back_of_shard_servers_in_the_own_loop_is_refused_at_state_construction(tmp_path):
    need_ulfm()
    script = tmp_path / "refuse.py"
    script.write_text(REFUSE)
    out = subprocess.run([*mpiexec(3, ft=True), sys.executable, str(script)],
                         env=clean_env(HPCASYNC_GROW_BACK="1"), cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "unreachable" not in out.stdout
    lines = [ln for ln in out.stderr.splitlines() if "hpcasync: error" in ln]
    assert len(lines) == 1 and "grow-back of asgd with shard servers" in lines[0], \
        out.stderr[-2000:]


@pytest.mark.rank0
@pytest.mark.parametrize("algorithm", ["asgd", "smega2", "shat"])
def test_own_ps_loop_grows_back_a_dead_worker_from_its_last_commit_under_ulfm(tmp_path,
                                                                               algorithm):
    """``HPCASYNC_GROW_BACK=1``: worker rank 3 dies before its step 5 (5 pushes served; commits
    every 2 steps, each sent to the server too, the one at 4 steps counted in the header of the
    5th push). The server spawns a replacement, stops every worker after its current push, the
    survivors absorb the death and take the replacement in at rank 3 (worker 2's place); it
    resumes from the dead worker's commit at 4 steps (its epoch, batch, step count, sampler
    position) and trains the rest of that shard; the others go on without a rollback. Exit 0,
    4 ranks at the end, the server's θ on all, one ``absorbed`` record and one join, the
    replacement with 16 steps of which 12 executed, every survivor its 16, and 3 x 16 + 1
    pushes served (the dead worker's 5th push, after its last commit, is redone). An LR
    scheduler stepped by every worker goes on on the replacement from that commit too."""
    need_ulfm()
    out = _run(tmp_path, ft=True, kill_rank=3, kill_at=5,
               extra=["--algorithm", algorithm, "--lr-decay", "0.99"],
               env={"HPCASYNC_GROW_BACK": "1", "HPCASYNC_JOIN_TIMEOUT": "120"})
    assert out.returncode == 0, out.stderr[-3000:]
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(results) == [0, 1, 2, 3], out.stderr[-3000:]
    assert len({r["params"] for r in results.values()}) == 1, results      # the server's final θ
    # the LR scheduler: the replacement's from the dead worker's commit (4 steps), then its 12
    assert all(results[r]["scheduler_steps"] == PS_BUDGET for r in (1, 2, 3)), results
    assert all(r["size"] == 4 and r["resets"] == [4] and r["joined"] == (rank == 3)
               for rank, r in results.items()), results
    for rank in (0, 1, 2):
        failure, = results[rank]["failures"]
        assert (failure["dead_ranks"], failure["absorbed"]) == ([3], True), failure
        join, = results[rank]["joins"]
        assert join["ranks"] == [3] and join["world_size"] == 4, join
    assert (results[3]["steps"], results[3]["executed"], results[3]["epoch"]) == \
        (PS_BUDGET, PS_BUDGET - 4, 2), results[3]
    assert all(results[r]["steps"] == results[r]["executed"] == PS_BUDGET for r in (1, 2)), \
        results
    assert results[0]["served"] == 3 * PS_BUDGET + 1, results[0]


@pytest.mark.rank0
@pytest.mark.parametrize("algorithm", ["asgd", "shat"])
def test_own_ps_loop_grows_back_a_dead_server_into_the_new_servers_worker_place(tmp_path,
                                                                                algorithm):
    """``HPCASYNC_GROW_BACK=1``: the server (rank 0) dies after its 20th served push. The
    survivors take it over (the worker with the newest reply serves), and the reset grows back:
    a replacement at rank 0 takes the new server's former worker place, from the new server's
    last commit (its step count, its sampler's position and shard, its LR scheduler), while the
    other two go on from theirs. Exit 0, 4 ranks, one θ, 3 x 16 pushes served (each worker's
    budget, the pushes before its commit counted), every worker 16 steps and 16 scheduler
    steps, the replacement having executed 16 minus the new server's committed steps, and every
    sample of each epoch in exactly one worker's committed batches."""
    need_ulfm()
    out = _run(tmp_path, ft=True, kill_rank="", kill_at="",
               extra=["--algorithm", algorithm, "--lr-decay", "0.99"],
               env={"HPCASYNC_INJECT_KILL": "0:20", "HPCASYNC_GROW_BACK": "1",
                    "HPCASYNC_JOIN_TIMEOUT": "120"})
    assert out.returncode == 0, out.stderr[-3000:]
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(results) == [0, 1, 2, 3], out.stderr[-3000:]
    assert len({r["params"] for r in results.values()}) == 1, results
    assert all(r["size"] == 4 and r["joined"] == (rank == 0) for rank, r in results.items())
    record = results[1]["failures"][0]
    server = record["server"]
    assert record["dead_ranks"] == [0] and record["server_version"] == 20, record
    assert results[server]["joins"][0]["ranks"] == [0], results[server]
    assert results[server]["served"] == 3 * PS_BUDGET, results[server]
    workers = [r for r in results if r != server]
    assert all(results[r]["steps"] == results[r]["scheduler_steps"] == PS_BUDGET
               for r in workers), results
    committed = results[server]["reset_steps"][-1]      # the new server's last commit
    assert 0 < results[0]["executed"] == PS_BUDGET - committed, (committed, results[0])
    # the replacement dealt the new server's shard: every sample of each epoch committed once
    for epoch in range(2):
        flat = [i for f in tmp_path.glob("windows*.jsonl") for line in f.read_text().splitlines()
                for i in json.loads(line)["indices"] if json.loads(line)["epoch"] == epoch]
        assert sorted(flat) == list(range(LENGTH)), (epoch, len(flat), len(set(flat)))


@pytest.mark.rank0
def test_own_ps_loop_grows_back_a_server_dead_at_set_up_with_a_worker_in_its_place(tmp_path):
    """``HPCASYNC_GROW_BACK=1``, smega2: the server (rank 0) dies before the set-up. The reset
    sets the server up on the lowest survivor (rank 1) and grows back in it (every survivor
    spawns): the replacement takes rank 0 as a worker, dealt the shard rank 1 left (worker index
    0), and trains it from the start. Exit 0, 4 ranks, one θ, rank 1 served 3 x 16 pushes,
    every worker its 16 steps, the replacement's included."""
    need_ulfm()
    out = _run(tmp_path, ft=True, kill_rank=0, kill_at=-1, extra=["--algorithm", "smega2"],
               env={"HPCASYNC_GROW_BACK": "1", "HPCASYNC_JOIN_TIMEOUT": "120"})
    assert out.returncode == 0, out.stderr[-3000:]
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(results) == [0, 1, 2, 3], out.stderr[-3000:]
    assert len({r["params"] for r in results.values()}) == 1, results
    assert all(r["size"] == 4 and r["joined"] == (rank == 0) for rank, r in results.items())
    failure, = results[1]["failures"]
    assert (failure["dead_ranks"], failure["server"], failure["set_up_again"]) == ([0], 1, True)
    assert results[1]["joins"][0]["ranks"] == [0], results[1]
    assert results[1]["served"] == 3 * PS_BUDGET, results[1]
    assert all(results[r]["steps"] == results[r]["executed"] == PS_BUDGET for r in (0, 2, 3))
