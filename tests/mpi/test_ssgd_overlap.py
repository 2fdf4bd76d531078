"""SSGD with gradient buckets reduced during backward (hpcasync.ssgd.buckets): the overlapped path
gives bitwise the parameters of the non-overlapped one, replicas stay bitwise identical, and buckets
really start while backward still runs."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpcasync.comm import FlatModel
from hpcasync.data import load_dataset
from hpcasync.errors import ConfigError
from hpcasync.models import build_model
from hpcasync.ssgd.buckets import bucket_ranges
from hpcasync.ssgd.optimizer import DistributedOptimizer
from tests.mpi_util import COMM, RANK, SIZE

B = 8
SMALL_BUCKET = 16 * 1024          # several buckets even for lenet (61 706 parameters)


@pytest.fixture(scope="module")
def data():
    train, _ = load_dataset("fashion-mnist-mini", train_limit=2048, test_limit=10)
    return train


def _batch(train, step, rank):
    start = ((step * SIZE + rank) * B) % (len(train) - B)
    return train.images[start:start + B], train.labels[start:start + B]


def _train(data, model_name, *, overlap, steps=3, bpps=1, compress=None,
           bucket_bytes=SMALL_BUCKET, set_to_none=False, progress="thread"):
    torch.manual_seed(7 + RANK)                 # different on every rank: broadcast fixes it
    model = build_model(model_name, (1, 28, 28), 10)
    flat = FlatModel(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), flat,
                               COMM, overlap=overlap, backward_passes_per_step=bpps,
                               compress=compress, bucket_bytes=bucket_bytes, progress=progress)
    assert opt.overlap == overlap
    assert len(opt.reducer.buckets) > 1
    opt.broadcast_parameters(root=0)
    for step in range(steps):                   # bpps backward passes, one step (Horovod's)
        if set_to_none:
            model.zero_grad(set_to_none=True)   # detaches the views: the hooks must re-bind
        else:
            opt.zero_grad()
        for k in range(bpps):
            x, y = _batch(data, step * bpps + k, RANK)
            F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.close()
    assert opt.steps == steps
    return flat.params.clone(), flat.buffers.clone()


def _assert_replicas_equal(tensor):
    replicas = COMM.allgather(tensor)
    assert all(torch.equal(replicas[0], r) for r in replicas), "replicas diverged"


@pytest.mark.parametrize("model_name,bpps,compress,progress", [
    ("lenet", 1, None, "thread"), ("resnet20", 1, None, "thread"), ("lenet", 2, None, "thread"),
    ("lenet", 1, "bf16", "thread"), ("resnet20", 2, "bf16", "thread"),
    ("lenet", 1, None, "test"), ("resnet20", 2, "bf16", "test")])
def test_overlap_bitwise_equals_no_overlap(data, model_name, bpps, compress, progress):
    steps = 2 if model_name == "resnet20" else 4
    kw = {"bpps": bpps, "compress": compress, "steps": steps, "progress": progress}
    on = _train(data, model_name, overlap=True, **kw)
    off = _train(data, model_name, overlap=False, **kw)
    start = _train(data, model_name, overlap=True, bpps=bpps, compress=compress, steps=0)
    assert not torch.equal(on[0], start[0]), "training did not move the parameters"
    assert torch.equal(on[0], off[0]), (
        f"overlap changed the parameters: max |diff| {(on[0] - off[0]).abs().max().item():.3g}")
    assert torch.equal(on[1], off[1]), "overlap changed the BatchNorm buffers"
    _assert_replicas_equal(on[0])
    _assert_replicas_equal(on[1])


def test_set_to_none_zero_grad_is_rebound(data):
    """model.zero_grad(set_to_none=True) makes backward write fresh .grad tensors: the hooks copy
    them into the flat buffer before their bucket starts, so the result does not change."""
    on = _train(data, "lenet", overlap=True, set_to_none=True)
    off = _train(data, "lenet", overlap=False)
    assert torch.equal(on[0], off[0])


@pytest.mark.parametrize("progress", ["thread", "test"])
def test_buckets_start_during_backward(data, progress):
    torch.manual_seed(3)
    model = build_model("resnet20", (1, 28, 28), 10)
    flat = FlatModel(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), flat, COMM,
                               bucket_bytes=SMALL_BUCKET, progress=progress, overlap=True)
    red = opt.reducer
    red.record = True
    x, y = _batch(data, 0, RANK)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    during = list(red.events)                   # what happened before backward() returned
    opt.step()
    opt.close()
    ready = [i for i, e in enumerate(during) if e[0] == "ready"]
    starts = [e[1] for e in during if e[0] == "start"]
    assert len(ready) == len(flat.names), "a gradient hook did not fire"
    assert starts, "no bucket started during backward"
    assert during.index(("start", 0)) < ready[-1], \
        "the first bucket started only after the last gradient was ready"
    assert starts == list(range(len(starts))), f"buckets started out of order: {starts}"
    # a bucket starts only once every one of its parameters has its gradient
    for b in starts:
        pos = during.index(("start", b))
        seen = {e[1] for e in during[:pos] if e[0] == "ready"}
        missing = [flat.names[k] for k in red.buckets[b][2] if k not in seen]
        assert not missing, f"bucket {b} started before the gradients of {missing}"


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(784, 64)
        self.unused = nn.Linear(64, 64)         # no gradient, ever
        self.b = nn.Linear(64, 10)

    def forward(self, x):
        return self.b(torch.relu(self.a(x.flatten(1))))


@pytest.mark.parametrize("overlap,progress", [(True, "thread"), (False, "thread"), (True, "test")])
def test_unused_parameters_do_not_hang(data, overlap, progress):
    torch.manual_seed(5 + RANK)
    model = _Unused()
    flat = FlatModel(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), flat, COMM,
                               overlap=overlap, bucket_bytes=4 * 1024, progress=progress)
    opt.broadcast_parameters(root=0)
    before = flat.params.clone()
    for step in range(3):
        x, y = _batch(data, step, RANK)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.close()
    lo, n = flat.offsets[2], model.unused.weight.numel()
    assert torch.equal(flat.params[lo: lo + n], before[lo: lo + n])
    _assert_replicas_equal(flat.params)


def test_bucket_ranges_cover_from_the_end():
    offsets, numels = [0, 10, 30, 60], [10, 20, 30, 5]
    buckets = bucket_ranges(offsets, numels, bucket_bytes=100)        # 25 floats
    assert [(lo, hi) for lo, hi, _ in buckets] == [(30, 65), (0, 30)]
    assert [m for _, _, m in buckets] == [[3, 2], [1, 0]]


def test_bad_bucket_size_is_a_config_error():
    model = build_model("mlp", (1, 28, 28), 10)
    with pytest.raises(ConfigError, match="bucket_bytes"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, COMM,
                             bucket_bytes=0)
    with pytest.raises(ConfigError, match="progress"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, COMM,
                             progress="spin")


def _one_step(model, opt, data, step=0):
    x, y = _batch(data, step, RANK)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def test_error_in_the_communication_thread_is_raised_in_step(data):
    """A bucket reduction that fails in the thread (here: every rank's thread meets an invalid
    wire format) surfaces as an exception from step() — no hang, and the next step works."""
    torch.manual_seed(1)
    model = build_model("lenet", (1, 28, 28), 10)
    flat = FlatModel(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), flat, COMM,
                               bucket_bytes=SMALL_BUCKET, overlap=True)
    opt.reducer.compress = "int3"            # what the thread will pass to allreduce
    with pytest.raises(RuntimeError, match="communication thread.*compress must be one of"):
        _one_step(model, opt, data)
    assert opt.steps == 0 and opt.passes == 0, "the failed step must be dropped"
    opt.reducer.compress = None
    _one_step(model, opt, data, step=1)
    opt.close()
    _assert_replicas_equal(flat.params)


def test_second_backward_in_one_step_is_refused(data):
    """With overlap a gradient computed again after its bucket started would race with the
    reduction: refused with an error naming the remedies."""
    model = build_model("mlp", (1, 28, 28), 10)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, COMM,
                               bucket_bytes=SMALL_BUCKET, overlap=True)
    x, y = _batch(data, 0, RANK)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(ConfigError, match="more than backward_passes_per_step=1 times"):
        F.cross_entropy(model(x), y).backward()
    opt.zero_grad()                          # waits for the first backward's buckets, resets
    _one_step(model, opt, data)
    opt.close()
    assert opt.steps == 1


def test_overlap_default_is_off_on_the_cpu():
    """overlap=None (the default): on for a model on a GPU, off on the CPU, where the
    communication thread competes with backward for the core (experiments/results/ssgd.md)."""
    model = build_model("mlp", (1, 28, 28), 10)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, COMM)
    assert opt.overlap is False
    opt.close()
