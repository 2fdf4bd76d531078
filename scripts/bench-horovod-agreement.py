"""The cost of hpcasync.horovod's per-step agreement exchange: the facade's DistributedOptimizer
step with the exchange on and off (HPCASYNC_HOROVOD_AGREE), interleaved step by step in one run
so that a busy machine loads both alike. Run: mpiexec -n 2 python scripts/bench-horovod-agreement.py
"""
import os
import sys
import time

import torch

import hpcasync.horovod as hvd
from hpcasync.models import build_model

hvd.init()
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
for name, batch in (("lenet", 64), ("resnet20", 32)):
    shape = (1, 28, 28) if name == "lenet" else (3, 32, 32)
    runs = {}
    for mode in ("on", "off"):
        torch.manual_seed(0)
        model = build_model(name, shape, 10)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters())
        runs[mode] = (model, opt)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    times = {"on": [], "off": []}
    for step in range(steps + 3):
        for mode in ("on", "off") if step % 2 else ("off", "on"):
            os.environ["HPCASYNC_HOROVOD_AGREE"] = "1" if mode == "on" else "0"
            model, opt = runs[mode]
            hvd.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if step >= 3:
                times[mode].append(time.perf_counter() - t0)
    os.environ["HPCASYNC_HOROVOD_AGREE"] = "1"
    med = {m: sorted(t)[len(t) // 2] * 1e3 for m, t in times.items()}
    if hvd.rank() == 0:
        print(f"{name}: {hvd.size()} ranks, median step with agreement {med['on']:.2f} ms, "
              f"without {med['off']:.2f} ms, cost {100 * (med['on'] / med['off'] - 1):+.1f} %",
              flush=True)
