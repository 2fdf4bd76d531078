"""``hvd.elastic`` (issue 22): a Horovod elastic script (tests/horovod_elastic_script.py) survives
a SIGKILLed rank under ULFM; without ULFM (2 ranks) the death ends the job within 30 s.

Under ``mpirun --with-ft ulfm -n 4`` rank 3 kills itself before step 3 (the survivors block in that
step's allreduce, which nobody completes); the last commit was after step 2 (``--commit-every 2``).
Expected: exit 0; three survivors, each with one reset to size 3; 16 steps in the state (epoch 0:
2 steps on 4 ranks = 128 samples, the other 256 on 3 ranks = 6 steps; epoch 1: 384 on 3 = 8),
17 executed (step 2 is redone: the rollback to the commit, nothing else); replicas bitwise equal.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.mpi_util import REPO, clean_env, mpiexec, need_ulfm

SCRIPT = str(REPO / "tests" / "horovod_elastic_script.py")
pytestmark = pytest.mark.timeout(300)


def _run(tmp_path, *, ft: bool, n: int = 4, timeout: float = 240):
    cmd = [*mpiexec(n, ft=ft), sys.executable, SCRIPT, "--out", str(tmp_path),
           "--kill-rank", str(n - 1), "--kill-at", "3", "--commit-every", "2"]
    t0 = time.time()
    out = subprocess.run(cmd, env=clean_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=timeout)
    return out, time.time() - t0


@pytest.mark.rank0
def test_elastic_script_survives_a_killed_rank_under_ulfm(tmp_path):
    need_ulfm()
    out, _ = _run(tmp_path, ft=True)
    assert out.returncode == 0, out.stderr[-3000:]
    results = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(results) == ["rank0", "rank1", "rank2"], out.stderr[-3000:]
    for r in results.values():
        assert (r["size"], r["resets"], r["epoch"]) == (3, [3], 1), r
        assert (r["steps"], r["executed"]) == (16, 17), r
    assert len({r["params"] for r in results.values()}) == 1, results


@pytest.mark.rank0
def test_elastic_script_without_ulfm_ends_fast_on_a_death(tmp_path):
    out, _ = _run(tmp_path, ft=False, n=2, timeout=120)
    ended = time.time()
    assert out.returncode != 0
    assert not list(tmp_path.glob("rank*.json"))          # no survivor finished
    took = ended - float((tmp_path / "killed").read_text())
    assert took < 30, f"the job ended {took:.1f} s after the death"


@pytest.mark.rank0
@pytest.mark.parametrize("ours", [["--algorithm", "localsgd"], ["--algorithm", "odsgd"],
                                  ["--compress", "powersgd"]])
def test_elastic_script_with_the_toolkits_optimizer_is_one_line_before_training(tmp_path, ours):
    """``hvd.elastic`` resets Horovod's SSGD (the facade's DistributedOptimizer); with the
    toolkit's own optimizer (``algorithm=`` or ``compress=``) a reset would leave it on the dead
    world (found: under ULFM the survivors reset and failed again forever). So ``train(state)``
    stops before training, one line naming the algorithm and ``hpcasync.elastic``; exit 2, no
    Traceback, no step taken. (Planted: the check out -> the ULFM run never ends.)"""
    out = subprocess.run([*mpiexec(2), sys.executable, SCRIPT, "--out", str(tmp_path), *ours],
                         env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=90)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [x for x in out.stderr.splitlines() if x.startswith("hpcasync: error")]
    name = ours[1] if ours[0] == "--algorithm" else "ssgd"
    assert len(lines) == 1 and f"hvd.elastic resets Horovod's SSGD only; this job's optimizer " \
        f"is hpcasync's {name}" in lines[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and not list(tmp_path.glob("rank*.json"))
