"""Your own loop under ``@hpcasync.elastic.run`` averaging a metric each step, run by
tests/mpi/reliability/test_stale_world.py (4 ranks, ULFM): rank 3 SIGKILLs itself before its
3rd step. ``--metric``: ``roles`` (``hpcasync.average_metric(x, state.roles)``: the current
world, survives), ``ctx`` (the roles of ``hpcasync.init``: the world before the reset) or
``world`` (``MPI.COMM_WORLD.allreduce``); ``--mpi4py-first`` imports ``mpi4py.MPI`` before
hpcasync; ``--untracked-optimizer`` leaves the optimizer out of the ``State``. Each survivor
prints ``done <rank> <size>``.
"""
import argparse
import os
import signal
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--metric", choices=("roles", "ctx", "world"), required=True)
parser.add_argument("--mpi4py-first", action="store_true")
parser.add_argument("--untracked-optimizer", action="store_true")
args = parser.parse_args()
if args.mpi4py_first:
    from mpi4py import MPI as _first  # noqa: F401

import torch                                                # noqa: E402
import torch.nn.functional as F                             # noqa: E402

import hpcasync                                             # noqa: E402

ctx = hpcasync.init("ssgd")
from mpi4py import MPI                                      # noqa: E402

torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = hpcasync.optimizer("ssgd", model, torch.optim.SGD(model.parameters(), lr=0.1))
state = hpcasync.elastic.State(model=model, step=0, **({} if args.untracked_optimizer else
                                                        {"optimizer": opt}))


@hpcasync.elastic.run
def train(state):
    while state.step < 8:
        if ctx.rank == 3 and state.step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(state.step)
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if args.metric == "world":
            MPI.COMM_WORLD.allreduce(loss.item())
        else:
            hpcasync.average_metric(loss.item(), state.roles if args.metric == "roles" else ctx)
        state.step += 1
        state.commit()


train(state)
print(f"done {ctx.rank} {state.size}", file=sys.stderr, flush=True)
