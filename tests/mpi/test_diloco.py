"""``diloco`` equals torchft's ``torchft.local_sgd.DiLoCo`` (issue 32): DiLoCo and Streaming
DiLoCo (fragments, ``fragment_sync_delay``, ``fragment_update_alpha``, one outer Nesterov SGD per
fragment) on the same model, data and inner optimizer, torchft run for real in the same job: each
MPI rank a replica group of one with its ``Manager`` (a Gloo process group, its own TCPStore)
and rank 0 serving the ``LighthouseServer``. Two ranks sum in one order: the parameters are
bitwise equal after every inner step.

torchft is a test dependency (``pip install torchft==0.2.0``, ``.ci/run`` installs it): without it
this file skips, except under CI, where it fails.
"""
from __future__ import annotations

import copy
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpcasync.errors import ConfigError
from hpcasync.ssgd.diloco import DiLoCo
from tests.mpi_util import COMM, RANK, SIZE, identical_everywhere, last_summary, run_mpi

try:
    import torchft  # noqa: F401 (is it installed)
    TORCHFT_ERROR = None
except ImportError as exc:              # pragma: no cover - CI installs it
    TORCHFT_ERROR = exc

needs2 = pytest.mark.skipif(SIZE < 2, reason="needs 2 MPI ranks")


