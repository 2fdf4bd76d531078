"""hpcasync: synchronous, asynchronous (parameter-server) and hierarchical data-parallel training
on MPI. See README.md for the layers; each algorithm lives in one file under ``hpcasync.rules``
(update math) or ``hpcasync.runtime`` (who talks to whom)."""

__version__ = "0.1.0"
