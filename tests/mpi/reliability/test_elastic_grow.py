"""Grow back in ``hpcasync.elastic`` and ``hvd.elastic`` (issue 24 item 1): after a SIGKILLed
rank under ``mpirun --with-ft ulfm`` with ``HPCASYNC_GROW_BACK=1``, the survivors spawn a
replacement running the same script; it takes the dead rank's number and the survivors' state.

4 ranks, 384 images, batches of 16 (64 samples a step: 6 steps an epoch), commits every 2 steps
and at each epoch's end, 2 epochs. The killed rank dies before step 3, so the last commit is at
2 steps (128 samples); the survivors roll back, shrink to 3, grow to 4 and redo step 2.
Expected, on every rank: exit 0; 4 result files, rank r's written by the process at rank r at the
end, the replacement's in the dead rank's file (its number); the world back to 4; one reset
callback per rank, seeing 4 ranks (the survivors' after their reset, the replacement's at its
first attempt: ``resets == [4]``); 12 committed steps (the undisturbed count: 2 x 384 / 64);
executed: 13 on a survivor (step 2 redone), 10 on the replacement (steps 2..11); parameters
bitwise equal on the 4 ranks; and every commit window of both epochs on 4 ranks, each window
exactly its slice of the epoch's order, disjoint across ranks, chaining from 0 to 384 — each
sample of the epoch dealt exactly once, the dead rank's logged window and the replacement's
included.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from hpcasync.data.sharding import epoch_permutation
from tests.mpi.reliability.test_loop_elastic import _check_windows
from tests.mpi_util import REPO, clean_env, mpiexec, need_ulfm

LENGTH, BATCH, SEED, STEPS = 384, 16, 1, 12
pytestmark = pytest.mark.timeout(300)


def _run(tmp_path, script: str, kill_rank: int, extra=(), kill_at: int = 3):
    cmd = [*mpiexec(4, ft=True), sys.executable, str(REPO / "examples" / script),
           "--out", str(tmp_path), "--kill-rank", str(kill_rank), "--kill-at", str(kill_at),
           "--commit-every", "2", "--limit", str(LENGTH), "--batch-size", str(BATCH), *extra]
    return subprocess.run(cmd, env=clean_env(HPCASYNC_GROW_BACK="1", HPCASYNC_JOIN_TIMEOUT="120"),
                          cwd=REPO, capture_output=True, text=True, timeout=240)


def _check(tmp_path, out, killed: int, order, kill_at: int = 3, late: int = 0) -> None:
    """``late``: steps a survivor may run past the death before it sees it (OD-SGD: 1, when the
    dead rank's part of the round in flight had left before it died, the survivors' first failing
    wait is the next step's)."""
    assert out.returncode == 0, out.stderr[-3000:]
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(results) == [0, 1, 2, 3], out.stderr[-3000:]
    for r, res in results.items():
        assert res["rank"] == r and res["size"] == 4, (r, res)        # the dead rank's place
        assert res["joined"] == (r == killed), (r, res)
        assert res["resets"] == [4], (r, res)                          # one callback, grown world
        assert (res["steps"], res["epoch"]) == (STEPS, 2), (r, res)
        # the commit before the death is at an even step: the step after it is redone
        committed = kill_at - kill_at % 2
        if r == killed:
            assert res["executed"] == STEPS - committed, (r, res)
        else:
            assert 0 <= res["executed"] - (kill_at + STEPS - committed) <= late, (r, res)
    assert len({res["params"] for res in results.values()}) == 1, results
    chains = _check_windows(tmp_path, order)        # each sample of each epoch once
    for chain in chains.values():
        assert all(size == 4 for _, _, size in chain), chain
        assert chain[-1][1] == LENGTH, chain
    assert sorted(chains) == [0, 1], chains


@pytest.mark.rank0
@pytest.mark.parametrize("algorithm", ["ssgd", "odsgd", "ssgd-powersgd", "localsgd", "slowmo",
                                       "diloco"])
def test_own_loop_grows_back_after_rank0_dies(tmp_path, algorithm):
    """``examples/train_mnist_elastic.py``: rank 0 dies, so the replacement becomes rank 0 and
    the state comes from rank 1, the lowest survivor. OD-SGD (2 warm-up steps: rounds in
    flight at the death): the replacement's optimizer is built on its own launch's world and
    moved onto the grown one with the survivors' ``set_comm``; the replacement holds the
    survivors' global and local state after the sync (without it: the digest check's one-line
    error), and the global weights end bitwise equal on the 4 ranks. SSGD with PowerSGD
    (rank 1 after 2 plain steps): its state (step count, P, Q, the draw order) synced, each
    rank's error memory its own, left out of the digest check (a replacement's is zero).
    localsgd (2 SSGD steps, then an average after every second step: after steps 3, 5, ...;
    rank 0 dies before step 5, the survivors' commit after step 4 holds replicas that differ,
    and they see the death at step 5's average): the sync gives every rank the root's replica,
    equal again at the end. diloco (an outer step after every second step): rank 0 dies before
    step 5, the survivors run step 5 (local) and see the death at step 6's pseudo-gradient
    (late 1); the replacement takes the sync root's replica and outer state. slowmo (a sync
    after every second step): the same counts as diloco's, x0 and u from the sync root."""
    need_ulfm()
    powersgd = ["--powersgd-rank", "1"] if algorithm == "ssgd-powersgd" else []
    kill_at = 4 if algorithm in ("localsgd", "slowmo", "diloco") else 3
    out = _run(tmp_path, "train_mnist_elastic.py", 0,
               ["--algorithm", algorithm.split("-")[0], "--odsgd-warmup", "2", *powersgd],
               kill_at=kill_at)
    _check(tmp_path, out, 0,
           lambda e: epoch_permutation(LENGTH, seed=SEED, epoch=e).tolist(),
           kill_at=kill_at, late=1 if algorithm in ("odsgd", "slowmo", "diloco") else 0)
    assert "grow-back: joined as rank 0 of 4" in out.stderr, out.stderr[-3000:]


@pytest.mark.rank0
def test_own_daso_loop_grows_back_with_the_dead_ranks_node(tmp_path):
    """DASO (2 virtual nodes of 2 ranks; epoch 0 cycling, a global send only at its batch 0):
    rank 0 dies before step 5, the epoch's closing average, where every survivor fails; they
    hold the commit of step 4 inside the cycling epoch, average it over the 3 survivors, spawn
    a replacement that takes rank 0's place on node 0 (its DASO built on a topology of itself,
    moved onto the grown one), and sync it from rank 1. 4 ranks again; replicas bitwise equal;
    the replacement trains from that commit on with the survivors: 8 steps."""
    need_ulfm()
    out = _run(tmp_path, "train_mnist_elastic.py", 0,
               ["--algorithm", "daso", "--ranks-per-node", "2", "--daso-global-skip", "8"],
               kill_at=5)
    _check(tmp_path, out, 0, lambda e: epoch_permutation(LENGTH, seed=SEED, epoch=e).tolist(),
           kill_at=5)
    assert "grow-back: joined as rank 0 of 4" in out.stderr, out.stderr[-3000:]


def _horovod_order(epoch: int) -> list:
    """Horovod's ElasticSampler's order of an epoch (``random.Random(seed + epoch)``)."""
    order = list(range(LENGTH))
    random.Random(SEED + epoch).shuffle(order)
    return order


@pytest.mark.rank0
def test_horovod_elastic_script_grows_back_and_runs_the_reset_callbacks(tmp_path):
    """``examples/horovod_mnist_elastic.py`` (``hvd.elastic``): rank 2 dies; ``hvd.size()`` is
    4 again and every rank's reset callback ran once, with 4 ranks."""
    need_ulfm()
    out = _run(tmp_path, "horovod_mnist_elastic.py", 2)
    _check(tmp_path, out, 2, _horovod_order)


@pytest.mark.rank0
@pytest.mark.parametrize("practice", [["--zero-grad-after"], ["--clip-grad", "0.05"]],
                         ids=["zero-grad-after", "clip-grad"])
def test_a_loop_that_zeroes_after_step_redoes_the_interrupted_step_bitwise(tmp_path, practice):
    """``opt.zero_grad()`` after ``opt.step()`` (the other everyday order): rank 1 dies before
    step 3, the survivors fail inside step 3's reduction holding its gradients, roll back to the
    commit of step 2 and redo it on 4 ranks again. ``State.restore`` drops those gradients, so
    the run ends bitwise equal to the undisturbed one (kept, they added to the redone step's
    backward: another model on every rank, equal across ranks, silently). The same for
    Horovod's clipping pattern (``synchronize()``, ``clip_grad_norm_``, ``step()`` inside
    ``skip_synchronize()``; the survivors fail inside ``synchronize``)."""
    need_ulfm()
    runs = {}
    for name, kill_at in (("undisturbed", 99), ("killed", 3)):
        (tmp_path / name).mkdir()
        out = _run(tmp_path / name, "train_mnist_elastic.py", 1, practice, kill_at=kill_at)
        assert out.returncode == 0, out.stderr[-3000:]
        results = [json.loads(p.read_text()) for p in (tmp_path / name).glob("rank*.json")]
        assert len(results) == 4 and all(r["resets"] == ([4] if kill_at == 3 else [])
                                         for r in results), results
        runs[name] = {r["params"] for r in results}
    assert len(runs["killed"]) == 1 and runs["killed"] == runs["undisturbed"], runs


@pytest.mark.rank0
def test_a_grad_scaler_in_the_state_grows_back_bitwise_and_one_left_out_is_one_line(tmp_path):
    """SSGD with a GradScaler (Horovod's pattern), its scale growing every 2 steps: rank 1
    dies before step 5 and is grown back. Given to the ``State``, the scaler is synced to the
    replacement and rolled back with the commit: the run ends bitwise equal to the undisturbed
    one, the same scale on every rank. Left out, a replacement's scaler held its own initial
    scale: measured before, exit 0 with the replacement's parameters and scale unlike the
    survivors' (its scaled gradients weighed more in the average); now the first commit after a
    scaled step is one line (under grow-back)."""
    need_ulfm()
    script = str(REPO / "tests" / "amp_elastic_script.py")
    runs = {}
    for name, extra in (("undisturbed", []), ("killed", ["--kill-at", "5"]),
                        ("untracked", ["--kill-at", "5", "--untracked"])):
        (tmp_path / name).mkdir()
        out = subprocess.run([*mpiexec(4, ft=True), sys.executable, script, "--out",
                              str(tmp_path / name), *extra],
                             env=clean_env(HPCASYNC_GROW_BACK="1", HPCASYNC_JOIN_TIMEOUT="120"),
                             cwd=REPO, capture_output=True, text=True, timeout=240)
        if name == "untracked":
            lines = [x for x in out.stderr.splitlines() if x.startswith("hpcasync: error")]
            assert out.returncode != 0 and lines, out.stderr[-3000:]
            assert "a GradScaler steps the optimizer 'optimizer' and is not in the state" in \
                lines[0], lines
            continue
        assert out.returncode == 0, out.stderr[-3000:]
        results = [json.loads(p.read_text()) for p in (tmp_path / name).glob("r*.json")]
        assert len(results) == 4 and all(r["size"] == 4 for r in results), results
        runs[name] = {(r["params"], r["scale"]) for r in results}
    assert len(runs["killed"]) == 1 and runs["killed"] == runs["undisturbed"], runs

