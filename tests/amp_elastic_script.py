"""SSGD with a ``torch.amp.GradScaler`` in Horovod's pattern (``synchronize``, ``unscale_``,
``scaler.step`` inside ``skip_synchronize``, ``update``) under ``@hpcasync.elastic.run``, run by
tests/mpi/reliability/test_elastic_grow.py (4 ranks, ULFM, grow-back). The scale grows every
2 steps, so a replacement's own scaler would hold another scale than the survivors'. ``--kill-at
S``: rank 1 SIGKILLs itself before step S; ``--untracked``: the scaler is left out of the
``State``. Each rank writes ``r<rank>.json`` (the parameters' digest and the scale) to ``--out``.
"""
import argparse
import hashlib
import json
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import hpcasync

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--untracked", action="store_true")
args = parser.parse_args()
ctx = hpcasync.init("ssgd", seed=0)
me = ctx.rank
kill_at = -1 if hpcasync.elastic.is_joiner() else args.kill_at
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = hpcasync.optimizer("ssgd", model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
state = hpcasync.elastic.State(model=model, optimizer=opt, step=0,
                               **({} if args.untracked else {"scaler": scaler}))


@hpcasync.elastic.run
def train(state):
    while state.step < 12:
        if me == 1 and state.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(1000 * state.step + state.rank)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        state.step += 1
        if state.step % 2 == 0:
            state.commit()


train(state)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
Path(args.out, f"r{state.rank}.json").write_text(json.dumps(
    {"size": state.size, "params": digest.hexdigest(), "scale": scaler.get_scale()}))
