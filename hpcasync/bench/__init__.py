"""Benchmarks behind ``hpcasync bench``: each module exposes ``add_arguments(parser)`` and
``run(args)`` (every rank calls ``run``; rank 0 prints a markdown table).

* :mod:`.allreduce` — MPI_Allreduce vs hpcasync's flat and hierarchical allreduce vs Horovod.
"""
