"""``hpcasync.horovod`` matches named collectives by Horovod's tensor name, as Horovod's
coordinator does: a named ``_async`` call returns while the other ranks are in another collective
(a ``barrier()``), a second call with a name still in flight is Horovod's ``ValueError`` on that
rank, ranks may submit named collectives in different orders; ``reducescatter`` refuses ops other
than Average and Sum with Horovod's error. Each case runs on real Horovod too when it imports
(type, text and results compared); the cases where Horovod stalls raise on every rank here.
Run under ``mpiexec -n 2`` or more."""
from __future__ import annotations

import time

import pytest
import torch

import hpcasync.horovod as fh
from tests.mpi_util import COMM, RANK, SIZE

pytestmark = pytest.mark.timeout(30)

#: Horovod's DUPLICATE_NAME_ERROR (horovod/common/common.h), raised as ValueError
DUPLICATE = ("Requested to allreduce, allgather, or broadcast a tensor with the same name as "
             "another tensor that is currently being processed.  If you want to request another "
             "tensor, use a different tensor name.")
RS_OPS = "Reducescatter currently only supports AVERAGE and SUM."


def _start(hvd, kind: str, name: str) -> int:
    """One ``_async`` collective of ``kind`` on a tensor holding this rank's number."""
    x = torch.full((2 * SIZE, 3), float(RANK))
    if kind == "allreduce":
        return hvd.allreduce_async(x, name=name, op=hvd.Sum)
    if kind == "allgather":
        return hvd.allgather_async(x, name=name)
    if kind == "broadcast":
        return hvd.broadcast_async(x, root_rank=SIZE - 1, name=name)
    return hvd.reducescatter_async(x, name=name, op=hvd.Sum)


def _expected(kind: str) -> torch.Tensor:
    total = float(sum(range(SIZE)))
    if kind == "allreduce":
        return torch.full((2 * SIZE, 3), total)
    if kind == "allgather":
        return torch.cat([torch.full((2 * SIZE, 3), float(r)) for r in range(SIZE)])
    if kind == "broadcast":
        return torch.full((2 * SIZE, 3), float(SIZE - 1))
    return torch.full((2, 3), total)


def _outcome(call):
    try:
        return None, call()
    except Exception as exc:                # noqa: BLE001
        return type(exc), str(exc)


@pytest.mark.parametrize("kind", ["allreduce", "allgather", "broadcast", "reducescatter"])
def test_a_second_collective_with_a_name_in_flight_is_horovods_value_error(backends, kind):
    # Horovod's *_duplicate_name_error pattern: rank 0 submits, repeats the name, and goes to a
    # barrier the other ranks are already in; then they do the same
    results = {}
    for label, hvd in backends.items():
        t0 = time.perf_counter()
        got = []
        for turn in (0, 1):
            if (RANK == 0) == (turn == 0):
                h = _start(hvd, kind, f"dup.{kind}")
                got.append(_outcome(lambda: _start(hvd, kind, f"dup.{kind}")))
            hvd.barrier()
        assert len(got) == 1 and got[0][0] is ValueError and got[0][1] == DUPLICATE, (label, got)
        results[label] = hvd.synchronize(h)
        assert time.perf_counter() - t0 < 10, label                # no stall
        assert torch.equal(results[label], _expected(kind)), (label, results[label])
    # once synchronized, the name is free again
    assert torch.equal(fh.synchronize(_start(fh, kind, f"dup.{kind}")), _expected(kind))


def test_named_collectives_submitted_in_different_orders_complete(backends):
    kinds = ["allreduce", "allgather", "broadcast", "reducescatter"]
    order = kinds if RANK % 2 == 0 else kinds[::-1]
    for label, hvd in backends.items():
        handles = {k: _start(hvd, k, f"order.{k}") for k in order}
        for k in kinds:
            out = hvd.synchronize(handles[k])
            assert torch.equal(out, _expected(k)), (label, k, out)


def test_the_same_name_under_different_collectives_is_no_duplicate(backends):
    # Horovod's tensor names carry the collective (allreduce.x, allgather.x, ...)
    for label, hvd in backends.items():
        handles = {k: _start(hvd, k, "shared") for k in ("allreduce", "allgather", "broadcast")}
        for k, h in handles.items():
            assert torch.equal(hvd.synchronize(h), _expected(k)), (label, k)


