"""Our DiLoCo's outer sync against torchft's ``torchft.local_sgd.DiLoCo`` on the same model, ranks
and inputs (issue 32: "ours not slower").

Each MPI rank is one torchft replica group (a ``Manager`` with a Gloo process group and its own
TCPStore; rank 0 serves the ``LighthouseServer``), as in ``tests/mpi/test_diloco.py``. With
``sync_every=1`` every step is an inner step plus an outer sync; the sync's cost is a step's time
minus a plain torch step's (measured beside them). The three take turns in REPEATS rounds of
ITERS steps; prints the medians per step and ours/torchft. Two models: LeNet (62 K parameters:
latency) and an MLP of 3.7 M parameters (bandwidth)::

    mpiexec -n 2 python experiments/probes/outer_sync.py
"""
import copy
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from hpcasync.models import build_model
from hpcasync.ssgd.diloco import DiLoCo

REPEATS, ITERS = 7, 30
comm = MPI.COMM_WORLD
torch.set_num_threads(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def outer(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def models():
    torch.manual_seed(0)
    yield "lenet", build_model("lenet", (1, 28, 28), 10), (1, 28, 28)
    torch.manual_seed(0)
    yield "mlp-3.7M", nn.Sequential(nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(),
                                    nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10)), (784,)


def make_manager(address, n, rank):
    """One torchft Manager (its Gloo group and TCPStore) per model: a Manager registers each
    fragment's state once."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    store_port = free_port()
    store = TCPStore("localhost", store_port, 1, True)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=60)), min_replica_size=n,
                      use_async_quorum=False, load_state_dict=None, state_dict=None,
                      replica_id=str(rank), store_addr="localhost", store_port=store_port,
                      rank=0, world_size=1, lighthouse_addr=address, port=free_port(),
                      timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=60),
                      connect_timeout=timedelta(seconds=60))
    return manager, store


def main():
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo as Reference

    n, rank = comm.Get_size(), comm.Get_rank()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=n) if rank == 0 else None
    address = comm.bcast(lighthouse.address() if lighthouse else None)
    g = torch.Generator().manual_seed(rank)
    rows = []
    try:
        for name, base, shape in models():
            x, y = torch.randn(32, *shape, generator=g), torch.randint(0, 10, (32,), generator=g)
            plain, ref, ours = (copy.deepcopy(base) for _ in range(3))
            plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
            ref_inner = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
            our_opt = DiLoCo(torch.optim.SGD(ours.parameters(), lr=0.01, momentum=0.9), ours,
                             comm, sync_every=1, outer_optimizer=outer)
            times = {"torch": [], "torchft": [], "ours": []}
            manager, store = make_manager(address, n, rank)

            def run(model, opt, key):
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(ITERS):
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                times[key].append((time.perf_counter() - t0) / ITERS)

            try:
                with Reference(manager, [ref], ref_inner, [outer(ref.parameters())],
                               sync_every=1):
                    for _ in range(REPEATS):
                        run(plain, plain_opt, "torch")
                        run(ref, ref_inner, "torchft")
                        run(ours, our_opt, "ours")
            finally:
                manager.shutdown(wait=False)
                del store
            med = {k: statistics.median(v) for k, v in times.items()}
            params = sum(p.numel() for p in base.parameters())
            rows.append((name, params, med))
    finally:
        comm.Barrier()
        if lighthouse is not None:
            lighthouse.shutdown()
    if rank == 0:
        print(f"load average {os.getloadavg()[0]:.2f}, {n} ranks, {REPEATS} x {ITERS} steps, "
              "sync every step, medians per step:")
        for name, params, m in rows:
            s_ft, s_ours = m["torchft"] - m["torch"], m["ours"] - m["torch"]
            print(f"  {name} ({params} params): torch {1e3 * m['torch']:.2f} ms, torchft "
                  f"{1e3 * m['torchft']:.2f} ms, ours {1e3 * m['ours']:.2f} ms; the sync: "
                  f"torchft {1e3 * s_ft:.2f} ms, ours {1e3 * s_ours:.2f} ms "
                  f"(ours/torchft {s_ours / s_ft:.2f})")


if __name__ == "__main__":
    main()
