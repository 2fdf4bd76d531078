"""The Python cost of ``hpcasync.comm.allreduce`` over a bare mpi4py ``MPI_Allreduce``.

A tight loop of in-place 4 KiB float32 sums (where ``auto`` chooses MPI, so both make the same
collective call), the two taking turns in 20 repeats of 2000 calls; prints the medians. Used in
experiments/results/allreduce.md (issue 25: 5.03 µs bare, 6.39 µs ours at 2 ranks)::

    HPCASYNC_TUNE_FILE=/tmp/tune.json mpiexec --oversubscribe -n 2 python experiments/probes/allreduce_overhead.py
"""
import statistics
import time

import torch
from mpi4py import MPI

from hpcasync.comm import allreduce

comm = MPI.COMM_WORLD
t = torch.ones(1024)
a = t.numpy()


def bare():
    comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)


def ours():
    allreduce(comm, t, average=False)


for f in (bare, ours):
    for _ in range(2000):
        f()
res = {"bare": [], "ours": []}
for rep in range(20):
    order = (("bare", bare), ("ours", ours)) if rep % 2 == 0 else (("ours", ours), ("bare", bare))
    for name, f in order:
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(2000):
            f()
        res[name].append((time.perf_counter() - t0) / 2000 * 1e6)
if comm.rank == 0:
    b, o = statistics.median(res["bare"]), statistics.median(res["ours"])
    print(f"4 KiB: bare {b:.2f} us, ours {o:.2f} us, ours/MPI (time ratio) {b / o:.3f}")
