"""``hpcasync`` command line: train | launch | bench | info | sim | experiment | report.

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
from .errors import run_guarded  # noqa: E402
from .options import OptionParser as _Parser  # noqa: E402
from .options import add_sim_arguments, add_train_arguments  # noqa: E402
from .runtime import startup  # noqa: E402
from . import inject  # noqa: E402
from .supervisor import announce  # noqa: E402


# name -> (module with add_arguments/run, one-line summary)
BENCHMARKS = {
    "allreduce": ("hpcasync.bench.allreduce",
                  "allreduce bandwidth: MPI_Allreduce vs ours (flat, hierarchical) vs Horovod"),
    "daso": ("hpcasync.bench.daso", "DASO vs SSGD (own) vs Horovod: time per epoch, time to accuracy"),
    "ps": ("hpcasync.bench.ps", "parameter-server pushes/s: RMA vs two-sided vs one-process bound"),
    "ssgd": ("hpcasync.bench.ssgd", "SSGD ms/step: ours (overlapped, not) vs PyTorch DDP vs "
             "Horovod vs compute only"),
}


def build_parser(benchmarks: bool = True) -> argparse.ArgumentParser:
    """The ``hpcasync`` parser. ``benchmarks=False`` leaves the benchmarks' own options out (their
    modules import torch and the families; a command line that is not ``bench`` never needs them,
    and a bad option is then said at once instead of after torch's import)."""
    parser = _Parser(prog="hpcasync", description="Synchronous, asynchronous and hierarchical "
                     "data-parallel training on MPI.")
    parser.add_argument("--version", action="version", version=f"hpcasync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="train a model (run under mpiexec/srun)")
    add_train_arguments(train)
    from .supervisor import add_arguments as add_launch_arguments
    add_launch_arguments(sub.add_parser(
        "launch", help="start `train` (or your own script) on N ranks and restart it from its "
        "newest checkpoint after a death (--max-restarts; not under mpiexec)",
        usage="hpcasync launch -n N [--max-restarts K] [--launcher mpiexec|srun] [--ft] -- "
        "train OPTIONS | loop.py ARGS"))
    bench = sub.add_parser("bench", help="benchmarks (run under mpiexec)")
    bsub = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    for name, (module, summary) in BENCHMARKS.items():
        bp = bsub.add_parser(name, help=summary)
        if benchmarks:
            importlib.import_module(module).add_arguments(bp)
    info = sub.add_parser("info", help="print the MPI topology this job sees")
    info.add_argument("--ranks-per-node", type=int, default=None,
                      help="group the ranks of each machine into virtual nodes of K ranks")
    info.add_argument("--device", default="auto", help="auto, cpu or cuda")
    tune = sub.add_parser("tune", help="the allreduce choices of algorithm='auto': show, clear "
                          "or measure them (measure: under mpiexec)")
    tune.add_argument("action", choices=("show", "clear", "measure"),
                      help="show: the cached choices; clear: forget them; measure: measure the "
                      "--sizes again on this job's ranks and keep the result")
    tune.add_argument("--sizes", nargs="+", default=["4K", "64K", "1M", "16M", "64M"],
                      help="message sizes to measure (K, M = KiB, MiB)")
    tune.add_argument("--wire", choices=("float32", "bfloat16"), default="float32",
                      help="the reduced dtype (16-bit sums are measured apart)")
    add_sim_arguments(sub.add_parser("sim", help="simulate N workers in one process (no MPI)"))
    from .experiments.commands import add_experiment_arguments, add_report_arguments
    add_experiment_arguments(sub.add_parser("experiment", help="run an experiment file's matrix "
                                            "(resumable)"))
    add_report_arguments(sub.add_parser("report", help="markdown tables and PNG plots of an "
                                        "experiment's runs"))
    return parser


def _train(ns) -> int:
    from .runtime import algorithms, argument_checks

    cfg = config_from_args(ns).validate(algorithms())   # before torch: a bad option is said at once
    argument_checks(cfg)
    _srun_world_check()
    from .train import train

    train(cfg)
    return 0


def _srun_world_check() -> None:
    """Inside a Slurm step of several tasks, start MPI now and check the world (SlurmEnv
    .check_world): plain srun without PMI support starts N singleton jobs, and each would otherwise
    import torch, read the data and try the model before its MPI start could say so. A process
    spawned into a running job (a grow-back's replacement) inherits the step's variables and is
    left to the joiner's own checks."""
    from .slurm import SlurmEnv

    env = SlurmEnv.from_environ()
    if env.in_step and (env.ntasks or 1) > 1:
        from .topology import init_mpi

        MPI = init_mpi()
        if MPI.Comm.Get_parent() == MPI.COMM_NULL:
            env.check_world(MPI.COMM_WORLD.Get_size())


def _launch(ns) -> int:
    from .runtime import algorithms
    from .supervisor import Supervisor, script_program

    if ns.job[:1] != ["train"]:         # your own script: it resumes from its own checkpoints
        return Supervisor(ns.np, [], max_restarts=ns.max_restarts, launcher=ns.launcher,
                          ft=ns.ft, script=script_program(ns.job)).run()
    cfg = config_from_args(_parse(ns.job)).validate(algorithms())    # bad options: no job at all
    return Supervisor(ns.np, ns.job[1:], max_restarts=ns.max_restarts, launcher=ns.launcher,
                      ft=ns.ft, checkpoint_dir=cfg.checkpoint_dir, metrics=cfg.metrics).run()


def _sim(ns) -> int:
    from .sim.driver import main as sim_main

    return sim_main(ns)


def _info(ns) -> int:
    from .topology import Topology

    topo = Topology.build(ranks_per_node=ns.ranks_per_node, device=ns.device)
    lines = topo.world.gather(f"rank {topo.rank}: node {topo.node} local {topo.local_rank}/"
                              f"{topo.local_size} device {topo.device}", root=0)
    if topo.rank == 0:
        print(topo.describe())
        print("\n".join(lines))
        from .comm import tune

        mine = tune.cached(topo.world)
        print(f"allreduce choices of algorithm='auto' for {topo.size} ranks on this host "
              f"({tune.tune_file() or 'not kept'}):")
        print(tune.describe(mine) if mine else "none yet (measured at a class's first use; "
              "`hpcasync tune measure` under mpiexec measures them now)")
    return 0


def _tune(ns) -> int:
    import torch

    from .bench.allreduce import parse_size
    from .comm import tune

    if ns.action == "show":
        records = tune.cached()
        print(f"{tune.tune_file() or 'no file (HPCASYNC_TUNE_FILE=none)'}: {len(records)} "
              "choice(s)")
        if records:
            print(tune.describe(records))
        return 0
    if ns.action == "clear":
        print(f"removed {tune.clear()} choice(s) from {tune.tune_file()}")
        return 0
    from .topology import init_mpi

    comm = init_mpi().COMM_WORLD
    if comm.Get_size() < 2:
        from .errors import ConfigError

        raise ConfigError("hpcasync tune measure compares MPI_Allreduce with the window on 2 or "
                          "more ranks: run it under mpiexec -n N")
    wire = getattr(torch, ns.wire)
    sizes = [parse_size(x) for x in ns.sizes]
    for nbytes in sizes:
        tune.remeasure(comm, nbytes, wire)
    if comm.Get_rank() == 0:
        print(tune.describe(tune.cached(comm)))
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
    parser = build_parser(benchmarks=bool(argv) and argv[0] == "bench")
    ns = parser.parse_args(argv)
    if getattr(ns, "config", None):
        command_parser = parser._subparsers._group_actions[0].choices[ns.command]  # noqa: SLF001
        apply_config_file(command_parser, ns.config)
        ns = parser.parse_args(argv)
    return ns


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    announce()                # under `hpcasync launch`: this rank's pid, for its lines
    run_guarded(startup.watch)    # under ULFM: a rank dead before MPI is up ends the job
    run_guarded(inject.point, "launch")
    ns = run_guarded(_parse, argv)
    if ns.command != "train":
        startup.done()
    handler = {"train": _train, "launch": _launch, "info": _info, "bench": _bench, "sim": _sim,
               "experiment": _experiment, "report": _report, "tune": _tune}[ns.command]
    code = run_guarded(handler, ns)
    return code or 0


def run_and_exit(argv: list[str] | None = None) -> None:
    """``main``, then the process's exit without the interpreter's teardown.

    Python's exit after torch (and torch._dynamo, which ``torch.optim`` imports) spends close to
    a second of CPU per process deallocating modules, for nothing, on every rank of every job
    (figures: docs/design/restarts.md#notes-from-the-code-clipy). Everything an exit must do is
    done first, in the interpreter's order: non-daemon threads joined (``threading._shutdown``),
    every ``atexit`` handler run (the metrics stream, hpcasync's MPI_Finalize, logging, temp
    files), stdout and stderr flushed; then ``os._exit`` with main's status (SystemExit's too:
    argparse's 2, a preempted run's 75). Any other exception takes Python's normal way out (its
    traceback, 1), and so does every exit under MPICH (:func:`_mpich_loaded`)."""
    import atexit
    import os
    import threading

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    if _mpich_loaded():
        # under MPICH (hydra) the normal exit: there the os._exit below can end a finished run
        # with status 9 after its last line (cause unknown; docs/design/restarts.md, "Notes
        # from the code: cli.py")
        sys.exit(code)
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    from hpcasync import quick_exit

    atexit.unregister(quick_exit.freeze)     # (its collection is for Python's exit: none here)
    atexit._run_exitfuncs()  # noqa: SLF001 - what the interpreter's exit would run next
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:                      # C stdio too (a library's printf into a pipe is block-buffered)
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(code & 0xFF)


def _mpich_loaded() -> bool:
    """mpi4py is loaded and its library is MPICH's (or one built on it)."""
    mod = sys.modules.get("mpi4py.MPI")
    if mod is None:
        return False
    from .launch import MPICH, vendor_of

    try:
        return vendor_of(mod.Get_library_version()) == MPICH
    except Exception:  # noqa: BLE001 - cannot tell: take the normal exit
        return True


if __name__ == "__main__":
    run_and_exit()
