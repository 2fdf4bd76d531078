"""Probe: one training step of a plain model vs the same model with its gradients in one flat
buffer (``FlatModel``, as every hpcasync algorithm), in one process, with and without hpcasync's
allocator tuning (``hpcasync/runtime/malloc.py``). Quoted in ``experiments/results/ssgd.md``.

    python experiments/probes/flat_step.py resnet20            # glibc's defaults
    python experiments/probes/flat_step.py resnet20 --tune     # mallopt as hpcasync sets it

Each variant is its own replica (same seed, same batch); the variants take turns in a rotated
order (so no variant always runs first), one torch thread; prints the median ms per step.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hpcasync.comm.flat import FlatModel
from hpcasync.models import build_model

ap = argparse.ArgumentParser()
ap.add_argument("model", nargs="?", default="resnet20")
ap.add_argument("--tune", action="store_true")
ap.add_argument("--rounds", type=int, default=40)
args = ap.parse_args()
if args.tune:
    from hpcasync.runtime.malloc import tune_malloc
    print("allocator tuned:", tune_malloc())
torch.set_num_threads(1)
x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))


def replica():
    torch.manual_seed(0)
    return build_model(args.model, (1, 28, 28), 10)


def plain():
    m = replica()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    return m, opt, opt.zero_grad


def flat():
    m = replica()
    f = FlatModel(m)
    return m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), f.zero_grad


def grad_views():                        # plain parameters, gradients as views of one buffer
    m = replica()
    ps = list(m.parameters())
    buf, o = torch.zeros(sum(p.numel() for p in ps)), 0
    for p in ps:
        p.grad = buf[o:o + p.numel()].view_as(p)
        o += p.numel()
    return m, torch.optim.SGD(ps, lr=0.01, momentum=0.9), buf.zero_


variants = {"plain": plain(), "flatmodel": flat(), "grad-views": grad_views()}
names, times = list(variants), {k: [] for k in variants}


def step(name):
    m, opt, zero = variants[name]
    zero()
    F.cross_entropy(m(x), y).backward()
    opt.step()


for name in names:
    step(name), step(name)
for r in range(args.rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
        t0 = time.perf_counter()
        step(name)
        times[name].append(time.perf_counter() - t0)
base = statistics.median(times["plain"])
for name in names:
    t = statistics.median(times[name])
    print(f"{args.model} {name:11s} {t * 1e3:7.2f} ms/step  x{t / base:.3f} of plain")