def _torchft():
    if TORCHFT_ERROR is not None:
        if os.environ.get("CI"):
            pytest.fail(f"torchft does not import under CI: {TORCHFT_ERROR}")
        pytest.skip(f"torchft is not installed ({TORCHFT_ERROR})")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _outer(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _side_by_side(comm, steps: int, *, sync_every: int, fragments: int, delay: int,
                  alpha: float):
    """Yield (step, ours, torchft's) parameters after each inner step of both."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo as Reference

    n = comm.Get_size()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=n) if comm.Get_rank() == 0 else None
    address = comm.bcast(lighthouse.address() if lighthouse else None)
    base = _model()
    ref, ours = copy.deepcopy(base), copy.deepcopy(base)
    ref_inner = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    store_port = _free_port()
    store = TCPStore("localhost", store_port, 1, True)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), min_replica_size=n,
                      use_async_quorum=False, load_state_dict=None, state_dict=None,
                      replica_id=str(comm.Get_rank()), store_addr="localhost",
                      store_port=store_port, rank=0, world_size=1, lighthouse_addr=address,
                      port=_free_port(), timeout=timedelta(seconds=30),
                      quorum_timeout=timedelta(seconds=30),
                      connect_timeout=timedelta(seconds=30))
    ref_parts = [ref[0:2], ref[2:4], ref[4:]][:fragments] if fragments > 1 else [ref]
    our_parts = [ours[0:2], ours[2:4], ours[4:]][:fragments] if fragments > 1 else [ours]
    if fragments == 2:
        ref_parts, our_parts = [ref[0:2], ref[2:]], [ours[0:2], ours[2:]]
    opt = DiLoCo(torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), ours, comm,
                 sync_every=sync_every, fragments=our_parts, fragment_sync_delay=delay,
                 fragment_update_alpha=alpha, outer_optimizer=_outer)
    try:
        with Reference(manager, ref_parts, ref_inner, [_outer(m.parameters()) for m in ref_parts],
                       sync_every=sync_every, fragment_sync_delay=delay,
                       fragment_update_alpha=alpha):
            for step in range(steps):
                x, y = _batch(step, comm.Get_rank())
                ref_inner.zero_grad()
                F.cross_entropy(ref(x), y).backward()
                ref_inner.step()
                opt.zero_grad()
                F.cross_entropy(ours(x), y).backward()
                opt.step()
                yield step, opt, list(ours.parameters()), list(ref.parameters())
    finally:
        manager.shutdown(wait=False)
        del store
        comm.Barrier()
        if lighthouse is not None:
            lighthouse.shutdown()


@needs2
@pytest.mark.parametrize("case", [dict(sync_every=3, fragments=1, delay=0, alpha=0.0),
                                  dict(sync_every=4, fragments=2, delay=1, alpha=0.5),
                                  dict(sync_every=6, fragments=3, delay=0, alpha=0.0)],
                         ids=["diloco", "streaming-delay-alpha", "streaming-3"])
def test_two_ranks_equal_torchfts_diloco_bitwise_at_every_step(case):
    _torchft()
    sub = COMM.Split(0 if RANK < 2 else 1, RANK)
    try:
        if RANK >= 2:
            return
        syncs = 0
        for step, opt, ours, ref in _side_by_side(sub, 12, **case):
            bad = [i for i, (a, b) in enumerate(zip(ours, ref)) if not torch.equal(a, b)]
            assert not bad, f"step {step}: parameters {bad} differ from torchft's DiLoCo"
            syncs = opt.syncs
        assert syncs == 12 // (case["sync_every"] // case["fragments"])
    finally:
        sub.Free()


def test_bad_options_are_one_line_errors():
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for kw, said in ((dict(sync_every=5, fragments=2), "not a multiple of the 2 fragments"),
                     (dict(sync_every=4, fragments=2, fragment_sync_delay=2), "must be below"),
                     (dict(fragment_update_alpha=1.5), r"in \[0, 1\]"),
                     (dict(sync_every=9, fragments=9), "modules with parameters")):
        with pytest.raises(ConfigError, match=said):
            DiLoCo(sgd, model, COMM, **kw)


@pytest.mark.skipif(SIZE != 4, reason="2 nodes of 2 ranks")
def test_hierarchical_is_ssgd_inside_each_node_and_diloco_across_bitwise():
    """4 ranks as 2 nodes of 2 (``node_comm``): every inner step averages the node's two
    gradients (each halved, then summed), every H = 3 steps the outer Nesterov step takes the
    mean over the two nodes of their pseudo-gradients. Replayed in one process for both nodes;
    the node's ranks hold the same parameters after every step."""
    from hpcasync.comm import FlatModel

    node = COMM.Split(RANK // 2, RANK)
    try:
        model = _model()
        opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), FlatModel(model),
                     COMM, sync_every=3, outer_optimizer=_outer, node_comm=node)
        replicas = [_model() for _ in range(2)]
        inner = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in replicas]
        theta = _model()
        outer = _outer(list(theta.parameters()))
        for step in range(9):
            opt.zero_grad()
            F.cross_entropy(model(*_batch(step, RANK)[:1]), _batch(step, RANK)[1]).backward()
            opt.step()
            for p, (m, o) in enumerate(zip(replicas, inner)):
                grads = []
                for r in (2 * p, 2 * p + 1):
                    m.zero_grad()
                    x, y = _batch(step, r)
                    F.cross_entropy(m(x), y).backward()
                    grads.append([q.grad / 2 for q in m.parameters()])
                for q, a, b in zip(m.parameters(), *grads):
                    q.grad = a + b
                o.step()
            if (step + 1) % 3 == 0:
                for t, a, b in zip(theta.parameters(), *(m.parameters() for m in replicas)):
                    t.grad = ((t.detach() - a.detach()) + (t.detach() - b.detach())) / 2
                outer.step()
                with torch.no_grad():
                    for m in replicas:
                        for q, t in zip(m.parameters(), theta.parameters()):
                            q.copy_(t)
            mine = [q.detach() for q in model.parameters()]
            want = list(replicas[RANK // 2].parameters())
            bad = [i for i, (a, b) in enumerate(zip(mine, want)) if not torch.equal(a, b)]
            assert not bad, f"step {step}: parameters {bad} differ from the replay"
        assert opt.syncs == 3 and opt.replicas_equal
        with pytest.raises(ConfigError, match="does not survive a death"):
            opt.set_comm(COMM)
    finally:
        node.Free()


def test_quantized_mean_is_the_fp8_exchange_replayed_in_one_process():
    """Streaming DiLoCo's quantized outer gradients (quantize=True): each rank's chunk r of every
    rank's vector, FP8 with a scale per chunk, summed in float32 on rank r, divided by N,
    quantized again and gathered: bitwise the same steps replayed in one process, within FP8's
    rounding of the exact mean, and one byte an element on the wire."""
    from hpcasync.comm.shm import partition
    from hpcasync.ssgd.quantize import dequantize, quantize, quantized_mean

    n = 1001
    vec = [torch.randn(n, generator=torch.Generator().manual_seed(r)) * (1 + r)
           for r in range(SIZE)]
    vec[0][5:40] = 0.0                                          # (a chunk may be all zero)
    mine = vec[RANK].clone()
    sent = quantized_mean(COMM, mine)
    want = torch.empty(n)
    for lo, hi in partition(n, SIZE):
        acc = torch.zeros(hi - lo)
        for r in range(SIZE):
            acc += dequantize(*quantize(vec[r][lo:hi]))
        acc /= SIZE
        want[lo:hi] = dequantize(*quantize(acc))
    assert torch.equal(mine, want)
    exact = torch.stack(vec).mean(0)
    bound = (max(float(v.abs().max()) for v in vec) + float(exact.abs().max())) / 16
    assert float((mine - exact).abs().max()) <= bound
    assert 0 < float((mine - exact).abs().max())                  # it is rounded
    assert sent <= n + -(-n // SIZE) + 8 * SIZE + 8     # a byte an element (float32: 4)


def test_diloco_quantize_syncs_every_replica_to_one_theta():
    model = _model()
    opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model, COMM, sync_every=2,
                 quantize=True)
    for step in range(4):
        opt.zero_grad()
        x, y = _batch(step, RANK)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.syncs == 2 and opt.replicas_equal and identical_everywhere(model)
    numel = sum(p.numel() for p in model.parameters())
    assert opt.bytes_sent < 2 * (1.3 * numel + 8 * SIZE + 8)
    node = COMM.Split(RANK // 2, RANK)
    try:
        with pytest.raises(ConfigError, match="quantize and node_comm"):
            DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model, COMM, quantize=True,
                   node_comm=node)
    finally:
        node.Free()


def test_a_run_shorter_than_h_is_said_and_the_cli_refuses_it(caplog):
    """finish() after fewer inner steps than H: the model is its initial θ (DiLoCo's math), said
    once (a fragment that took no outer step); after H steps nothing is said. The CLI refuses
    such a run before training (check_run_length; tests/mpi/reliability/test_bad_input.py)."""
    model = _model()
    initial = [p.detach().clone() for p in model.parameters()]
    opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model, COMM, sync_every=4,
                 fragments=2)

    def train(steps):
        for step in range(steps):
            opt.zero_grad()
            x, y = _batch(step, RANK)
            F.cross_entropy(model(x), y).backward()
            opt.step()
    train(3)                              # fragment 0 synced at step 2, fragment 1 not
    with caplog.at_level("WARNING", logger="hpcasync"):
        opt.finish()
        opt.finish()
    said = [r.getMessage() for r in caplog.records if "took no outer step" in r.getMessage()]
    assert said == ["diloco: finish() after 3 inner steps with sync_every 4: 1 of 2 fragments "
                    "took no outer step, so the model ends on their initial parameters"]
    assert torch.equal(list(model.parameters())[-1], initial[-1])     # fragment 1: θ0
    with pytest.raises(ConfigError, match="more than the run's 3 inner steps per rank: not "
                                          "every fragment would take an outer step"):
        opt.check_run_length(3)
    opt.check_run_length(4)
    caplog.clear()
    other = DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model, COMM, sync_every=2)
    opt = other
    train(2)
    with caplog.at_level("WARNING", logger="hpcasync"):
        opt.finish()
    assert not [r for r in caplog.records if "took no outer step" in r.getMessage()]


