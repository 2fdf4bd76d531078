"""Your own loop that survives a dead rank: ``hpcasync.elastic`` (Horovod's elastic shape).

    mpirun --with-ft ulfm -n 4 python examples/train_mnist_elastic.py --epochs 2
    mpirun --with-ft ulfm -n 4 python examples/train_mnist_elastic.py --algorithm odsgd
    mpirun --with-ft ulfm -n 4 python examples/train_mnist_elastic.py --algorithm daso \
        --ranks-per-node 2
    mpirun --with-ft ulfm -n 4 python examples/train_mnist_elastic.py --algorithm smega2

DASO (two virtual nodes of 2 ranks): the first epoch cycles (nodes drift apart between global
merges), the last one is blocking; it counts each epoch's batches from the sampler and closes
each epoch with ``opt.epoch_end(loss)``.

Kill one rank (``kill -9``) while it trains: the survivors roll back to the last commit, shrink
the world, re-deal the rest of the epoch over themselves and go on; the script ends with exit 0.
With ``mpirun -x HPCASYNC_GROW_BACK=1 ...`` they then spawn a replacement running this script,
which takes the dead rank's number and the survivors' state: the run goes on with 4 ranks.
Without ``--with-ft ulfm`` a death ends the job within 30 s with one line.

A parameter-server algorithm (asgd, smega2, shat, ...: rank 0 serves inside ``train``, the
others push): a dead worker is retired by the server and the others never stop; at the end the
survivors take the server's final model over the shrunk world (``state.ft.failures`` records the
death, ``absorbed``). The dead worker's rest of its shard is not trained, unless the job grows
back (``-x HPCASYNC_GROW_BACK=1``): then the server spawns a replacement, stops the workers after
their current push, and the replacement goes on from the dead worker's last commit the server
took (each worker's commit is sent to the server); a rank dead before the server's set-up is
replaced too (from the start of its shard). A dead server (or, with ``--ps-ranks 2``, a dead
shard server) is taken over by the worker holding the newest reply (not grown back).

Without ULFM, ``--checkpoint-dir DIR`` writes the commits to DIR (``State.persist``) and a run
started again goes on from the newest: ``hpcasync launch -n 4 --max-restarts 2 --
examples/train_mnist_elastic.py --checkpoint-dir ckpt`` restarts the job after a death.

Testing hooks (tests/mpi/reliability/test_loop_elastic.py, test_restarts.py): ``--kill-rank R
--kill-at N`` makes world rank R SIGKILL itself (comma-separated lists: several ranks, each at
its N) before its N-th step (counted from 0; N = the steps of the whole run: after its last step,
before ``train`` returns; N = -1: after loading the data, before the optimizer's first
broadcast); ``--out DIR`` writes, on each survivor, ``DIR/rank<R>.json`` (final size, reset
sizes, steps executed and committed, a digest of the parameters, and one in each reset callback,
before the sync, with one of the local model a SHAT/ENSEMBLE worker goes on from; ``joined``: a
replacement; written by a replacement too, under the dead rank's number, which it took) and on
every rank
``DIR/windows<R>.jsonl``: at each commit, the data indices this rank trained on since the
previous commit, with the sampler's position before and after, the resets so far and a digest of
the parameters. A replacement and a restart (``HPCASYNC_RESTART_COUNT`` > 0) ignore
``--kill-rank``.
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

import hpcasync
from hpcasync import registry
from hpcasync.data import load_dataset

parser = argparse.ArgumentParser()
parser.add_argument("--algorithm", default="ssgd", choices=sorted(hpcasync.algorithms()))
parser.add_argument("--ranks-per-node", type=int, default=None, help="virtual nodes (DASO)")
parser.add_argument("--daso-global-skip", type=int, default=1, help="DASO: batches between global "
                    "sends while cycling")
parser.add_argument("--odsgd-warmup", type=int, default=4, help="OD-SGD's SSGD warm-up steps")
parser.add_argument("--powersgd-rank", type=int, default=0, help="SSGD: PowerSGD of this rank "
                    "after 2 plain steps (0: no compression)")
parser.add_argument("--ps-ranks", type=int, default=1, help="a parameter server's shard servers")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--commit-every", type=int, default=2, help="steps between commits")
parser.add_argument("--lr-decay", type=float, default=None,
                    help="an LR scheduler: the lr times this factor after each step")
parser.add_argument("--limit", type=int, default=384, help="training images used")
parser.add_argument("--dataset", default="fashion-mnist-mini")
parser.add_argument("--checkpoint-dir", default=None, help="write every --checkpoint-every-th "
                    "commit there, and go on from the newest one (restarts without ULFM: "
                    "hpcasync launch -n 4 --max-restarts 2 -- examples/train_mnist_elastic.py ...)")
parser.add_argument("--checkpoint-every", type=int, default=1, help="commits between checkpoints")
parser.add_argument("--batchnorm", action="store_true", help="a BatchNorm layer first (its running "
                    "statistics are buffers: a parameter server averages them)")
parser.add_argument("--zero-grad-after", action="store_true", help="zero the gradients after "
                    "each step instead of before (the other everyday order)")
parser.add_argument("--clip-grad", type=float, default=None, help="SSGD: clip the reduced "
                    "gradients' norm to this (Horovod's pattern: synchronize, clip, step inside "
                    "skip_synchronize)")
parser.add_argument("--out", default=None)
parser.add_argument("--kill-rank", default="", help="world ranks, comma-separated")
parser.add_argument("--kill-at", default="", help="their step counts, comma-separated")
args = parser.parse_args()
kills = dict(zip(map(int, filter(None, args.kill_rank.split(","))),
                 map(int, filter(None, args.kill_at.split(",")))))
if hpcasync.elastic.is_joiner() or int(os.environ.get("HPCASYNC_RESTART_COUNT", 0)):
    kills = {}      # a replacement takes a dead rank's number, a restart goes on from a commit:
                    # the kills name ranks and steps of the first launch

ctx = hpcasync.init(args.algorithm, seed=0, ranks_per_node=args.ranks_per_node,
                    ps_ranks=args.ps_ranks)
train_set, _ = load_dataset(args.dataset, train_limit=args.limit)
if kills.get(ctx.rank) == -1:              # testing hook: dead before the loop began
    os.kill(os.getpid(), signal.SIGKILL)
ps = args.algorithm in registry.ps_names()     # a parameter server: the workers' shards
model = nn.Sequential(nn.Flatten(), *([nn.BatchNorm1d(784)] if args.batchnorm else []),
                      nn.Linear(784, 10)).to(ctx.device)
sgd = torch.optim.SGD(model.parameters(), lr=args.lr * (1 if ps else ctx.size), momentum=0.9)
sampler = hpcasync.elastic.ElasticSampler(train_set, batch_size=args.batch_size,
                                          rank=ctx.shard_index, num_replicas=ctx.num_shards, seed=1)
hyper = {"odsgd": {"warmup_iters": args.odsgd_warmup},
         "daso": {"epochs": args.epochs, "sampler": sampler, "warmup_epochs": 0,
                  "cooldown_epochs": 1,
                  "global_skip": args.daso_global_skip},
         "ssgd": {"compress": hpcasync.PowerSGD(rank=args.powersgd_rank, start_iter=2)}
         if args.powersgd_rank else {},
         "localsgd": {"period": 2, "warmup_steps": 2},
         "slowmo": {"period": 2},
         "diloco": {"sync_every": 2}}.get(args.algorithm, {})
if ps:
    hyper = {"epochs": args.epochs, "steps_per_epoch": len(sampler) // args.batch_size}
opt = hpcasync.optimizer(args.algorithm, model, sgd, **hyper)
sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda step: args.lr_decay ** step)
         if args.lr_decay else None)      # committed with the state, restored after a death
state = hpcasync.elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0,
                               steps=0, **({"scheduler": sched} if sched else {}))
restored = (state.steps if args.checkpoint_dir and state.persist(args.checkpoint_dir,
                                                                 every=args.checkpoint_every)
            else None)                     # (the step count of the commit loaded, if any)

me, resets, executed, pending = ctx.rank, [], [0], []      # me: the rank at the start
reset_params = []                          # a digest of the parameters in each reset callback
reset_local = []                           # SHAT/ENSEMBLE workers: of their local model
reset_steps = []                           # the committed step count in each reset callback


def digest(flat=None):
    tensors = model.parameters() if flat is None else [flat]
    return hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                   for p in tensors)).hexdigest()


def on_reset():
    resets.append(state.size)
    reset_steps.append(state.steps)        # (restored: the last commit's)
    reset_params.append(digest())
    keeps = ps and not state.roles.is_server and getattr(opt, "keeps_local", False)
    reset_local.append(digest(opt.local_model()) if keeps else None)
    pending.clear()                        # trained since the last commit: rolled back
    for group in opt.param_groups:         # as Horovod's examples: lr scaled with the world
        group["lr"] = args.lr * state.size


state.register_reset_callbacks([on_reset])


def commit(before):
    state.commit()
    if args.out:
        with open(Path(args.out, f"windows{me}.jsonl"), "a") as f:
            f.write(json.dumps({"epoch": state.sampler.epoch, "start": before,
                                "end": state.sampler.processed, "size": state.size,
                                "indices": pending, "resets": len(resets),
                                "params": digest()}) + "\n")
    pending.clear()
    return state.sampler.processed


def maybe_die():
    if kills.get(me) == state.steps:
        Path(args.out, "killed").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


@hpcasync.elastic.run
def train(state):
    if state.roles.is_server:
        opt.serve()                        # until every live worker finished
        return
    before = state.sampler.processed
    for state.epoch in range(state.epoch, args.epochs):
        # the data set is in memory: the loader deals indices, the batch is sliced from tensors
        loader = DataLoader(range(len(train_set)), batch_size=args.batch_size,
                            sampler=state.sampler)
        losses = []
        for state.batch, idx in enumerate(loader, start=state.batch):
            maybe_die()
            x, y = train_set.images[idx].to(ctx.device), train_set.labels[idx].to(ctx.device)
            if not args.zero_grad_after:
                opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if args.clip_grad is not None:      # the reduced gradients, clipped, stepped
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            if args.zero_grad_after:
                opt.zero_grad()
            if sched is not None:
                sched.step()
            losses.append(loss.item())
            executed[0] += 1
            pending.extend(idx.tolist())
            state.steps += 1
            state.sampler.record_batch()
            if state.steps % args.commit_every == 0:
                before = commit(before)
        before = commit(before)            # the epoch's tail (if any) is not trained
        if args.algorithm == "daso":       # close the epoch: its rank-averaged loss drives the
            opt.epoch_end(sum(losses) / max(1, len(losses)))   # schedule (plateau)
        if args.algorithm in ("localsgd", "slowmo"):   # one model on every rank at its end
            opt.average_parameters()
        state.epoch += 1                   # (not left at the last epoch: a call after the end,
        state.batch = 0                    # when a rank dies after the last step, trains nothing)
        state.sampler.set_epoch(state.epoch)
        before = 0
        state.commit()
    maybe_die()                            # --kill-at the last step count: after training
    if ps:
        opt.finish()                       # the last push; every survivor takes the final model


train(state)
if args.algorithm in ("odsgd", "diloco"):
    opt.finish()                           # the model holds the global weights, equal everywhere
if state.rank == 0:
    print(f"done: {state.steps} steps on {state.size} ranks (resets: {resets})", flush=True)
if args.out:
    Path(args.out, f"rank{me}.json").write_text(json.dumps({
        "size": state.size, "resets": resets, "executed": executed[0], "steps": state.steps,
        "epoch": state.epoch, "params": digest(), "rank": state.rank,
        "joined": hpcasync.elastic.is_joiner(), "reset_params": reset_params,
        "reset_local": reset_local,
        "failures": state.ft.failures, "joins": state.ft.joins, "reset_steps": reset_steps,
        "served": opt.server.stats.accepted if ps and state.roles.is_server else None,
        "scheduler_steps": sched.last_epoch if sched is not None else None,
        "restored": restored}))
