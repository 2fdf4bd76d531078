"""The comm layer's device staging on a GPU (run under ``mpiexec -n 2`` or more, on a machine with
CUDA): every reduction of a CUDA tensor -- blocking and nonblocking, MPI and the shared-memory
window, bf16 and fp16 compression, the hierarchical allreduce -- equals the same reduction of the
tensor's CPU copy, and leaves its result on the device. Prints one line per case and ends
non-zero on any mismatch.

    mpiexec -n 2 python experiments/probes/gpu_comm_check.py
"""
import os
import sys

import torch
from mpi4py import MPI

from hpcasync.comm import allreduce, hierarchical_allreduce, iallreduce
from hpcasync.topology import Topology

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
device = torch.device(os.environ.get("HPCASYNC_PROBE_DEVICE", "cuda:0"))   # cpu: a dry run
gen = torch.Generator().manual_seed(rank)
host = torch.randn(1_000_003, generator=gen)
bad = 0
cases = [("mpi", {"algorithm": "mpi"}), ("window", {"algorithm": "shm"}),
         ("auto", {}), ("bf16", {"compress": "bf16"}), ("fp16", {"compress": "fp16"})]
for name, kw in cases:
    for blocking in (True, False):
        ref = allreduce(comm, host.clone(), average=True, **kw)
        x = host.to(device)
        out = (allreduce(comm, x, average=True, **kw) if blocking
               else iallreduce(comm, x, average=True, **kw).wait())
        ok = out.device == x.device and out.data_ptr() == x.data_ptr() and \
            torch.equal(out.cpu(), ref)
        bad += not ok
        if rank == 0:
            print(f"{name:6s} {'blocking' if blocking else 'nonblocking'}: "
                  f"{'equal to the CPU reduction' if ok else 'MISMATCH'}", flush=True)
if size % 2 == 0:
    topo = Topology.build(comm, ranks_per_node=size // 2, device="cpu")
    ref = hierarchical_allreduce(topo, host.clone(), average=True)
    out = hierarchical_allreduce(topo, host.to(device), average=True)
    ok = out.device == device and torch.equal(out.cpu(), ref)
    bad += not ok
    if rank == 0:
        print(f"hierarchical ({topo.num_nodes}x{topo.local_size}): "
              f"{'equal to the CPU reduction' if ok else 'MISMATCH'}", flush=True)
    topo.free()
bad = comm.allreduce(bad)
if rank == 0:
    print(f"{bad} mismatch(es)")
sys.exit(1 if bad else 0)
