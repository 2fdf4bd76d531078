"""``hpcasync`` command line: train | bench | info.

Options are parsed and validated before MPI is initialised, so a bad option ends every rank with
one line (printed once, by rank 0) and exit status 2, without any rank waiting on another.
"""
from __future__ import annotations

import argparse
import importlib
import sys

import mpi4py

mpi4py.rc.initialize = False      # MPI starts in Topology.build, after validation
mpi4py.rc.finalize = False

from . import __version__  # noqa: E402
from .config import apply_config_file, config_from_args  # noqa: E402
from .errors import ConfigError, run_guarded  # noqa: E402


# name -> (module with add_arguments/run, one-line summary)
BENCHMARKS = {
    "allreduce": ("hpcasync.bench.allreduce",
                  "allreduce bandwidth: MPI_Allreduce vs ours (flat, hierarchical) vs Horovod"),
    "daso": ("hpcasync.bench.daso", "DASO vs SSGD (own) vs Horovod: time per epoch, time to accuracy"),
    "ps": ("hpcasync.bench.ps", "parameter-server pushes/s: RMA vs two-sided vs one-process bound"),
}


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one line) instead of printing usage and exiting."""

    def error(self, message: str):
        raise ConfigError(message)


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    from .runtime import algorithms, runtime_modules

    p.add_argument("--config", help="TOML or JSON file of option defaults (the command line wins)")
    p.add_argument("--algorithm", default="ssgd", help=f"one of: {', '.join(algorithms())}")
    p.add_argument("--backend", default="mpi", help="mpi (own collectives) or horovod (ssgd, daso)")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--data-dir", default=None, help="directory of the data set files")
    p.add_argument("--train-limit", type=int, default=None, help="use the first N training images")
    p.add_argument("--test-limit", type=int, default=None, help="use the first N test images")
    p.add_argument("--model", default="lenet", help="mlp, lenet or resnet20")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics", default=None, help="JSONL metrics file (rank 0 writes it)")
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
    p.add_argument("--resume", default=None,
                   help="auto (latest good checkpoint in --checkpoint-dir) or a checkpoint path")
    p.add_argument("--divergence-factor", type=float, default=10.0,
                   help="stop when the mean loss of the last 20 steps exceeds this many times its "
                        "best and the first loss (0: only non-finite losses/weights stop the run)")
    for module in runtime_modules():
        if hasattr(module, "add_arguments"):
            module.add_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hpcasync", description="Synchronous, asynchronous and hierarchical "
                     "data-parallel training on MPI.")
    parser.add_argument("--version", action="version", version=f"hpcasync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="train a model (run under mpiexec/srun)")
    _add_train_arguments(train)
    bench = sub.add_parser("bench", help="benchmarks (run under mpiexec)")
    bsub = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    for name, (module, summary) in BENCHMARKS.items():
        bp = bsub.add_parser(name, help=summary)
        importlib.import_module(module).add_arguments(bp)
    info = sub.add_parser("info", help="print the MPI topology this job sees")
    info.add_argument("--ranks-per-node", type=int, default=None,
                      help="group the ranks of each machine into virtual nodes of K ranks")
    info.add_argument("--device", default="auto", help="auto, cpu or cuda")
    from .sim import add_arguments as _sim_arguments
    _sim_arguments(sub.add_parser("sim", help="simulate N workers in one process (no MPI)"))
    from .experiments.commands import add_experiment_arguments, add_report_arguments
    add_experiment_arguments(sub.add_parser("experiment", help="run an experiment file's matrix "
                                            "(resumable)"))
    add_report_arguments(sub.add_parser("report", help="markdown tables and PNG plots of an "
                                        "experiment's runs"))
    return parser


def _train(ns) -> int:
    from .train import train

    train(config_from_args(ns))
    return 0


def _sim(ns) -> int:
    from .sim import main as sim_main

    return sim_main(ns)


def _info(ns) -> int:
    from .topology import Topology

    topo = Topology.build(ranks_per_node=ns.ranks_per_node, device=ns.device)
    lines = topo.world.gather(f"rank {topo.rank}: node {topo.node} local {topo.local_rank}/"
                              f"{topo.local_size} device {topo.device}", root=0)
    if topo.rank == 0:
        print(topo.describe())
        print("\n".join(lines))
    return 0


def _experiment(ns) -> int:
    from .experiments.commands import experiment_main

    return experiment_main(ns)


def _report(ns) -> int:
    from .experiments.commands import report_main

    return report_main(ns)


def _bench(ns) -> int:
    importlib.import_module(BENCHMARKS[ns.bench][0]).run(ns)
    return 0


def _parse(argv):
    parser = build_parser()
    ns = parser.parse_args(argv)
    if getattr(ns, "config", None):
        command_parser = parser._subparsers._group_actions[0].choices[ns.command]  # noqa: SLF001
        apply_config_file(command_parser, ns.config)
        ns = parser.parse_args(argv)
    return ns


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ns = run_guarded(_parse, argv)
    handler = {"train": _train, "info": _info, "bench": _bench, "sim": _sim,
               "experiment": _experiment, "report": _report}[ns.command]
    code = run_guarded(handler, ns)
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
