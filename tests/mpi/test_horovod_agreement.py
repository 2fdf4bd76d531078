"""``hpcasync.horovod``: ranks that disagree get the same error on every rank, never a hang, a
crash or reinterpreted data — and that error is Horovod's (``HorovodInternalError``, a
``RuntimeError``, with its "Mismatched ..." text), checked against real Horovod in the same
processes when it imports. Run under ``mpiexec -n 2`` (or more)."""
from __future__ import annotations

import time

import pytest
import torch

import hpcasync.horovod as fh
from tests.mpi_util import COMM, HOROVOD_ERROR, RANK, SIZE

pytestmark = pytest.mark.timeout(60)
ODD = RANK % 2




#: (label, call(hvd) -> result): each differs between odd and even ranks
CASES = [
    ("shape", lambda h: h.allreduce(torch.ones(3 if ODD else 4), name="a1")),
    ("dtype", lambda h: h.allreduce(torch.ones(3, dtype=torch.int32 if ODD else torch.float32),
                                    name="a2")),
    ("op", lambda h: h.allreduce(torch.ones(3), op=h.Sum if ODD else h.Max, name="a3")),
    ("scale", lambda h: h.allreduce(torch.ones(3), postscale_factor=0.5 if ODD else 1.0,
                                    name="a4")),
    ("2d", lambda h: h.allreduce(torch.ones(2, 3 if ODD else 4), name="a5")),
    ("root", lambda h: h.broadcast(torch.ones(3), root_rank=ODD, name="b1")),
    ("bshape", lambda h: h.broadcast(torch.ones(3 if ODD else 4), root_rank=0, name="b2")),
    ("bdtype", lambda h: h.broadcast(torch.ones(4, dtype=torch.float64 if ODD else torch.float32),
                                     0, name="b3")),
    ("agdim", lambda h: h.allgather(torch.ones(2, 3 if ODD else 4), name="g1")),
    ("agrank", lambda h: h.allgather(torch.ones(2, 3) if ODD else torch.ones(2), name="g2")),
    ("a2a", lambda h: h.alltoall(torch.ones(2 * SIZE, 2 if ODD else 3), name="t1")),
    ("a2adtype", lambda h: h.alltoall(torch.ones(2 * SIZE, dtype=torch.int32 if ODD else torch.float32),
                                      name="t2")),
    ("rs", lambda h: h.reducescatter(torch.ones(4 if ODD else 6), name="r1")),
    ("rsdtype", lambda h: h.reducescatter(
        torch.ones(4, dtype=torch.float64 if ODD else torch.float32), name="r2")),
]


def _outcome(call, hvd):
    try:
        out = call(hvd)
    except Exception as exc:                # noqa: BLE001
        return type(exc), str(exc)
    return None, out


@pytest.mark.parametrize("label,call", CASES, ids=[c[0] for c in CASES])
def test_disagreement_raises_horovods_error_on_every_rank(backends, label, call):
    t0 = time.perf_counter()
    kind, text = _outcome(call, fh)
    took = time.perf_counter() - t0
    every = COMM.allgather((kind.__name__ if kind else None, text if kind else None))
    assert kind is not None and issubclass(kind, RuntimeError), (label, kind, text)
    assert kind.__name__ == "HorovodInternalError" and text.startswith("Mismatched"), text
    assert all(e == every[0] for e in every), every          # the same error on every rank
    assert took < 1.0, took
    assert "[tensor " in text and "rank 0 vs rank 1" in text, text   # names it
    if "horovod" in backends:
        rkind, rtext = _outcome(call, backends["horovod"])
        assert rkind is not None and rkind.__name__ == "HorovodInternalError", (rkind, rtext)
        ours = text.split(" [tensor ")[0]
        # Horovod's "One rank / another rank" follows arrival order: compare both orders
        assert rtext == ours or _swapped(ours) == rtext, (ours, rtext)
    # and the facade still works afterwards (nothing left half-done)
    assert torch.equal(fh.allreduce(torch.ones(2), op=fh.Sum, name="after"),
                       torch.full((2,), float(fh.size())))


def _swapped(text: str) -> str:
    """Horovod's message with the two sides exchanged."""
    import re

    vals = re.findall(r"(shape \[[^\]]*\]|type \w+|op \d+|factors \([^)]*\)|root rank \d+|"
                      r"rank \d+|equal to \d+)", text)
    if len(vals) != 2:
        return text
    a, b = vals
    i = text.index(a)
    j = text.index(b, i + len(a))
    return text[:i] + b + text[i + len(a):j] + a + text[j + len(b):]


def test_alltoall_splits_must_be_int32_as_in_horovod(backends):
    for hvd in backends.values():
        for splits in (torch.tensor([2.0] * fh.size()), torch.tensor([2] * fh.size()),
                       [2.0] * fh.size()):
            if hvd is not fh and isinstance(splits, list):
                continue
            with pytest.raises(ValueError, match="32-bit integer"):
                hvd.alltoall(torch.ones(2 * fh.size()), splits=splits)
        out, got = hvd.alltoall(torch.ones(2 * fh.size()), splits=[2] * fh.size())
        assert got.dtype == torch.int32 and out.shape == (2 * fh.size(),)


def test_invalid_splits_on_one_rank_only_raise_everywhere(backends):
    n = fh.size()
    splits = [2] * n if ODD else [2.5] * n
    with pytest.raises(ValueError, match=r"32-bit integer.*\[rank 0\]"):
        fh.alltoall(torch.ones(2 * n), splits=splits)


def test_two_in_flight_collectives_with_one_name_raise_horovods_value_error(backends):
    for hvd in backends.values():
        h1 = hvd.allreduce_async(torch.ones(3), name="same")
        with pytest.raises(ValueError, match="same name as another tensor that is currently"):
            hvd.allreduce_async(torch.ones(3), name="same")
        assert torch.equal(hvd.synchronize(h1), torch.ones(3))
    # once synchronized, the name is free again
    assert torch.equal(fh.allreduce(torch.ones(3), name="same"), torch.ones(3))


def test_different_names_in_the_same_slot_raise_not_hang(backends):
    with pytest.raises(RuntimeError, match="Mismatched tensor names"):
        fh.allreduce(torch.ones(3), name=f"n{ODD}")


def test_distributed_optimizer_checks_the_model_layout_once(backends):
    model = torch.nn.Linear(3, 2 if ODD else 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"Mismatched .*shapes.*parameter weight"):
        fh.DistributedOptimizer(opt, named_parameters=model.named_parameters())


def test_agreement_can_be_switched_off_for_measurement(backends, monkeypatch):
    monkeypatch.setenv("HPCASYNC_HOROVOD_AGREE", "0")
    assert torch.equal(fh.allreduce(torch.ones(3), name="off"), torch.ones(3))
