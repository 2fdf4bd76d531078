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
from tests.mpi_util import COMM, RANK, SIZE

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
