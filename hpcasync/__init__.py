"""hpcasync: synchronous, asynchronous (parameter-server) and hierarchical data-parallel training
on MPI, in your own training loop.

The front door (:mod:`hpcasync.api`)::

    import hpcasync
    ctx = hpcasync.init("smega2")                       # roles: ctx.is_server, ctx.shard_index, ...
    opt = hpcasync.optimizer("smega2", model, torch.optim.SGD(model.parameters(), lr=0.1,
                             momentum=0.9), steps_per_epoch=len(loader))

Where each algorithm lives (one package per family): ``hpcasync.ssgd``, ``hpcasync.daso``,
``hpcasync.odsgd``, ``hpcasync.ps`` (+ the update rules in ``hpcasync.rules``), ``hpcasync.sim``.
Names are imported lazily, so ``import hpcasync`` stays cheap and starts no MPI.
"""

__version__ = "0.1.0"

from hpcasync import quick_exit as _quick_exit  # noqa: E402 - the exit hook, first

_quick_exit.install()     # Python's exit without ~0.9 CPU-s of garbage collection a process


def _ulfm_object_reductions(warn: bool = False) -> None:
    """Under ULFM (``mpirun --with-ft ulfm``), before ``mpi4py.MPI`` is imported: mpi4py's object
    reductions (``comm.allreduce(x)``) as an allgather on the communicator itself, which a
    revoke after a death ends (with ``fast_reduce`` they run point to point on a private
    duplicate that no revoke reaches, and a survivor waits there for good). Run at ``import
    hpcasync``, so that a script importing mpi4py after it gets it, and again before MPI starts
    (:func:`hpcasync.topology.ulfm_open_mpi_defaults`, ``warn``: one line from the first rank
    where mpi4py came first and it is too late)."""
    import os
    import sys

    if not os.environ.get("OMPI_MCA_mpi_ft_enable"):    # (no launcher import at every start)
        return
    from .launch import ft_requested

    if not ft_requested():
        return
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.fast_reduce = False
    elif (warn and mpi4py.rc.fast_reduce and os.environ.get("OMPI_COMM_WORLD_RANK", "0") == "0"
          and not getattr(mpi4py, "_hpcasync_warned", False)):
        mpi4py._hpcasync_warned = True
        sys.stderr.write("hpcasync: warning: mpi4py.MPI was imported before hpcasync under ULFM: "
                         "an object reduction of yours (comm.allreduce(x)) on a communicator "
                         "holding a dead rank can wait for good; import hpcasync first (or set "
                         "MPI4PY_RC_FAST_REDUCE=false)\n")


_ulfm_object_reductions()

_EXPORTS = {
    "init": "hpcasync.api", "optimizer": "hpcasync.api", "algorithms": "hpcasync.api",
    "Roles": "hpcasync.api", "save_checkpoint": "hpcasync.api",
    "load_checkpoint": "hpcasync.api", "open_metrics": "hpcasync.api",
    "install_fail_fast": "hpcasync.api", "average_metric": "hpcasync.api",
    "DistributedOptimizer": "hpcasync.ssgd.optimizer", "DASO": "hpcasync.daso.optimizer",
    "ODSGD": "hpcasync.odsgd.optimizer", "ParameterServer": "hpcasync.ps.optimizer",
    "serve": "hpcasync.ps.optimizer",
    "AlgorithmOptimizer": "hpcasync.optim", "DivergenceGuard": "hpcasync.runtime.divergence",
    "FlatModel": "hpcasync.comm.flat", "default_lr": "hpcasync.config",
    "PowerSGD": "hpcasync.ssgd.powersgd", "LocalSGD": "hpcasync.ssgd.localsgd",
    "DiLoCo": "hpcasync.ssgd.diloco", "SlowMo": "hpcasync.ssgd.slowmo",
}

__all__ = sorted([*_EXPORTS, "elastic"])


#: submodules reached as attributes: ``hpcasync.elastic.State`` after ``import hpcasync``
_SUBMODULES = ("elastic",)


def lazy_exports(package: str, exports: dict[str, str]):
    """A module ``__getattr__`` (PEP 562) for ``package``: ``exports[name]`` (a module, relative to
    ``package`` when it starts with a dot) is imported at the first use of ``name``. Used here and
    by the family packages, whose classes import torch while their options modules do not."""
    def __getattr__(name):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        return getattr(importlib.import_module(module, package), name)
    return __getattr__


_exported = lazy_exports("hpcasync", _EXPORTS)


def __getattr__(name):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"hpcasync.{name}")
    return _exported(name)
