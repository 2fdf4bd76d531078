"""Your own model, your own numpy arrays, your own loop; any of hpcasync's 14 algorithms.

Two models a user writes (``ConvBN``: conv + BatchNorm; ``RowGRU``: a GRU reading image rows),
trained from plain numpy arrays (here Fashion-MNIST, taken out of hpcasync as numpy: from then on
only numpy and ``torch.from_numpy``, as with your own ``.npy`` files). It also shows the metrics
stream (``hpcasync.open_metrics``) and checkpoints (``hpcasync.save_checkpoint`` / ``load_checkpoint``,
one call on every rank for every family: a run started again with the same ``--checkpoint-dir``
resumes after its last finished epoch; a PS's server continues its clock and warm-up)::

    mpiexec -n 4 python examples/own_model_numpy.py --algorithm ssgd --model convbn
    mpiexec -n 4 python examples/own_model_numpy.py --algorithm dcasgd-a --model gru \\
        --train-limit 12000 --metrics run.jsonl --checkpoint-dir ckpt --result run.json

The same model and data through the command line (``images`` and ``convbn`` below are the
factories ``hpcasync train`` takes; examples/RESULTS.md compares the two for every algorithm)::

    mpiexec -n 4 hpcasync train --algorithm ssgd --model examples/own_model_numpy.py:convbn \\
        --dataset examples/own_model_numpy.py:images --train-limit 12000
"""
import argparse
import json
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import hpcasync

# Each algorithm's own hyperparameters beyond lr, momentum and weight decay (which come from the
# torch SGD): the command line's defaults, except DASO without its blocking warm-up/cool-down
# epochs and OD-SGD with 50 SSGD warm-up steps instead of 200 (so short runs use the one-step delay).
HYPER = {
    "ssgd": {}, "daso": {"warmup_epochs": 0, "cooldown_epochs": 0}, "odsgd": {"warmup_iters": 50},
    "asgd": {}, "dcasgd": {}, "dcasgd-a": {}, "lcasgd": {}, "shat": {}, "shat-root": {},
    "ensemble": {}, "asp": {}, "smega2": {}, "dana": {}, "nag": {}, "rennala": {}, "ringmaster": {},
    "asgd-da": {},
}
SYNC = ("ssgd", "daso", "odsgd")          # every rank trains; the others: rank 0 serves


