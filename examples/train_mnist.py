"""Fashion-MNIST with any of hpcasync's 14 algorithms, in the shape of Horovod's PyTorch MNIST
example: the same script for every algorithm, which differs only in its name and ``HYPER`` entry.

    mpiexec -n 4 python examples/train_mnist.py --algorithm ssgd
    mpiexec -n 4 python examples/train_mnist.py --algorithm daso --ranks-per-node 2
    mpiexec -n 4 python examples/train_mnist.py --algorithm smega2    # rank 0 serves, 3 ranks train
"""
import argparse
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hpcasync
from hpcasync.data import load_dataset

# Each algorithm's own hyperparameters (lr and momentum come from the torch SGD below).
HYPER = {
    "ssgd": {},                                                   # Horovod's DistributedOptimizer
    "localsgd": {"period": 4, "warmup_steps": 10},                # post-local SGD
    "slowmo": {"period": 8},                                      # slow momentum 0.5, lr 1
    "diloco": {"sync_every": 16},                                 # outer Nesterov SGD 0.7
    "daso": {"warmup_epochs": 0, "cooldown_epochs": 0, "global_skip": 4},   # all epochs cycling
    "odsgd": {"warmup_iters": 50, "local_opt": "dc-adaptive", "lr_local": 0.5},   # on g/N
    # parameter-server algorithms: one rank serves, the others push gradients
    "asgd": {}, "shat": {}, "shat-root": {}, "ensemble": {}, "asp": {},
    "dcasgd": {"lam": 0.04}, "dcasgd-a": {"lam": 2.0}, "lcasgd": {"predictor": "linear"},
    "smega2": {"warmup_epochs": 5}, "dana": {"warmup_epochs": 5}, "nag": {"warmup_epochs": 5},
    "rennala": {}, "ringmaster": {}, "asgd-da": {},                # B, R, τ_C: the number of workers
}                                       # (smega2, dana, nag: lr warm-up from lr/N, the paper's)
SCHEDULED = set(HYPER) - {"ssgd", "localsgd", "slowmo", "diloco", "odsgd"}   # DASO, the PS

parser = argparse.ArgumentParser(description="hpcasync Fashion-MNIST example")
parser.add_argument("--algorithm", default="ssgd", choices=sorted(HYPER))
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--lr", type=float, default=None,
                    help="default hpcasync.default_lr(algorithm): 0.05, nag 0.02")
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--log-interval", type=int, default=50, help="batches between log lines")
parser.add_argument("--train-limit", type=int, default=None, help="use the first N images")
parser.add_argument("--ranks-per-node", type=int, default=None, help="DASO: virtual node size")
args = parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=5)      # 28 -> 24 -> pool 12
        self.conv2 = nn.Conv2d(8, 16, kernel_size=5)     # 12 -> 8 -> pool 4
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


ctx = hpcasync.init(args.algorithm, ranks_per_node=args.ranks_per_node, seed=args.seed)
train_set, test_set = load_dataset("fashion-mnist", train_limit=args.train_limit)
train_data = TensorDataset(train_set.images, train_set.labels)
train_sampler = DistributedSampler(train_data, num_replicas=ctx.num_shards, rank=ctx.shard_index,
                                   seed=args.seed)
train_loader = DataLoader(train_data, batch_size=args.batch_size, sampler=train_sampler)

model = Net().to(ctx.device)
lr = hpcasync.default_lr(args.algorithm) if args.lr is None else args.lr
sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
hyper = dict(HYPER[args.algorithm])
if args.algorithm in SCHEDULED:
    hyper.update(epochs=args.epochs, steps_per_epoch=len(train_loader))
opt = hpcasync.optimizer(args.algorithm, model, sgd, **hyper)   # collective; same start everywhere


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    total = 0.0
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(ctx.device), target.to(ctx.device)
        opt.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        if args.algorithm == "lcasgd":
            opt.step(loss=loss)              # LC-ASGD predicts each worker's loss from these
        else:
            opt.step()
        total += loss.item()
        if ctx.shard_index == 0 and batch_idx % args.log_interval == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                  f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}")
    return total / len(train_loader)


def test(comm, part, parts, label):
    """Ranks of ``comm`` each score part ``part`` of ``parts`` of the test set; the sums are added
    over ``comm`` (Horovod's test() with its metric allreduce)."""
    model.eval()
    lo, hi = len(test_set) * part // parts, len(test_set) * (part + 1) // parts
    with torch.no_grad():
        output = model(test_set.images[lo:hi].to(ctx.device))
        target = test_set.labels[lo:hi].to(ctx.device)
        loss = F.cross_entropy(output, target, reduction="sum").item()
        correct = (output.argmax(1) == target).sum().item()
    model.train()
    loss, correct = comm.allreduce(loss) / len(test_set), comm.allreduce(correct) / len(test_set)
    if part == 0:
        print(f"\nTest set ({label}): Average loss: {loss:.4f}, Accuracy: {100.0 * correct:.2f}%\n",
              flush=True)
    return correct


if ctx.is_server:
    opt.serve()                          # PS algorithms: this rank applies the rule to each push
else:
    for epoch in range(1, args.epochs + 1):
        epoch_loss = train(epoch)
        if args.algorithm == "daso":
            opt.epoch_end(epoch_loss)    # DASO adapts its schedule to the epoch's loss
        if args.algorithm in ("localsgd", "slowmo"):
            opt.average_parameters()     # the replicas drift apart between two averages
        if args.algorithm != "odsgd" and epoch < args.epochs:
            # evaluation inside the loop, on the ranks that train: a PS's server is inside serve(),
            # so the workers average through their own communicator (the world for ssgd/daso);
            # a PS worker's model is its latest reply (SHAT/ENSEMBLE: its own model)
            with (opt.global_weights() if args.algorithm == "diloco"     # the global model
                  else contextlib.nullcontext()):
                test(ctx.workers_comm, ctx.shard_index, ctx.num_shards, f"epoch {epoch}")
    if args.algorithm not in ("ssgd", "daso"):
        opt.finish()    # OD-SGD: complete the last round; PS: the last push; localsgd: average
# every rank now holds the same final model: each scores a slice, the counts are summed
test(ctx.topology.world, ctx.rank, ctx.size, args.algorithm)
