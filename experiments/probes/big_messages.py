"""Messages over 2 GiB through the paths a large model takes (docs/design/comm.md, "Messages over
2 GiB"). Two ranks; GIB is the model's size in GiB of float32 (a ``torch.nn.Linear(24000, n)``).

    P=experiments/probes/big_messages.py
    mpiexec -n 2 python $P objects 2.2               # broadcast, bcast_object, gather_object,
                                                     # hvd.allgather_object
    mpiexec -n 2 python $P sync ssgd 2.2             # hpcasync.optimizer, elastic State.sync
    mpiexec -n 2 python $P ps asgd 2.1               # a PS rule: two pushes and the end
    mpiexec -n 2 python $P checkpoint localsgd 2.1   # save_checkpoint, load_checkpoint(comm=)

Each rank prints what it did and how long it took, or the error (e.g. ``MPI_ERR_ARG`` before
the change). Memory: about three copies of the model per rank (OD-SGD: five).
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import time

import torch

import hpcasync


def linear(gib: float) -> torch.nn.Module:
    return torch.nn.Linear(24000, int(gib * 2**30 / 4 / 24000), bias=False)


def timed(rank: int, what: str, fn):
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:        # noqa: BLE001 - a probe: say it and go on
        print(rank, what, "failed:", type(exc).__name__, str(exc)[:200], flush=True)
        raise SystemExit(1)
    print(rank, what, f"{time.perf_counter() - t0:.1f} s", flush=True)
    return out


def objects(gib: float) -> None:
    from mpi4py import MPI

    from hpcasync.comm.broadcast import broadcast
    from hpcasync.comm.objects import bcast_object, gather_object

    comm, n = MPI.COMM_WORLD, int(gib * 2**30 / 4)
    r = comm.Get_rank()
    x = torch.arange(n, dtype=torch.float32) if r == 0 else torch.zeros(n)
    timed(r, f"broadcast {gib} GiB", lambda: broadcast(comm, x))
    assert x[-1] == n - 1
    got = timed(r, f"bcast_object {gib} GiB", lambda: bcast_object(
        comm, {"w": x, "step": 7} if r == 0 else None, 0))
    assert got["w"][-1] == n - 1 and got["step"] == 7
    del got
    parts = timed(r, f"gather_object {comm.Get_size()} x {gib / 2} GiB", lambda: gather_object(
        comm, {"w": torch.full((n // 2,), float(r))}, 0))
    assert r != 0 or all(p["w"][-1] == i for i, p in enumerate(parts))
    del parts
    import hpcasync.horovod as hvd

    hvd.init()
    every = timed(r, f"hvd.allgather_object {comm.Get_size()} x {gib / 2} GiB",
                  lambda: hvd.allgather_object({"w": torch.full((n // 2,), float(r))}))
    assert all(p["w"][-1] == i for i, p in enumerate(every))


def sync(alg: str, gib: float) -> None:
    ctx = hpcasync.init(alg)
    model = linear(gib)
    with torch.no_grad():
        model.weight[-1, -1] = 7.0 + ctx.rank
    kw = {"epochs": 1, "steps_per_epoch": 10} if alg == "daso" else {}
    opt = timed(ctx.rank, f"hpcasync.optimizer({alg!r})", lambda: hpcasync.optimizer(
        alg, model, torch.optim.SGD(model.parameters(), lr=0.1), **kw))
    assert model.weight[-1, -1] == 7.0          # rank 0's, from the first broadcast
    state = hpcasync.elastic.State(model=model, optimizer=opt, epoch=0)
    with torch.no_grad():
        model.weight[-1, -1] = 100.0 + ctx.rank
    timed(ctx.rank, "State.sync", state.sync)
    assert model.weight[-1, -1] == 100.0


def ps(alg: str, gib: float) -> None:
    ctx = hpcasync.init(alg)
    model = linear(gib)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = timed(ctx.rank, f"hpcasync.optimizer({alg!r})", lambda: hpcasync.optimizer(
        alg, model, lr=0.5, steps_per_epoch=2, epochs=1))
    if ctx.is_server:
        timed(ctx.rank, "serve", opt.serve)
        return
    for step in range(2):
        opt.zero_grad()
        model.weight.sum().backward()           # gradient 1 everywhere
        timed(ctx.rank, f"push {step}", opt.step)
    opt.finish()
    print(ctx.rank, "θ[-1,-1] after 2 pushes of lr 0.5:", float(model.weight[-1, -1].detach()))


def checkpoint(alg: str, gib: float) -> None:
    ctx = hpcasync.init(alg)
    model = linear(gib)
    opt = hpcasync.optimizer(alg, model, torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.no_grad():
        model.weight[-1, -1] = 5.0
    world = ctx.topology.world
    where = world.bcast(tempfile.mkdtemp(prefix="big_messages-") if ctx.rank == 0 else None)
    timed(ctx.rank, "save_checkpoint", lambda: hpcasync.save_checkpoint(where, model, opt,
                                                                        epoch=1))
    with torch.no_grad():
        model.weight[-1, -1] = 0.0
    timed(ctx.rank, "load_checkpoint(comm=)", lambda: hpcasync.load_checkpoint(
        where, model, opt, comm=world))
    assert model.weight[-1, -1] == 5.0
    world.Barrier()
    if ctx.rank == 0:
        shutil.rmtree(where)


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    fn = {"objects": objects, "sync": sync, "ps": ps, "checkpoint": checkpoint}[what]
    fn(*args[:-1], float(args[-1]))
