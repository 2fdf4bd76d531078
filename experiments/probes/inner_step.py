"""The inner step of ``localsgd`` and ``diloco`` against the plain torch step it wraps.

One training iteration (``zero_grad``, forward, backward, ``step``) of LeNet on a batch of 32
Fashion-MNIST-shaped images, with ``torch.optim.SGD(lr=0.05, momentum=0.9)`` alone and wrapped
as ``hpcasync.optimizer("localsgd", ..., period=10**9, warmup_steps=0)`` and ``("diloco", ...,
sync_every=10**9)`` (no average and no outer sync in the timed steps: the inner step only). The
three take turns in 15 repeats of 200 iterations; prints the medians and the ratios to plain
torch, and ``step()`` alone timed the same way. Issue 32 asks for ≤ 1.02x. One process per rank,
each timing its own (the ranks never communicate in these steps)::

    mpiexec -n 2 python experiments/probes/inner_step.py
"""
import os
import statistics
import time

import torch
import torch.nn.functional as F

import hpcasync
from hpcasync.models import build_model

REPEATS, ITERS = 15, 200
ctx = hpcasync.init("ssgd", threads=1)
gen = torch.Generator().manual_seed(0)
x, y = torch.randn(32, 1, 28, 28, generator=gen), torch.randint(0, 10, (32,), generator=gen)


def make(kind):
    torch.manual_seed(0)
    model = build_model("lenet", (1, 28, 28), 10)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "torch":
        return model, sgd
    if kind == "localsgd":
        return model, hpcasync.optimizer("localsgd", model, sgd, period=10**9, warmup_steps=0)
    return model, hpcasync.optimizer("diloco", model, sgd, sync_every=10**9)


runs = {k: make(k) for k in ("torch", "localsgd", "diloco")}
whole = {k: [] for k in runs}
step = {k: [] for k in runs}
for _ in range(REPEATS):
    for kind, (model, opt) in runs.items():
        t_step = 0.0
        t0 = time.perf_counter()
        for _ in range(ITERS):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            s0 = time.perf_counter()
            opt.step()
            t_step += time.perf_counter() - s0
        whole[kind].append((time.perf_counter() - t0) / ITERS)
        step[kind].append(t_step / ITERS)
if ctx.rank == 0:
    print(f"load average {os.getloadavg()[0]:.2f}, {ctx.size} ranks, {REPEATS} x {ITERS} "
          "iterations, medians:")
    base_w, base_s = statistics.median(whole["torch"]), statistics.median(step["torch"])
    for kind in runs:
        w, s = statistics.median(whole[kind]), statistics.median(step[kind])
        print(f"  {kind:9s} iteration {1e6 * w:8.1f} us ({w / base_w:.3f}x)   "
              f"step() {1e6 * s:7.1f} us ({s / base_s:.3f}x)")