class _DeviceLike(torch.Tensor):
    """A CPU tensor whose ``.cpu()`` is a copy, as a CUDA tensor's is: the device branch of a
    host-staged exchange runs on a machine without a GPU."""

    def cpu(self, *args, **kwargs):
        return torch.Tensor.clone(self).as_subclass(torch.Tensor)


@pytest.mark.skipif(SIZE != 4, reason="2 nodes of 2 ranks")
def test_hierarchical_node_mean_of_a_device_tensor_goes_through_a_host_copy():
    """The outer sync's mean over the nodes of a tensor that is not host memory (a CUDA flat
    buffer): each local rank averages its chunk with its peer of the other node, the node's
    allgather runs on a host copy, and the copy's result comes back into the device tensor."""
    from hpcasync.comm import FlatModel

    node = COMM.Split(RANK // 2, RANK)
    try:
        model = _model()
        opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), FlatModel(model), COMM,
                     sync_every=3, outer_optimizer=_outer, node_comm=node)
        n = 1001                                        # chunks of 501 and 500
        mine = torch.arange(n, dtype=torch.float32) * (1 + RANK // 2)    # equal inside a node
        flat = mine.clone().as_subclass(_DeviceLike)
        assert flat.cpu() is not flat
        opt._node_mean(flat)
        want = torch.arange(n, dtype=torch.float32) * 1.5                # (1 + 2) / 2
        assert torch.equal(flat.as_subclass(torch.Tensor), want)
        assert opt.bytes_across == (501 if node.Get_rank() == 0 else 500) * 4
    finally:
        node.Free()


@pytest.mark.rank0
@pytest.mark.e2e      # the quantized and hierarchical exchanges run in-process above, under every MPI
def test_cli_quantize_learns_with_a_byte_an_element(tmp_path):
    """``--diloco-quantize``: the 5 outer syncs of a 2-epoch LeNet run each hand MPI one byte an
    element of the model plus the rank's chunk and 40 bytes of scales (float32: 4·61706 bytes a
    rank; the same run unquantized: 67.7 % with 4,936,480 bytes, this one 72.0 % with 1,543,450);
    with --diloco-hierarchical it is a one-line error."""
    args = ["train", "--algorithm", "diloco", "--diloco-sync-every", "16", "--dataset",
            "fashion-mnist-mini", "--train-limit", "6000", "--test-limit", "1000", "--model",
            "lenet", "--epochs", "2", "--batch-size", "32", "--momentum", "0.9", "--progress",
            "off", "--seed", "1", "--diloco-quantize"]
    r = run_mpi(4, [*args, "--metrics", str(tmp_path / "m.jsonl")], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    s = last_summary(tmp_path / "m.jsonl")
    numel = 61706                                           # LeNet
    assert s["steps"] == 92 and s["bytes_communicated"] == 5 * (5 * numel + 4 * 40)
    assert s["test_accuracy"] >= 0.6, s["test_accuracy"]
    r = run_mpi(4, [*args, "--diloco-hierarchical", "--ranks-per-node", "2"], timeout=120)
    assert r.returncode == 2 and "do not go together" in r.stderr


@pytest.mark.rank0
@pytest.mark.e2e      # the quantized and hierarchical exchanges run in-process above, under every MPI
def test_cli_hierarchical_on_two_virtual_nodes_learns_and_crosses_less(tmp_path):
    """``--diloco-hierarchical --ranks-per-node 2``: the outer syncs carry half a model per rank
    across the nodes (each local rank its chunk); the run learns (seeds 0, 1, 2 of this command:
    49.0 66.7 69.0 %, flat DiLoCo beside it 64.3 67.7 69.7)."""
    args = ["train", "--algorithm", "diloco", "--ranks-per-node", "2", "--diloco-sync-every",
            "16", "--dataset", "fashion-mnist-mini", "--train-limit", "6000", "--test-limit",
            "1000", "--model", "lenet", "--epochs", "2", "--batch-size", "32", "--momentum",
            "0.9", "--progress", "off", "--seed", "1", "--diloco-hierarchical"]
    r = run_mpi(4, [*args, "--metrics", str(tmp_path / "m.jsonl")], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    s = last_summary(tmp_path / "m.jsonl")
    assert s["test_accuracy"] >= 0.6, s["test_accuracy"]
    r = run_mpi(4, ["train", "--algorithm", "ssgd", "--diloco-hierarchical", "--dataset",
                    "fashion-mnist-mini"], timeout=120)
    assert r.returncode == 2 and "--diloco-hierarchical applies to diloco" in r.stderr
