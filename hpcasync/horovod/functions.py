"""Horovod's helpers over the collectives: parameters, optimizer state and Python objects.

* :func:`broadcast_parameters` — ``model.state_dict()`` (any dict: in name order),
  ``model.named_parameters()``, ``model.parameters()`` or a list of tensors / ``(name, tensor)``
  pairs (in the order given, as Horovod) from ``root_rank``, in place;
* :func:`broadcast_optimizer_state` — the optimizer's ``state_dict()`` from ``root_rank``: tensors
  (momentum buffers, step counts) in place, other per-parameter state and the hyperparameters
  (lr, momentum, ...; a tensor lr in place) set to the root's; an optimizer with no state yet is
  first given one by a zero-gradient step, as Horovod does, with lr 0 and the parameters restored
  (Horovod's step with the real lr would move them under weight decay). ``model=`` is Horovod's
  keyword: as there, that step gives ``SparseAdam``'s parameters and, with ``SGD``, the model's
  ``nn.Embedding(sparse=True)`` weights sparse zero gradients;
* :func:`broadcast_object` / :func:`allgather_object` — any picklable object.

Each takes ``process_set=`` (Horovod 0.28.1's ``broadcast_object`` does; hpcasync's other three
too): the set's ranks only, ``root_rank`` a global rank.
"""
from __future__ import annotations

import collections.abc

import torch

from ..comm import objects
from ..comm.objects import bcast_object
from . import agree as _agree
from .agree import Desc
from .basics import _state
from .collectives import _comm, _fresh, _key, _root, broadcast_
from .sparse import sparse_params


def broadcast_parameters(params, root_rank: int, process_set=None) -> None:
    """Overwrite every rank's parameters (and buffers) with ``root_rank``'s, in place."""
    _root(process_set, root_rank)            # a rank outside the set: Horovod's error, at once
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, collections.abc.Iterable) and not torch.is_tensor(params):
        items = [i if isinstance(i, tuple) else (None, i) for i in params]
        if any(len(i) != 2 for i in items):
            raise ValueError("broadcast_parameters takes a state_dict, a dict, or a list of "
                             "tensors or of (name, tensor) pairs (e.g. model.named_parameters())")
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    # each broadcast is agreed across ranks (name, shape, dtype): no separate name check
    for name, p in items:
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name} is a {type(p).__name__}, not a tensor")
        with torch.no_grad():
            broadcast_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank, name=name,
                       process_set=process_set)


def broadcast_optimizer_state(optimizer, root_rank: int, model=None, process_set=None) -> None:
    """Make every rank's ``optimizer`` state (and hyperparameters) ``root_rank``'s."""
    _root(process_set, root_rank)            # a rank outside the set: Horovod's error, at once
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    sparse = sparse_params(optimizer, model)     # Horovod's: their zero gradients are sparse
    state = optimizer.state_dict()
    if not state["state"]:                          # no step yet: make the state exist everywhere
        _zero_step(optimizer, sparse)
        state = optimizer.state_dict()
    root_state = broadcast_object(state if _state().comm.Get_rank() == root_rank else None,
                                  root_rank, process_set=process_set)
    own = state["state"]
    for key, entry in root_state["state"].items():
        for k, v in entry.items():
            mine = own.get(key, {}).get(k)
            if torch.is_tensor(v) and torch.is_tensor(mine) and mine.shape == v.shape:
                with torch.no_grad():
                    mine.copy_(v.to(mine.device, mine.dtype))
            elif key in own:              # non-tensor state (or a tensor of another shape)
                own[key][k] = v.clone() if torch.is_tensor(v) else v
    groups = root_state["param_groups"]
    for group, root_group in zip(optimizer.param_groups, groups):
        for k, v in root_group.items():
            if k == "params":
                continue
            if torch.is_tensor(v) and torch.is_tensor(group.get(k)) and group[k].shape == v.shape:
                with torch.no_grad():
                    group[k].copy_(v)     # a tensor lr stays the object the scheduler holds
            else:
                group[k] = v
    if set(own) != set(root_state["state"]):
        optimizer.load_state_dict(root_state)     # (moves tensors to the parameters' devices)


def _zero_step(optimizer, sparse=frozenset()) -> None:
    """One step with zero gradients (and lr 0 where there is one) to create the state; the
    parameters whose ids are in ``sparse`` get a sparse zero gradient (SparseAdam needs one)."""
    saved = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and (p.grad is None or id(p) in sparse):
                saved.append((p, p.grad))
                p.grad = torch.zeros_like(p)
                if id(p) in sparse:
                    p.grad = p.grad.to_sparse()
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:        # lr 0 for this step; a tensor lr is not touched
        if "lr" in g:
            g["lr"] = 0.0 if not torch.is_tensor(g["lr"]) else torch.zeros_like(g["lr"])
    params = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
    _inner_step(optimizer)
    with torch.no_grad():
        for p, old in zip((p for g in optimizer.param_groups for p in g["params"]), params):
            p.copy_(old)
    for g, lr in zip(optimizer.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    for p, grad in saved:
        p.grad = grad


def _inner_step(optimizer) -> None:
    """The optimizer's own update, without a facade's synchronization."""
    skip = getattr(optimizer, "skip_synchronize", None)
    if skip is not None and getattr(optimizer, "_hvd_facade", False):
        with skip():
            optimizer.step()
    else:
        optimizer.step()


def broadcast_object(obj, root_rank: int = 0, name=None, process_set=None):
    """``root_rank``'s ``obj`` (pickled; a copy on ``root_rank`` too) on every rank, any size
    (its tensors travel as buffers: :func:`hpcasync.comm.objects.bcast_object`)."""
    comm, root, problem = _root(process_set, root_rank)
    _fresh(_key(name, process_set, "broadcast"))
    _agree.agree(comm, Desc("BROADCAST", name, None, (), root_rank, problem=problem))
    return bcast_object(comm, obj, root, copy=True)


def allgather_object(obj, name=None, process_set=None) -> list:
    """Every rank's ``obj`` (pickled; a copy of its own too), in rank order, any size (its
    tensors travel as buffers: :func:`hpcasync.comm.objects.allgather_object`)."""
    comm = _comm(process_set, "Allgather")
    _fresh(_key(name, process_set, "allgather"))
    _agree.agree(comm, Desc("ALLGATHER", name))
    return objects.allgather_object(comm, obj)
