"""The asynchronous parameter server (ASGD, DC-ASGD, LC-ASGD, SHAT family, SMEGA2, DANA-Zero, NAG).

* :mod:`.transport` how pushes and replies travel: RMA windows with one slot per worker (the
                    reply returns through the worker's own gradient slot); :mod:`.p2p` the
                    two-sided baseline; :mod:`.wire` headers, kinds, waits shared by both
* :mod:`.memory`    what the server holds: rule state + transport + buffer table (the formula,
                    shared with the simulator; ``python -m hpcasync.ps.memory --params 25600000``)
* :mod:`.server`    ``PSServer``: receive, validate, apply the rule, answer
* :mod:`.worker`    the worker loop of ``hpcasync train`` (train the shard, push, take the reply)
* :mod:`.stats`     push counts, staleness histograms
* :mod:`.optimizer` ``ParameterServer``: the front door (a worker's optimizer, the server's loop)
* :mod:`.runtime`   ``hpcasync train --algorithm asgd|...``: options, rule construction, schedules

The update rules themselves (pure tensor math, shared with the simulator) are :mod:`hpcasync.rules`.
"""

from .. import lazy_exports

__getattr__ = lazy_exports(__name__, {"ParameterServer": ".optimizer"})