class ConvBN(nn.Module):
    """Two blocks of conv3x3 (no bias) + BatchNorm + ReLU + max-pool (16, 32 channels), then a
    Linear layer. Input (N, C, H, W)."""

    def __init__(self, channels, height, width, num_classes):
        super().__init__()
        layers = []
        for cin, cout in ((channels, 16), (16, 32)):
            layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                       nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(32 * (height // 4) * (width // 4), num_classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class RowGRU(nn.Module):
    """A GRU reading an image row by row (H steps of W pixels); its last hidden state goes through
    a Linear layer. Input (N, 1, H, W) or (N, H, W)."""

    def __init__(self, width, num_classes, hidden=64):
        super().__init__()
        self.gru = nn.GRU(width, hidden, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        _, h = self.gru(x.reshape(x.shape[0], -1, x.shape[-1]))
        return self.head(h[-1])


# -- factories, for `hpcasync train --model FILE.py:convbn --dataset FILE.py:images` -------------

def convbn(input_shape, num_classes):
    return ConvBN(*input_shape, num_classes)


def gru(input_shape, num_classes):
    return RowGRU(input_shape[-1], num_classes)


def load_arrays(name="fashion-mnist"):
    """(x_train, y_train, x_test, y_test) as numpy: float32 (N, 1, 28, 28) normalised images,
    int64 labels. Replace this with ``np.load`` of your own files."""
    from hpcasync.data import load_dataset

    train, test = load_dataset(name)
    return (train.images.numpy(), train.labels.numpy(), test.images.numpy(), test.labels.numpy())


def images():
    """The arrays of :func:`load_arrays` as (train, test) TensorDatasets."""
    from torch.utils.data import TensorDataset

    xtr, ytr, xte, yte = load_arrays()
    return (TensorDataset(torch.from_numpy(xtr), torch.from_numpy(ytr)),
            TensorDataset(torch.from_numpy(xte), torch.from_numpy(yte)))


# -- the script ------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algorithm", default="ssgd", choices=list(HYPER))
    p.add_argument("--model", default="convbn", choices=("convbn", "gru"))
    p.add_argument("--dataset", default="fashion-mnist", help="or fashion-mnist-mini")
    p.add_argument("--train-limit", type=int, default=None, help="use the first N training images")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks-per-node", type=int, default=None, help="DASO: virtual node size")
    p.add_argument("--metrics", default=None, help="JSONL metrics stream (root rank)")
    p.add_argument("--checkpoint-dir", default=None, help="checkpoint each epoch; resume if any")
    p.add_argument("--result", default=None, help="write the final accuracy etc. as JSON here")
    args = p.parse_args()
    t0 = time.time()
    alg = args.algorithm
    ctx = hpcasync.init(alg, ranks_per_node=args.ranks_per_node, seed=args.seed)

    xtr, ytr, xte, yte = load_arrays(args.dataset)
    xtr, ytr = xtr[:args.train_limit], ytr[:args.train_limit]
    per_shard = len(xtr) // ctx.num_shards                   # equal shards: equal batch counts
    steps = per_shard // args.batch_size

    torch.manual_seed(args.seed)
    factory = convbn if args.model == "convbn" else gru
    model = factory(xtr.shape[1:], int(ytr.max()) + 1).to(ctx.device)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    hyper = dict(HYPER[alg])
    if alg not in ("ssgd", "odsgd"):     # DASO's phases, the PS's epoch clock (warm-up) by epoch
        hyper.update(epochs=args.epochs, steps_per_epoch=steps)
    opt = hpcasync.optimizer(alg, model, sgd, **hyper)        # collective
    start = 0                                                # epochs done (a resumed run)
    if args.checkpoint_dir:     # every rank, not collective; None (said in the log): a fresh start
        state = hpcasync.load_checkpoint(args.checkpoint_dir, model, opt)   # PS: server and
        start = state["epoch"] if state else 0                # workers each take their part
        if start and ctx.is_root:
            print(f"resuming after epoch {start} from {args.checkpoint_dir}", flush=True)
    metrics = hpcasync.open_metrics(args.metrics, roles=ctx)   # the root rank writes it

    def on_epoch(epoch, model):          # PS: the server, at each crossing (its clock resumes)
        metrics.write("epoch", epoch=epoch, test_accuracy=correct(model, 0, 1) / len(xte),
                      wall_time_s=round(time.time() - t0, 3))

    def correct(model, rank, size):
        """How many of slice ``rank`` of ``size`` of the test set ``model`` gets right."""
        lo, hi = len(xte) * rank // size, len(xte) * (rank + 1) // size
        model.eval()
        with torch.no_grad():
            out = model(torch.from_numpy(xte[lo:hi]).to(ctx.device))
        model.train()
        return int((out.argmax(1).cpu() == torch.from_numpy(yte[lo:hi])).sum())

    if ctx.is_server:
        opt.serve(on_epoch=on_epoch if args.metrics else None)   # writes the workers' checkpoints
    else:
        for epoch in range(start + 1, args.epochs + 1):
            rng = np.random.default_rng([args.seed, epoch])  # same permutation on every rank
            perm = rng.permutation(len(xtr))
            shard = perm[ctx.shard_index * per_shard:(ctx.shard_index + 1) * per_shard]
            total = 0.0
            for b in range(steps):
                idx = shard[b * args.batch_size:(b + 1) * args.batch_size]
                x = torch.from_numpy(xtr[idx]).to(ctx.device)
                y = torch.from_numpy(ytr[idx]).to(ctx.device)
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                if alg == "lcasgd":
                    opt.step(loss=loss)                      # LC-ASGD predicts the loss from these
                else:
                    opt.step()
                total += loss.item()
            if alg == "daso":
                opt.epoch_end(total / steps)
            if alg in SYNC:
                train_loss = ctx.topology.world.allreduce(total / steps) / ctx.size
                metrics.write("epoch", epoch=epoch, train_loss=train_loss,
                              wall_time_s=round(time.time() - t0, 3))
            if args.checkpoint_dir:      # every family the same; PS: the workers ask the server
                hpcasync.save_checkpoint(args.checkpoint_dir, model, opt, epoch=epoch)
        if alg not in ("ssgd", "daso"):
            opt.finish()                  # OD-SGD: the last round in; PS: the server's final θ
    # every rank holds the same final model now: each scores a slice, the counts are summed
    acc = ctx.topology.world.allreduce(correct(model, ctx.rank, ctx.size)) / len(xte)
    wall = time.time() - t0
    result = {"accuracy": round(acc, 4), "algorithm": alg, "model": args.model,
              "epochs": args.epochs, "wall_time_s": round(wall, 2), "train_size": len(xtr),
              "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
              "world_size": ctx.size}
    metrics.write("summary", test_accuracy=acc, **{k: v for k, v in result.items()
                                                   if k not in ("accuracy",)})
    metrics.close()
    if ctx.is_root:
        print(f"final test accuracy: {acc:.4f}", flush=True)
        if args.result:
            with open(args.result, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
