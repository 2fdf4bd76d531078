"""DASO's nonblocking phase, numerically, on real ranks and through the optimizer.

2 virtual nodes of 2 ranks (P = 2), one cycling epoch, fp32 messages. The test records what every
rank sent (its parameters and buffers at the send, before the in-place sum overwrites them) and
its state right after the user's optimizer step of every batch. After each batch that merges, every
rank of every node must hold

    x ← (2B·x + S) / (2B + P)

where x is the state (after that batch's optimizer step) of its node's rank in the receiving global
group, and S the sum over the nodes of that group's snapshots sent B batches earlier. Replacing
the merge with ``pass``, merging with the wrong B, or summing the wrong batch's snapshot fails it.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hpcasync.daso import DASO, pack_state
from tests.models import SmallBN
from tests.mpi_util import COMM, RANK, SIZE

pytestmark = pytest.mark.skipif(SIZE != 4, reason="needs mpiexec -n 4 (2 nodes x 2)")


@pytest.fixture(scope="module")
def setting():
    from hpcasync.data import load_dataset
    from hpcasync.topology import Topology

    topo = Topology.build(ranks_per_node=2)
    train, _ = load_dataset("fashion-mnist-mini")
    yield topo, train
    topo.free()


@pytest.mark.parametrize("wait", [1, 2])
def test_merge_equals_its_formula_through_the_optimizer(setting, wait):
    topo, train = setting
    torch.manual_seed(0)
    model = SmallBN()
    nb = 12
    opt = DASO(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, topo,
               total_epochs=1, batches_per_epoch=nb, warmup_epochs=0, cooldown_epochs=0,
               global_skip=3, batches_to_wait=wait, cast=None)
    opt.broadcast_parameters()
    sent: dict[int, torch.Tensor] = {}            # batch -> this rank's snapshot at its send
    after_step: dict[int, torch.Tensor] = {}      # batch -> this rank's state after the step
    start, inner_step = opt.comm.start, opt.optimizer.step

    def recording_start(snapshot, *, group, batch, due):
        sent[batch] = snapshot.clone()
        return start(snapshot, group=group, batch=batch, due=due)

    def recording_step(*args, **kwargs):
        out = inner_step(*args, **kwargs)
        after_step[opt.schedule.batch - 1] = pack_state(opt.flat.params, opt.flat.buffers).clone()
        return out

    opt.comm.start, opt.optimizer.step = recording_start, recording_step
    merges = 0
    for b in range(nb):
        lo = (b * SIZE + RANK) * 16
        opt.zero_grad()
        F.cross_entropy(model(train.images[lo:lo + 16]), train.labels[lo:lo + 16]).backward()
        opt.step()
        plan = opt.last_plan
        state = pack_state(opt.flat.params, opt.flat.buffers)
        everyone_sent = COMM.allgather(sent.get(b - wait))
        everyone_x = COMM.allgather(after_step[b])
        if plan.receive_group is None or b == nb - 1:      # the last batch also averages all
            continue
        merges += 1
        group = [r for r in range(SIZE) if r % 2 == plan.receive_group]   # local rank j
        S = torch.stack([everyone_sent[r].double() for r in group]).sum(0)
        x = everyone_x[topo.node * 2 + plan.receive_group].double()   # my node's receiver
        want = (2 * wait * x + S) / (2 * wait + topo.num_nodes)
        torch.testing.assert_close(state.double(), want, rtol=1e-6, atol=1e-7)
        assert not torch.allclose(state.double(), everyone_x[RANK].double()), \
            "the merge changed nothing"
    assert merges >= 2
