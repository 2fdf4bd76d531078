"""A Horovod training script — written against the ``horovod.torch`` API — run by hpcasync, with
any of its algorithms: Fashion-MNIST, a small CNN, ``hvd.DistributedOptimizer``.

    mpiexec -n 4 python examples/horovod_mnist.py                       # SSGD, as under Horovod
    mpiexec -n 4 python examples/horovod_mnist.py --algorithm daso --ranks-per-node 2
    mpiexec -n 4 python examples/horovod_mnist.py --algorithm smega2    # 1 server + 3 workers

What differs from the same script under Horovod (``import horovod.torch as hvd``):

* the import line;
* ``algorithm=`` (and the algorithm's hyperparameters) in ``hvd.DistributedOptimizer``; DASO and
  the parameter-server rules are told ``steps_per_epoch`` (DASO also ``epochs``);
* a parameter-server rule is named at ``hvd.init(algorithm=...)``: the server rank stays inside
  that call and serves; ``hvd.size()``/``hvd.rank()`` then count the workers;
* lcasgd predicts each worker's loss: ``optimizer.step(loss=loss)``.
"""
import argparse
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hpcasync.horovod as hvd
from hpcasync import algorithms
from hpcasync.api import PS_ALGORITHMS
from hpcasync.config import default_lr
from hpcasync.data import load_dataset

# hyperparameters beyond lr/momentum (taken from the SGD below) for short runs
EXTRA = {"daso": {"warmup_epochs": 0, "cooldown_epochs": 0},     # every epoch cycling
         "odsgd": {"warmup_iters": 10},                              # then the one-step delay
         "localsgd": {"warmup_steps": 10, "period": 4},              # post-local SGD
         "slowmo": {"period": 8},                                    # slow momentum 0.5
         "diloco": {"sync_every": 8, "outer_optimizer": lambda ps: torch.optim.SGD(
             ps, lr=0.4, momentum=0.9, nesterov=True)}}                 # outer: Streaming's lr

parser = argparse.ArgumentParser(description="a Horovod-API script on hpcasync")
parser.add_argument("--algorithm", default="ssgd", choices=algorithms())
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--lr", type=float, default=None, help="default: 0.05 (nag 0.02)")
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--train-limit", type=int, default=None, help="use the first N images")
parser.add_argument("--test-limit", type=int, default=None, help="test on the first N images")
parser.add_argument("--ranks-per-node", type=int, default=None, help="DASO: virtual node size")
args = parser.parse_args()
ps = args.algorithm in PS_ALGORITHMS


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=5)
        self.conv2 = nn.Conv2d(8, 16, kernel_size=5)
        self.fc1 = nn.Linear(256, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


hvd.init(algorithm=args.algorithm if ps else None, ranks_per_node=args.ranks_per_node)
torch.manual_seed(args.seed)
train_set, test_set = load_dataset("fashion-mnist", train_limit=args.train_limit)
test_n = args.test_limit or len(test_set.labels)
train_data = TensorDataset(train_set.images, train_set.labels)
test_data = TensorDataset(test_set.images[:test_n], test_set.labels[:test_n])
train_sampler = DistributedSampler(train_data, num_replicas=hvd.size(), rank=hvd.rank(),
                                   seed=args.seed, drop_last=True)
test_sampler = DistributedSampler(test_data, num_replicas=hvd.size(), rank=hvd.rank(),
                                  shuffle=False)
train_loader = DataLoader(train_data, batch_size=args.batch_size, sampler=train_sampler)
test_loader = DataLoader(test_data, batch_size=256, sampler=test_sampler)

model = Net()
lr = args.lr if args.lr is not None else default_lr(args.algorithm)
optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
extra = dict(EXTRA.get(args.algorithm, {}))
if args.algorithm == "daso" or ps:
    extra["steps_per_epoch"] = len(train_loader)
if args.algorithm == "daso":
    extra["epochs"] = args.epochs
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     algorithm=args.algorithm, **extra)


def test(epoch):
    if args.algorithm in ("localsgd", "slowmo"):   # replicas drift apart between two syncs
        optimizer.average_parameters()
    model.eval()
    correct = torch.zeros((), dtype=torch.int64)
    scored = optimizer.global_weights() if args.algorithm == "diloco" else contextlib.nullcontext()
    with torch.no_grad(), scored:           # diloco: the global model, the outer steps' result
        for x, y in test_loader:
            correct += (model(x).argmax(1) == y).sum()
    total = hvd.allreduce(correct, op=hvd.Sum, name="correct")   # DistributedSampler pads
    accuracy = 100.0 * float(total) / (len(test_sampler) * hvd.size())
    if hvd.rank() == 0:
        print(f"epoch {epoch}: test accuracy ({args.algorithm}, {hvd.size()} training ranks): "
              f"{accuracy:.2f}%", flush=True)
    return accuracy


for epoch in range(args.epochs):
    model.train()
    train_sampler.set_epoch(epoch)
    for x, y in train_loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if args.algorithm == "lcasgd":
            optimizer.step(loss=loss)
        else:
            optimizer.step()
    test(epoch)
