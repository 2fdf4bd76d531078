"""DASO keeps its hierarchy after a death (``mpirun --with-ft ulfm``, a real SIGKILL).

6 ranks as 3 virtual nodes of 2; rank 3 (node 1) dies in the middle of a cycling epoch. The
survivors must stay on their nodes — nodes of 2, 1 and 2 — not be cut into nodes of
gcd(2, 1, 2) = 1 ranks, which would silently turn DASO into local SGD with stale merges. After the
recovery: every step of the cycling epoch leaves the two replicas of an intact node bitwise equal
(node-local gradient averaging still happens) while the nodes differ; the lone rank of node 1
takes part in both global groups (it sends for each); the cool-down epoch ends with every replica
identical, and the model learns. The topology arithmetic alone: tests/unit/test_topology_regroup.py.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.mpi_util import REPO, clean_env, mpiexec, need_ulfm

JOB_TIMEOUT = 120

SCRIPT = r'''
import hashlib, json, os, signal, sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from hpcasync.comm import FlatModel
from hpcasync.daso import DASO, DasoComm
from hpcasync.daso.schedule import CYCLING
from hpcasync.data import load_dataset
from hpcasync.metrics import MetricsWriter
from hpcasync.runtime.elastic import FaultTolerance
from hpcasync.runtime.recovery import SyncWorld
from hpcasync.topology import Topology

KILL_RANK, KILL_AT = 3, 8           # world rank, step of epoch 1 (of NB)
B, NB, EPOCHS = 32, 30, 2           # epoch 1 cycling, epoch 2 cool-down (blocking)

topo = Topology.build(ranks_per_node=2)
ctx = SimpleNamespace(topo=topo, metrics=MetricsWriter(None, enabled=False), history=[])
me = topo.rank                       # this rank's data shard for the whole run
train, test = load_dataset("fashion-mnist-mini", train_limit=6 * B * NB)
torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))
flat = FlatModel(model)
opt = DASO(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), flat, topo,
           total_epochs=EPOCHS, batches_per_epoch=NB, warmup_epochs=0, cooldown_epochs=1,
           global_skip=2, local_skip=1, batches_to_wait=1, cast=None)
opt.broadcast_parameters()
pos = [1, 0]                         # (epoch, batches done)
after, records, recovered = [], [], None


def digest():
    return hashlib.sha256(opt.checksum().encode()).hexdigest()[:12]


def state():
    sch = opt.schedule
    return {"model": model.state_dict(), "optimizer": opt.optimizer.state_dict(),
            "steps": opt.steps, "pos": list(pos), "knobs": list(sch.knobs),
            "plateau": sch.plateau.state_dict()}


def load(blob):
    sch = opt.schedule
    pos[:] = blob["pos"]
    sch.epoch, sch.batch = pos
    sch.nbatches = NB if sch.batch else None
    sch.knobs = type(sch.knobs)(*blob["knobs"])
    sch.plateau.load_state_dict(blob["plateau"])
    opt.steps = blob["steps"]
    cycling = sch.phase == CYCLING
    if not cycling:
        model.load_state_dict(blob["model"])
        opt.optimizer.load_state_dict(blob["optimizer"])
    opt.set_topology(ctx.topo, average=cycling)


world = SyncWorld(ctx, state=state, load=load, adopt=lambda same: None, payload=dict,
                  check=lambda: None, comms=lambda: tuple(opt.comm.group_comms()))
ft = FaultTolerance(world, ulfm=True, grow_back=False)
while pos[0] <= EPOCHS:
    t = ctx.topo
    try:
        if pos[1] < NB:
            if pos == [1, KILL_AT] and me == KILL_RANK:
                os.kill(os.getpid(), signal.SIGKILL)
            start = ((pos[0] - 1) * 6 * NB + me * NB + pos[1]) * B % (len(train) - B)
            x, y = train.images[start:start + B], train.labels[start:start + B]
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            pos[1] += 1
            if recovered is not None and pos[0] == 1:
                plan = opt.last_plan
                after.append({"batch": plan.batch, "sync": plan.grad_sync,
                              "digests": t.world.allgather(digest())})
            continue
        records.append(t.world.gather({"rank": t.rank, **opt.epoch_end(0.0)}, root=0))
        pos[:] = [pos[0] + 1, 0]
    except Exception as exc:
        if not ft.report_error(exc):
            raise
        ft.reset(tuple(pos))
        n = ctx.topo
        recovered = {"position": list(pos), "node_sizes": list(n.node_sizes),
                     "uniform": n.uniform, "num_groups": opt.schedule.num_groups,
                     "layout": n.world.allgather([n.node, n.local_rank, n.local_size,
                                                  sorted(opt.comm.groups)])}
        # DASO's two global reductions on these uneven nodes, on a spare DasoComm: the blocking
        # average (over ranks) and each global group's sum S (one copy per node)
        dc = DasoComm(n, cast=None)
        avg = torch.full((1000,), float(n.rank + 1))
        dc.global_average(avg)
        sums = []
        for j in range(opt.schedule.num_groups):
            msg = dc.start(torch.full((4,), 10.0 * (n.node + 1)), group=j, batch=0, due=1)
            if msg is not None:
                sums.append([j, dc.complete(msg).tolist()])
        recovered["probe"] = n.world.allgather([avg.unique().tolist(), sums])

n = ctx.topo
final = n.world.allgather(digest())
model.eval()
with torch.no_grad():
    acc = (model(test.images).argmax(1) == test.labels).float().mean().item()
if n.rank == 0:
    print("RESULT " + json.dumps({"recovered": recovered, "after": after, "records": records,
                                  "final": final, "accuracy": acc, "size": n.size,
                                  "failures": ft.failures}), flush=True)
'''


@pytest.mark.rank0
def test_daso_keeps_node_local_groups_after_a_death(tmp_path):
    need_ulfm()
    script = tmp_path / "daso_death.py"
    script.write_text(SCRIPT)
    out = subprocess.run([*mpiexec(6, ft=True), sys.executable, str(script)],
                         env=clean_env(OMP_NUM_THREADS="1"), cwd=REPO, capture_output=True,
                         text=True, timeout=JOB_TIMEOUT)
    assert out.returncode == 0, out.stderr[-4000:]
    [line] = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    r = json.loads(line[7:])
    assert r["size"] == 5 and [f["dead_ranks"] for f in r["failures"]] == [[3]]

    # the survivors stay on their nodes: 2 + 1 + 2, not 5 nodes of 1
    rec = r["recovered"]
    assert rec["node_sizes"] == [2, 1, 2] and not rec["uniform"], rec
    assert rec["num_groups"] == 2
    layout = rec["layout"]             # per new rank: node, local rank, local size, groups
    assert [row[:3] for row in layout] == [[0, 0, 2], [0, 1, 2], [1, 0, 1], [2, 0, 2],
                                           [2, 1, 2]], layout
    assert [row[3] for row in layout] == [[0], [1], [0, 1], [0], [1]]   # lone rank: both groups
    nodes = [[0, 1], [2], [3, 4]]
    # the blocking average is the mean over the 5 ranks (values 1..5), the same on every rank;
    # each group's sum holds every node once (node p sends 10·(p+1): S = 60)
    s60 = [60.0] * 4
    assert rec["probe"] == [[[3.0], [[0, s60]]], [[3.0], [[1, s60]]], [[3.0], [[0, s60], [1, s60]]],
                            [[3.0], [[0, s60]]], [[3.0], [[1, s60]]]], rec["probe"]

    # node-local averaging goes on: after every step, the two replicas of an intact node are
    # bitwise equal, while the nodes have drifted apart (no global average inside the epoch)
    steps = r["after"]
    assert rec["position"][0] == 1 and len(steps) >= 10, (rec["position"], len(steps))
    for s in steps[:-1]:               # (the epoch's last step averages over all ranks)
        assert s["sync"] == "local"
        d = s["digests"]
        for node in nodes:
            assert len({d[i] for i in node}) == 1, (s["batch"], d)
        assert len({d[0], d[2], d[3]}) == 3, (s["batch"], d)
    assert len(set(steps[-1]["digests"])) == 1          # epoch end: the blocking average

    # the global phase goes on, with the lone rank sending for both groups
    ep1, ep2 = r["records"]
    sends = [row["daso_sends"] for row in ep1]
    assert sends[2] == sends[0] + sends[1] > 0 and sends[3] == sends[0] and sends[4] == sends[1], \
        sends
    assert [row["daso_phase"] for row in ep1] == ["cycling"] * 5
    assert [row["daso_phase"] for row in ep2] == ["cooldown"] * 5

    # the cool-down epoch (blocking, over all ranks) ends with every replica identical; it learns
    assert len(set(r["final"])) == 1, r["final"]
    assert r["accuracy"] >= 0.65, r["accuracy"]
