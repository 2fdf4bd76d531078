"""The one-process simulator: N virtual workers on a simulated clock (``hpcasync sim``).

* :mod:`.engine` ``AsyncSim`` (the PS rules, same objects as the MPI server) and ``SyncSim``
* :mod:`.driver` the ``hpcasync sim`` command: options, data, metrics, the run
"""
