"""A Horovod-style script with a parameter-server algorithm (tests/mpi/test_horovod_ps.py): no
``finish()``, as in Horovod; each worker prints a digest of its final parameters, then (rank 1)
saves the model as Horovod scripts do on their first worker.

Usage: mpiexec -n 4 python tests/horovod_ps_script.py ALGORITHM EPOCHS STEPS [--no-length]
"""
import hashlib
import sys

import torch
import torch.nn.functional as F
from torch import nn

import hpcasync.horovod as hvd

algorithm, epochs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hvd.init(algorithm=algorithm)                 # the server rank serves inside and exits
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
sgd = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
length = {} if "--no-length" in sys.argv else {"epochs": epochs, "steps_per_epoch": steps}
opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                               algorithm=algorithm, **length)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
g = torch.Generator().manual_seed(hvd.rank())
for epoch in range(epochs):
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
print(f"DIGEST {hvd.rank()} {hashlib.sha256(flat.numpy().tobytes()).hexdigest()}", flush=True)