@pytest.mark.parametrize("op", ["Adasum", "Min", "Max", "Product"])
def test_reducescatter_refuses_other_ops_with_horovods_error(backends, op):
    for label, hvd in backends.items():
        for call in (lambda: hvd.reducescatter(torch.ones(SIZE, 2), op=getattr(hvd, op)),
                     lambda: hvd.grouped_reducescatter([torch.ones(SIZE)], op=getattr(hvd, op))):
            kind, text = _outcome(call)
            assert kind is not None and kind.__name__ == "HorovodInternalError", (label, kind)
            assert issubclass(kind, RuntimeError) and text == RS_OPS, (label, text)
    # refused before anything was sent: the facade goes on
    assert torch.equal(fh.reducescatter(torch.ones(SIZE, 2), op=fh.Sum),
                       torch.full((1, 2), float(SIZE)))


def test_reducescatter_of_a_scalar_is_horovods_value_error(backends):
    for label, hvd in backends.items():
        kind, text = _outcome(lambda: hvd.reducescatter(torch.tensor(float(RANK))))
        assert kind is ValueError and text == "Reducescatter does not support scalar inputs", \
            (label, kind, text)


def test_ranks_waiting_for_names_never_submitted_raise_not_stall(backends):
    # rank 0 waits for "wait0", the others for "wait1": Horovod stalls, the facade raises the
    # same error on every rank (the facade only)
    t0 = time.perf_counter()
    if RANK == 0:
        h = fh.allreduce_async(torch.ones(3), name="wait0")
        kind, text = _outcome(lambda: fh.synchronize(h))
    else:
        kind, text = _outcome(lambda: fh.allreduce(torch.ones(3), name="wait1"))
    assert time.perf_counter() - t0 < 5
    assert kind is not None and kind.__name__ == "HorovodInternalError", (kind, text)
    assert text.startswith("Mismatched tensor names"), text
    every = COMM.allgather(text)
    assert all(t == every[0] for t in every), every
    assert torch.equal(fh.allreduce(torch.ones(2), op=fh.Sum), torch.full((2,), float(SIZE)))


def test_a_mismatch_found_for_a_waiting_collective_is_raised_by_its_synchronize(backends):
    # rank 0's "m" waits (the others are in a barrier) and rank 0 goes on to a second barrier;
    # the others' "m" has another shape: the same error on every rank, at their call and at rank
    # 0's later synchronize (the facade only: Horovod reports it at every rank's synchronize)
    if RANK == 0:
        h = fh.allreduce_async(torch.ones(3), name="m")
        fh.barrier()
        fh.barrier()
        kind, text = _outcome(lambda: fh.synchronize(h))
    else:
        fh.barrier()
        kind, text = _outcome(lambda: fh.allreduce_async(torch.ones(4), name="m"))
        fh.barrier()
    assert kind is not None and kind.__name__ == "HorovodInternalError", (kind, text)
    assert text.startswith("Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape "
                           "[3], but another rank sent a tensor of shape [4]."), text
    every = COMM.allgather(text)
    assert all(t == every[0] for t in every), every
    assert torch.equal(fh.allreduce(torch.ones(2), name="m", op=fh.Sum),      # "m" is free
                       torch.full((2,), float(SIZE)))


def test_an_optimizer_without_named_parameters_names_them_as_horovod(backends):
    # Horovod's test_optimizer_no_named_parameters: unique names, the same on every rank
    for label, hvd in backends.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        sgd = torch.optim.SGD([{"params": model[0].parameters()},
                               {"params": model[1].parameters()}], lr=0.001)
        names = hvd.DistributedOptimizer(sgd)._parameter_names
        assert len(names) == 4 and len(set(names.values())) == 4, (label, names)
        assert all(n == names[p] for n, p in zip(
            ["allreduce.noname.0.0", "allreduce.noname.0.1", "allreduce.noname.1.0",
             "allreduce.noname.1.1"], model.parameters())), (label, names)
        everyone = COMM.allgather(sorted(names.values()))
        assert all(e == everyone[0] for e in everyone), label
