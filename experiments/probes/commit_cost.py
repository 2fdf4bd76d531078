"""What one ``State.commit()`` per step costs a parameter server's worker in your own loop.

The CLI's parameter server on :class:`hpcasync.elastic.State` (docs/design/one-road.md, "The PS
driver") would commit every worker's state each step. This runs LeNet on 4,096 Fashion-MNIST
images (batch 32, 2 epochs, ``torch.optim.SGD(lr=0.01)``) through ``hpcasync.optimizer(ALG)``
and ``@hpcasync.elastic.run``, commits every EVERY steps (a large EVERY: never), and prints each
worker's wall time, its commits and their mean time::

    mpirun -n 3 python experiments/probes/commit_cost.py asgd 1
    mpirun -n 3 python experiments/probes/commit_cost.py asgd 100000
"""
import sys
import time

import torch
import torch.nn.functional as F

import hpcasync
from hpcasync.data import load_dataset
from hpcasync.models import build_model

alg, every = sys.argv[1], int(sys.argv[2])
ctx = hpcasync.init(alg, seed=0)
train, _ = load_dataset("fashion-mnist-mini", train_limit=4096)
torch.manual_seed(0)
model = build_model("lenet", (1, 28, 28), 10)
sampler = hpcasync.elastic.ElasticSampler(train, batch_size=32, rank=ctx.shard_index,
                                          num_replicas=ctx.num_shards, seed=1)
opt = hpcasync.optimizer(alg, model, torch.optim.SGD(model.parameters(), lr=0.01), epochs=2,
                         steps_per_epoch=len(sampler) // 32)
state = hpcasync.elastic.State(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0)
spent = [0.0, 0]


@hpcasync.elastic.run
def run(state):
    if state.roles.is_server:
        opt.serve()
        return
    for state.epoch in range(state.epoch, 2):
        loader = torch.utils.data.DataLoader(range(len(train)), batch_size=32,
                                             sampler=state.sampler)
        for state.batch, idx in enumerate(loader, start=state.batch):
            opt.zero_grad()
            F.cross_entropy(model(train.images[idx]), train.labels[idx]).backward()
            opt.step()
            state.sampler.record_batch(state.batch, 32)
            if (state.batch + 1) % every == 0:
                t = time.perf_counter()
                state.commit()
                spent[0] += time.perf_counter() - t
                spent[1] += 1
        state.sampler.set_epoch(state.epoch + 1)
        state.batch = 0
    opt.finish()


t0 = time.perf_counter()
run(state)
wall = time.perf_counter() - t0
if not state.roles.is_server:
    print(f"rank {ctx.rank} {alg} commit every {every}: wall {wall:.3f} s, {spent[1]} commits, "
          f"{1e3 * spent[0] / max(1, spent[1]):.3f} ms each, {100 * spent[0] / wall:.1f} % of "
          "the wall", flush=True)
