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
}

__all__ = sorted([*_EXPORTS, "elastic"])


#: submodules reached as attributes: ``hpcasync.elastic.State`` after ``import hpcasync``
_SUBMODULES = ("elastic",)


def __getattr__(name):
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"hpcasync.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hpcasync' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
