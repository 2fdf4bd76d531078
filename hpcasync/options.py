"""The options of ``hpcasync train`` and ``hpcasync sim``, in one place.

The CLI (:mod:`hpcasync.cli`), the simulator (:mod:`hpcasync.sim.driver`) and the experiment files
(:mod:`hpcasync.experiments.spec`) build their parsers here, so none of them imports another.
"""
from __future__ import annotations

import argparse

from .errors import ConfigError


class OptionParser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one line) instead of printing usage and exiting."""

    def error(self, message: str):
        raise ConfigError(message)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    from . import registry
    from .runtime import algorithms, argument_modules

    lrs = "".join(f"; {name} {lr:g}" for name, lr in registry.algorithm_lrs().items())

    p.add_argument("--config", help="TOML or JSON file of option defaults (the command line wins)")
    p.add_argument("--algorithm", default="ssgd", help=f"one of: {', '.join(algorithms())}")
    p.add_argument("--backend", default="mpi", help="mpi (own collectives) or horovod (ssgd, daso)")
    p.add_argument("--dataset", default="fashion-mnist",
                   help="fashion-mnist, fashion-mnist-mini, mnist, cifar10, or user code "
                        "MODULE:FACTORY (pkg.module:factory or path/file.py:factory; factory() "
                        "returns (train, test) torch Datasets of (tensor, int label) items)")
    p.add_argument("--data-dir", default=None, help="directory of the data set files")
    p.add_argument("--train-limit", type=int, default=None, help="use the first N training images")
    p.add_argument("--test-limit", type=int, default=None, help="use the first N test images")
    p.add_argument("--model", default="lenet",
                   help="mlp, lenet, resnet20, or user code MODULE:FACTORY (pkg.module:factory or "
                        "path/file.py:factory; factory(input_shape, num_classes) returns an "
                        "nn.Module). Modules are imported with the working directory on sys.path")
    p.add_argument("--loss", default="cross_entropy",
                   help="cross_entropy, nll (a model ending in log_softmax), or MODULE:FACTORY "
                        "(factory() returns loss(output, target) -> scalar tensor)")
    p.add_argument("--optimizer", default="sgd",
                   help="ssgd, daso, localsgd, slowmo and diloco only: sgd, adam, adamw, rmsprop, or MODULE:FACTORY "
                        "(factory(params, lr=, momentum=, weight_decay=) returns a "
                        "torch.optim.Optimizer); given --lr, --momentum, --weight-decay as they "
                        "apply. Other algorithms use their own update rules")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=None,
                   help=f"learning rate (default {registry.DEFAULT_LR:g}{lrs}: the registry's "
                        "default_lr)")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="the momentum of the workers' SGD (ssgd and its kin, daso), OD-SGD's "
                        "and the momentum rules' (smega2, dana, nag); the other parameter-server "
                        "rules take --ps-momentum (default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics", default=None, help="JSONL metrics file (rank 0 writes it)")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write the metrics' numbers as TensorBoard scalars to DIR "
                        "(needs pip install hpcasync[tensorboard])")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="group the ranks of each machine into virtual nodes of K ranks "
                        "(also HPCASYNC_RANKS_PER_NODE)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (local rank r -> cuda:r)")
    p.add_argument("--ps-rank", type=int, default=0, help="world rank of the parameter server")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores/ranks)")
    p.add_argument("--progress", default="auto", help="auto (bar on a terminal), on, off")
    p.add_argument("--log-every", type=int, default=0, help="write a step record every N batches")
    p.add_argument("--checkpoint-dir", default=None,
                   help="write checkpoints here (each epoch end, on SIGTERM/SIGUSR1, periodically)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="also checkpoint every N steps (0: epoch ends and preemption only)")
    p.add_argument("--checkpoint-keep", type=int, default=3,
                   help="keep the newest N checkpoints in --checkpoint-dir (default 3)")
    p.add_argument("--resume", default=None,
                   help="auto (latest good checkpoint in --checkpoint-dir) or a checkpoint path")
    p.add_argument("--divergence-factor", type=float, default=10.0,
                   help="stop when the mean loss of the last 20 steps exceeds this many times its "
                        "best and the first loss (0: only non-finite losses/weights stop the run)")
    for module in argument_modules():
        if hasattr(module, "add_arguments"):
            module.add_arguments(p)



def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``train`` plus the simulator's own group."""
    add_train_arguments(parser)
    g = parser.add_argument_group("simulator")
    g.add_argument("--workers", type=int, default=4, help="number of virtual workers N (4)")
    g.add_argument("--sim-step-time", type=float, default=0.01,
                   help="simulated seconds of one undisturbed step (0.01)")
    g.add_argument("--sim-ps-service-time", type=float, default=0.0,
                   help="simulated seconds ONE server rank needs per push of the whole model "
                        "(0: instantaneous, the default). With --ps-ranks K each of the K shard "
                        "servers needs 1/K of it and they serve in parallel; calibrate it with "
                        "hpcasync bench ps (1 / pushes per second at the model's size)")


def command_parser(command: str) -> OptionParser:
    """A parser of ``hpcasync train`` or ``hpcasync sim`` options alone (no subcommand word)."""
    parser = OptionParser(prog=f"hpcasync {command}")
    {"train": add_train_arguments, "sim": add_sim_arguments}[command](parser)
    return parser
