"""A Horovod elastic training script (``import horovod.torch as hvd`` changed to hpcasync's), run
by tests/mpi/reliability/test_horovod_elastic.py: Fashion-MNIST (the built-in mini set), a linear
model, ``TorchState`` with model, optimizer, sampler and counters, ``@hvd.elastic.run``.

    mpirun --with-ft ulfm -n 4 python tests/horovod_elastic_script.py --out DIR --kill-rank 3 --kill-at 3

Rank ``--kill-rank`` SIGKILLs itself before its ``--kill-at``-th step (counted from 0; not in a
restart by ``hpcasync launch``, which ``--checkpoint-dir``, ``state.persist``, resumes); each
survivor writes ``DIR/rank<original rank>.json``: the final size, the sizes its reset callback saw,
the steps it executed, the state's step count and a digest of its parameters.
"""
import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import hpcasync.horovod as hvd
from hpcasync.data import load_dataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--kill-rank", type=int, default=-1)
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--commit-every", type=int, default=2)
parser.add_argument("--limit", type=int, default=384)
parser.add_argument("--checkpoint-dir", default=None, help="state.persist: restarts without ULFM")
parser.add_argument("--algorithm", default=None, help="DistributedOptimizer(algorithm=...)")
parser.add_argument("--compress", default=None, help="DistributedOptimizer(compress=...)")
args = parser.parse_args()
if int(os.environ.get("HPCASYNC_RESTART_COUNT", 0)):    # a restart (hpcasync launch): the kill
    args.kill_rank = -1                                 # names a step of the first attempt

hvd.init()
torch.manual_seed(0)
train_set, _ = load_dataset("fashion-mnist-mini", train_limit=args.limit)
model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
ours = {k: v for k, v in (("algorithm", args.algorithm), ("compress", args.compress)) if v}
if args.compress == "powersgd":
    from hpcasync import PowerSGD

    ours["compress"] = PowerSGD(rank=1)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     **ours)
sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=1)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0, steps=0)
restored = (state.steps if args.checkpoint_dir and state.persist(args.checkpoint_dir)
            else None)

me, resets, executed = hvd.rank(), [], [0]


def on_reset():
    resets.append(hvd.size())
    for group in optimizer.param_groups:          # Horovod's examples rescale the lr
        group["lr"] = 0.01 * hvd.size()


state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, args.epochs):
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=state.sampler)
        for state.batch, (x, y) in enumerate(loader, start=state.batch):
            if me == args.kill_rank and state.steps == args.kill_at:
                Path(args.out, "killed").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            executed[0] += 1
            state.steps += 1
            state.sampler.record_batch(state.batch, args.batch_size)
            if state.steps % args.commit_every == 0:
                state.commit()
        state.batch = 0
        state.sampler.set_epoch(state.epoch + 1)
        state.commit()


train(state)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
Path(args.out, f"rank{me}.json").write_text(json.dumps({
    "size": hvd.size(), "resets": resets, "executed": executed[0], "steps": state.steps,
    "epoch": state.epoch, "params": digest.hexdigest(), "restored": restored}))
