"""A Horovod elastic script (``import horovod.torch as hvd`` changed to hpcasync's) that survives a
dead rank and grows back to its starting size:

    mpirun --with-ft ulfm -x HPCASYNC_GROW_BACK=1 -n 4 python examples/horovod_mnist_elastic.py

Fashion-MNIST (the built-in mini set), a linear model, ``hvd.elastic.TorchState`` with model,
optimizer, Horovod's ``ElasticSampler`` and counters, ``@hvd.elastic.run``, a reset callback that
rescales the learning rate (Horovod's examples). When a rank dies the survivors roll back to the
last commit, shrink, spawn a replacement running this script, which takes the dead rank's number;
every rank runs the reset callback and the state is broadcast from a survivor. Without
``HPCASYNC_GROW_BACK`` the run goes on with the survivors.

Testing hooks (tests/mpi/reliability/test_elastic_grow.py): ``--kill-rank R --kill-at N``: rank
R SIGKILLs itself before its N-th step (counted from 0; a replacement never does); ``--out DIR``:
every rank at the end writes ``DIR/rank<R>.json`` (R: its rank at the start — a replacement's is
the dead rank's — with the final size and rank, the sizes its reset callback saw, steps executed
and committed, a digest of the parameters, ``joined``) and at each commit appends to
``DIR/windows<R>.jsonl`` the sample indices it trained since the previous commit.
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
parser.add_argument("--out", default=None)
parser.add_argument("--kill-rank", type=int, default=-1)
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--commit-every", type=int, default=2)
parser.add_argument("--limit", type=int, default=384)
parser.add_argument("--lr", type=float, default=0.01)
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
train_set, _ = load_dataset("fashion-mnist-mini", train_limit=args.limit)
model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(range(len(train_set)), shuffle=True, seed=1)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0, steps=0)

me, resets, executed, pending = hvd.rank(), [], [0], []
joined = hvd.elastic.is_joiner()          # hpcasync's: a replacement (takes a dead rank's number)


def on_reset():
    resets.append(hvd.size())
    pending.clear()                          # trained since the last commit: rolled back
    for group in optimizer.param_groups:     # Horovod's examples rescale the lr
        group["lr"] = args.lr * hvd.size()


state.register_reset_callbacks([on_reset])


def commit(before):
    state.commit()
    if args.out:
        with open(Path(args.out, f"windows{me}.jsonl"), "a") as f:
            f.write(json.dumps({"epoch": state.sampler.epoch, "start": before,
                                "end": state.sampler.processed_num, "size": hvd.size(),
                                "indices": pending}) + "\n")
    pending.clear()
    return state.sampler.processed_num


@hvd.elastic.run
def train(state):
    before = state.sampler.processed_num
    for state.epoch in range(state.epoch, args.epochs):
        loader = DataLoader(range(len(train_set)), batch_size=args.batch_size,
                            sampler=state.sampler)
        for state.batch, idx in enumerate(loader, start=state.batch):
            if me == args.kill_rank and state.steps == args.kill_at and not joined:
                Path(args.out, "killed").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            F.cross_entropy(model(train_set.images[idx]), train_set.labels[idx]).backward()
            optimizer.step()
            executed[0] += 1
            pending.extend(idx.tolist())
            state.steps += 1
            state.sampler.record_batch(state.batch, args.batch_size)
            if state.steps % args.commit_every == 0:
                before = commit(before)
        before = commit(before)
        state.epoch += 1                     # a call after the end trains nothing
        state.batch = 0
        state.sampler.set_epoch(state.epoch)
        before = 0
        state.commit()


train(state)
if hvd.rank() == 0:
    print(f"done: {state.steps} steps on {hvd.size()} ranks (resets: {resets})", flush=True)
if args.out:
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    Path(args.out, f"rank{me}.json").write_text(json.dumps({
        "size": hvd.size(), "rank": hvd.rank(), "resets": resets, "executed": executed[0],
        "steps": state.steps, "epoch": state.epoch, "params": digest.hexdigest(),
        "joined": joined}))
