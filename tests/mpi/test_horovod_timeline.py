"""The Horovod timeline (issue 22, item 5): ``HOROVOD_TIMELINE=file.json`` and
``hvd.start_timeline`` / ``hvd.stop_timeline`` write, on rank 0, the Chrome-trace JSON Horovod
writes — one row per tensor, B/E phases in µs — for every facade collective. Run under
``mpiexec -n 2``, ``-n 3`` or ``-n 4``."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

import hpcasync.horovod as fh
from hpcasync.horovod import timeline
from tests.mpi_util import COMM, RANK, clean_env, idle_barrier, mpiexec

pytestmark = pytest.mark.timeout(180)


def check_trace(path) -> dict:
    """Load a timeline and check it is valid Chrome trace; returns {row name: [phase, ...]}
    (the B events of each row, in order)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    assert isinstance(events, list) and events
    names, phases, stacks, last = {}, defaultdict(list), defaultdict(list), {}
    for ev in events:
        assert ev["ph"] in ("M", "B", "E", "X", "i"), ev
        if ev["ph"] == "M":
            if ev["name"] == "process_name" and "name" in ev["args"]:
                names[ev["pid"]] = ev["args"]["name"]
            continue
        assert isinstance(ev["ts"], int) and ev["ts"] >= 0, ev
        if ev["ph"] == "i":
            continue
        pid = ev["pid"]
        assert pid in names, f"row {pid} used before its process_name"
        assert ev["ts"] >= last.get(pid, 0), f"time goes back on row {names[pid]}"
        last[pid] = ev["ts"]
        if ev["ph"] == "B":
            if ev["name"].startswith("NEGOTIATE_"):     # a tensor's collectives never overlap
                assert not stacks[pid], f"{names[pid]}: {stacks[pid]} still open"
            stacks[pid].append(ev["name"])
            phases[names[pid]].append(ev["name"])
        elif ev["ph"] == "E":
            assert stacks[pid], f"an E without its B on row {names[pid]}"
            stacks[pid].pop()
    assert not any(stacks.values()), {names[p]: s for p, s in stacks.items() if s}
    return dict(phases)


def _steps(hvd, steps=2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    return [n for n, _ in model.named_parameters()]


def test_start_and_stop_timeline_write_horovods_trace(tmp_path):
    fh.init()
    path = COMM.bcast(str(tmp_path / "timeline.json"), root=0)
    mine = f"{path}.{RANK}"                     # each rank names its own file
    fh.start_timeline(mine, mark_cycles=True)
    names = _steps(fh)
    fh.allreduce(torch.ones(3), name="x")
    fh.synchronize(fh.allreduce_async(torch.ones(2)))              # unnamed
    fh.grouped_allreduce([torch.ones(2), torch.ones(3)], name="grp")
    fh.synchronize(fh.grouped_allreduce_async([torch.ones(2), torch.ones(3)], name="g2"))
    fh.allgather(torch.ones(2, 1), name="gather")
    fh.broadcast(torch.ones(2), 0, name="bc")
    fh.stop_timeline()
    fh.allreduce(torch.ones(3), name="after-stop")
    assert timeline.ACTIVE is None
    if RANK != 0:
        assert not os.path.exists(mine)         # rank 0 records, as Horovod's coordinator
        return
    rows = check_trace(mine)
    for n in names:                             # every gradient has its row and its phases
        assert rows[f"allreduce.{n}"][:3] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE",
                                              "MPI_ALLREDUCE"], rows[f"allreduce.{n}"]
        assert rows[f"allreduce.{n}"].count("ALLREDUCE") == 2           # two steps
    assert rows["allreduce.x"] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MPI_ALLREDUCE"]
    assert any(r.startswith("allreduce.noname.") for r in rows)
    assert rows["grouped_allreduce.g2_1of2"] == rows["grouped_allreduce.g2_2of2"] == [
        "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MPI_ALLREDUCE"]
    assert rows["allgather.gather"] == ["NEGOTIATE_ALLGATHER", "ALLGATHER", "MPI_ALLGATHER"]
    assert rows["broadcast.bc"] == ["NEGOTIATE_BROADCAST", "BROADCAST", "MPI_BCAST"]
    assert "allreduce.after-stop" not in rows
    with open(mine, encoding="utf-8") as f:
        events = json.load(f)
    assert events[0]["args"]["start_time_since_epoch_in_micros"] > 0
    assert any(ev.get("name") == "CYCLE_START" and ev["ph"] == "i" for ev in events)
    ends = [ev for ev in events if ev["ph"] == "E" and "args" in ev]
    gathered = {"dtype": "float32", "shape": f"[{2 * COMM.Get_size()}, 1]"}    # the output's
    assert gathered in [ev["args"] for ev in ends]


def test_adasum_and_sparse_collectives_appear(tmp_path):
    fh.init()
    path = COMM.bcast(str(tmp_path / "t2.json"), root=0)
    fh.start_timeline(path)
    if COMM.Get_size() & (COMM.Get_size() - 1) == 0:
        fh.allreduce(torch.ones(3), op=fh.Adasum, name="ada")
    sp = torch.sparse_coo_tensor([[RANK]], [1.0], (8,), check_invariants=True)
    fh.sparse_allreduce_async(sp, "emb", fh.Average)()
    fh.stop_timeline()
    if RANK == 0:
        rows = check_trace(path)
        if "allreduce.ada" in rows or COMM.Get_size() & (COMM.Get_size() - 1) == 0:
            assert rows["allreduce.ada"] == ["NEGOTIATE_ADASUM", "ADASUM",
                                             "MPI_ADASUM_ALLREDUCE"]
        assert rows["allgather.emb.indices"][1:] == ["ALLGATHER", "MPI_ALLGATHER"]
        assert rows["allgather.emb.values"][1:] == ["ALLGATHER", "MPI_ALLGATHER"]


SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r})
os.environ["HOROVOD_TIMELINE"] = sys.argv[1]       # as if exported before the launch
import hpcasync.horovod as hvd
from tests.mpi.test_horovod_timeline import _steps
hvd.init()
names = _steps(hvd, steps=3)
if hvd.rank() == 0:                    # one line (two ranks' lines may interleave in the launcher)
    print("NAMES", ",".join(names), flush=True)
"""


def test_horovod_timeline_env_var_records_a_training_run(tmp_path):
    """``HOROVOD_TIMELINE`` in a fresh 2-rank job: rank 0's file, closed at exit, names each
    allreduced gradient with its three steps."""
    result = None
    if RANK == 0:
        from tests.mpi_util import REPO

        script = tmp_path / "train.py"
        script.write_text(SCRIPT.format(repo=str(REPO)))
        out = tmp_path / "env_timeline.json"
        done = subprocess.run([*mpiexec(2), sys.executable, str(script), str(out)],
                              env=clean_env(), capture_output=True, text=True, timeout=150)
        result = (done.returncode, done.stdout[-3000:] + done.stderr[-3000:])
        if done.returncode == 0:
            try:          # a failure here is reported on every rank below (no rank-0-only raise)
                found = re.search(r"NAMES (\S+)", done.stdout)
                assert found, f"no NAMES line in the job's output: {result[1]!r}"
                names = found.group(1).split(",")
                rows = check_trace(out)
                for n in names:
                    assert rows[f"allreduce.{n}"].count("MPI_ALLREDUCE") == 3, rows
                assert not os.path.exists(f"{out}.1")
            except Exception as exc:         # noqa: BLE001 (reported on every rank below)
                result = (1, f"{type(exc).__name__}: {exc}")
    idle_barrier()
    code, detail = COMM.bcast(result, root=0)
    assert code == 0, detail
