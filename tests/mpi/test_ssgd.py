"""SSGD: replicas stay bitwise identical, N-rank SSGD equals 1-rank SGD on the concatenated batch,
and the Horovod backend matches ours (when Horovod is installed)."""
import pytest
import torch
import torch.nn.functional as F

from hpcasync.comm import FlatModel
from hpcasync.data import load_dataset
from hpcasync.models import build_model
from hpcasync.ssgd import DistributedOptimizer
from tests.mpi_util import need_horovod, COMM, RANK, SIZE

B = 16


@pytest.fixture(scope="module")
def data():
    train, _ = load_dataset("fashion-mnist-mini", train_limit=4096, test_limit=10)
    return train


def _batch(train, step, rank):
    """Rank r's batch at step s: a disjoint slice, different on every rank."""
    start = ((step * SIZE + rank) * B) % (len(train) - B)
    return train.images[start:start + B], train.labels[start:start + B]


def _replica(model_name="lenet", seed=123 ):
    torch.manual_seed(seed + RANK)        # deliberately different: broadcast must fix it
    return build_model(model_name, (1, 28, 28), 10)


@pytest.mark.parametrize("compress", [None, "bf16"])
def test_replicas_bitwise_identical_after_50_steps(data, compress):
    model = _replica()
    flat = FlatModel(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9,
                                               weight_decay=1e-4), flat, COMM, compress=compress)
    opt.broadcast_parameters(root=0)
    for step in range(50):
        x, y = _batch(data, step, RANK)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    replicas = COMM.allgather(flat.params.clone())
    assert all(torch.equal(replicas[0], r) for r in replicas), "replicas diverged"
    assert not torch.equal(replicas[0], torch.zeros_like(replicas[0]))


def test_ssgd_equals_single_process_sgd_on_concatenated_batch(data):
    model = _replica()
    flat = FlatModel(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), flat, COMM)
    opt.broadcast_parameters(root=0)
    ref = build_model("lenet", (1, 28, 28), 10)
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(10):
        x, y = _batch(data, step, RANK)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        xs, ys = zip(*(_batch(data, step, r) for r in range(SIZE)))
        ref_opt.zero_grad()
        F.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
    ref_flat = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    torch.testing.assert_close(flat.params, ref_flat, rtol=1e-4, atol=1e-5)


def test_backward_passes_per_step_accumulates(data):
    """Horovod's meaning: two backward passes, then one step() that averages their sum."""
    model = _replica()
    flat = FlatModel(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), flat, COMM,
                               backward_passes_per_step=2)
    opt.broadcast_parameters(root=0)
    before = flat.params.clone()
    opt.zero_grad()
    for step in range(2):
        x, y = _batch(data, step, RANK)
        F.cross_entropy(model(x), y).backward()
        assert torch.equal(flat.params, before), "stepped before step()"
    opt.step()
    assert opt.steps == 1 and not torch.equal(flat.params, before)


def test_horovod_backend_matches_own_backend(data):
    need_horovod()
    from hpcasync.ssgd.horovod import HorovodOptimizer

    ours = _replica()
    theirs = _replica()
    flat = FlatModel(ours)
    opt = DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9), flat, COMM)
    opt.broadcast_parameters(root=0)
    theirs.load_state_dict(ours.state_dict())
    hopt = HorovodOptimizer(torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9), theirs, COMM)
    for step in range(10):
        x, y = _batch(data, step, RANK)
        for m, o in ((ours, opt), (theirs, hopt)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    hflat = torch.cat([p.detach().reshape(-1) for p in theirs.parameters()])
    torch.testing.assert_close(flat.params, hflat, rtol=1e-5, atol=1e-6)
    hreplicas = COMM.allgather(hflat)
    assert all(torch.equal(hreplicas[0], r) for r in hreplicas)
