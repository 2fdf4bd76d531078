"""The asynchronous parameter server (ASGD, DC-ASGD, LC-ASGD, SHAT family, SMEGA2, DANA-Zero, NAG).

* :mod:`.transport` how pushes and replies travel (RMA windows with per-worker slots, or two-sided)
* :mod:`.server`    ``PSServer``: receive, validate, apply the rule, answer
* :mod:`.worker`    the worker loop of ``hpcasync train`` (train the shard, push, take the reply)
* :mod:`.stats`     push counts, staleness histograms
* :mod:`.optimizer` ``ParameterServer``: the front door (a worker's optimizer, the server's loop)
* :mod:`.runtime`   ``hpcasync train --algorithm asgd|...``: options, rule construction, schedules

The update rules themselves (pure tensor math, shared with the simulator) are :mod:`hpcasync.rules`.
"""


def __getattr__(name):
    if name == "ParameterServer":
        from .optimizer import ParameterServer
        return ParameterServer
    raise AttributeError(name)
