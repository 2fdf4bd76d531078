"""The parameter-server rank of a Horovod script run with a PS algorithm.

``hvd.init(algorithm="smega2")`` sets the server rank(s) aside (:mod:`.basics`). They never return
to the script: each waits here for the first worker's *spec* — the algorithm, its resolved
hyperparameters and the parameters' shapes and initial values, sent when the workers build
``hvd.DistributedOptimizer`` — builds a stand-in module with those parameters, joins the workers in
constructing :class:`hpcasync.ps.ParameterServer` (a collective over every rank), serves until
every worker has finished (at its exit), and exits with status 0. A script whose workers never
build the optimizer releases the server at exit (a ``None`` spec).
"""
from __future__ import annotations

import sys

import torch
from torch import nn

SPEC_TAG = 4290        # the PS transport's tags are 4101-4106, its worker-local model 4190


class ParamHolder(nn.Module):
    """A module whose parameters are the given tensors (the optimizer's, in order): what the
    facade flattens, since a Horovod optimizer knows its parameters but not the model."""

    def __init__(self, params):
        super().__init__()
        for i, p in enumerate(params):
            self._parameters[f"p{i}"] = p

    def forward(self, *args, **kwargs):        # pragma: no cover - never called
        raise RuntimeError("ParamHolder only holds parameters")


def spec_of(algorithm: str, hyper: dict, params) -> dict:
    """What the server rank needs to build the same optimizer: the hyperparameters (param groups
    name their tensors by index into ``params``), the parameters' shapes and values."""
    if "param_groups" in hyper:
        index = {id(p): i for i, p in enumerate(params)}
        hyper = {**hyper, "param_groups": [{**g, "params": [index[id(p)] for p in g["params"]]}
                                           for g in hyper["param_groups"]]}
    return {"algorithm": algorithm, "hyper": hyper,
            "shapes": [tuple(p.shape) for p in params],
            "values": torch.cat([p.detach().reshape(-1).float().cpu() for p in params])}


def send_spec(roles, spec: dict | None) -> None:
    """The first worker: hand ``spec`` (or None: no optimizer) to every server rank."""
    world = roles.topology.world
    for server in roles.topology.servers:
        world.send(spec, dest=server, tag=SPEC_TAG)


def serve_and_exit(roles) -> None:
    """Server rank: receive the spec, serve the algorithm, exit the process (status 0)."""
    from ..api import optimizer

    world = roles.topology.world
    first = min(r for r in range(roles.size) if r not in roles.topology.servers)
    spec = world.recv(source=first, tag=SPEC_TAG)
    if spec is not None:
        params = [nn.Parameter(torch.empty(s)) for s in spec["shapes"]]
        holder = ParamHolder(params)
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(spec["values"][offset: offset + p.numel()].view_as(p))
                offset += p.numel()
        hyper = dict(spec["hyper"])
        if "param_groups" in hyper:            # indices -> this rank's parameters
            hyper["param_groups"] = [{**g, "params": [params[i] for i in g["params"]]}
                                     for g in hyper["param_groups"]]
        opt = optimizer(spec["algorithm"], holder, **hyper)
        opt.serve()
    sys.exit(0)
