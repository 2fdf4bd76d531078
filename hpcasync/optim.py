"""What every algorithm's optimizer-shaped object shares: it *is* a ``torch.optim.Optimizer``.

Each family has one class (:class:`hpcasync.ssgd.DistributedOptimizer`, :class:`hpcasync.daso.DASO`,
:class:`hpcasync.odsgd.ODSGD`, :class:`hpcasync.ps.ParameterServer`), built on
:class:`AlgorithmOptimizer`, so everything in torch that checks ``isinstance(opt, Optimizer)``
accepts it: LR schedulers (they write ``param_groups[i]["lr"]``, which the algorithm reads at every
step), ``register_step_pre_hook``/``post_hook``, ``state_dict``/``load_state_dict``.

Example::

    opt = hpcasync.optimizer("odsgd", model, torch.optim.SGD(model.parameters(), lr=0.05))
    isinstance(opt, torch.optim.Optimizer)              # True
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)    # drives param_groups[i]["lr"]

Design: docs/design/front-door.md#optimizer-base (wrapping and owning, state dicts, gradients).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from .comm import FlatModel
from .errors import CheckpointError, ConfigError
from .passes import BackwardPasses, unbound_message

log = logging.getLogger("hpcasync")

_STATE_KEY = "hpcasync"


def as_flat(model: nn.Module | FlatModel) -> FlatModel:
    """The :class:`FlatModel` of ``model``, made once per module (later calls return the same).

    Build it after ``model.to(device)``: parameters are re-bound to views of one flat tensor on the
    model's device. Optimizers made before or after keep working (the Parameter objects stay)."""
    if isinstance(model, FlatModel):
        return model
    if not isinstance(model, nn.Module):
        raise ConfigError(f"expected a torch.nn.Module, got {type(model).__name__}")
    flat = model.__dict__.get("_hpcasync_flat")
    if flat is not None and not [n for n in flat.check() if not n.endswith(".grad")]:
        return flat
    if not any(True for _ in model.parameters()):
        raise ConfigError(f"{type(model).__name__} has no parameters to train")
    flat = FlatModel(model)
    model.__dict__["_hpcasync_flat"] = flat
    return flat


def unique_params(param_groups) -> list:
    """The parameters of ``param_groups`` in order, each once (a tensor may sit in two groups)."""
    seen, out = set(), []
    for group in param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def group_index(flat: FlatModel, param_groups, *, requires_grad: bool = True) -> list[int]:
    """For each parameter of ``flat`` (flat order), the index of the param group that holds it, or
    -1 where torch's optimizer would not touch it now: in no group, or (``requires_grad``, the
    default) ``requires_grad=False``.

    Every family reads this to leave such parameters bitwise untouched, as plain torch does."""
    where = {id(p): i for i, g in enumerate(param_groups) for p in g["params"]}
    return [where.get(id(p), -1) if p.requires_grad or not requires_grad else -1
            for p in flat.parameters]


def refuse_sgd_options(groups, options, runs: str) -> None:
    """One line when a param group of a torch SGD sets one of ``options`` (``(key, plain)``
    pairs) away from ``plain``: an algorithm that runs its own update (``runs`` says which)
    would silently not do it."""
    for key, plain in options:
        bad = [i for i, g in enumerate(groups) if g.get(key, plain) != plain]
        if bad:
            raise ConfigError(f"{runs} without {key}: the SGD's param group(s) {bad} set "
                              f"{key}={groups[bad[0]][key]}; use {key}={plain}")


def _amp_guard(opt, args, kwargs) -> None:
    """The step pre-hook of a family that does not handle the scaler (``_amp_supported``
    False): ``GradScaler.step(opt)`` is a one-line error on every rank (they all call step: the
    scaler no longer skips it on its own)."""
    if opt.__dict__.get("found_inf") is not None:
        opt._amp_forget()
        raise ConfigError(
            f"{opt.algorithm}: torch.amp.GradScaler is not supported: its ranks step on their "
            "own gradients, so each would skip a step or not on its own (an inf or NaN on one "
            "rank) and fall out of step with the others; use bfloat16 autocast (no scaler), or "
            "ssgd")


def _undecorated(method):
    """``method`` without torch's ``torch._disable_dynamo`` wrapper (``functools.wraps`` keeps the
    function it wraps as ``__wrapped__``); the method itself where torch does not wrap it."""
    return getattr(method, "__wrapped__", method)


class AlgorithmOptimizer(torch.optim.Optimizer):
    """Base of the optimizer-shaped object of every algorithm (docs/design/front-door.md).

    Subclasses call :meth:`_wrap` or :meth:`_own` in ``__init__``, and may extend
    :meth:`_extra_state` / :meth:`_load_extra` (their counters) and :meth:`_load_plain` (how a
    plain torch optimizer's state maps onto an owned algorithm).

    torch wraps ``Optimizer.add_param_group`` (called by its ``__init__``) and ``state_dict`` in
    ``torch._disable_dynamo``, whose first call imports ``torch._dynamo``: 2-3.5 CPU-s in every
    process. The algorithms that own their update (the parameter server's workers and server,
    OD-SGD) never step a torch optimizer, so here they call the functions underneath and start
    without that import. The wrapper only marks a graph break for ``torch.compile``, and an
    algorithm's methods (MPI traffic) are never compiled. (A wrapped torch optimizer, as SSGD and
    DASO hold, imports it at its first step anyway.)
    """

    algorithm: str = ""
    _add_param_group = _undecorated(torch.optim.Optimizer.add_param_group)
    _skip = False                      # inside skip_synchronize()
    amp_stepped = False                # a GradScaler has stepped it (_amp_step)
    _warns_unused = True               # _note_unused (SSGD: False, it skips them as torch)
    # torch.amp.GradScaler.step(opt) then calls step() itself, with ``grad_scale`` and
    # ``found_inf`` set on the optimizer, instead of deciding alone whether to skip it
    # (:meth:`_amp_step`); a family that does not handle them stops there (_amp_supported False:
    # a step pre-hook, :meth:`_guard_amp`)
    _step_supports_amp_scaling = True
    _amp_supported = False

    def _wrap(self, flat: FlatModel, optimizer: torch.optim.Optimizer) -> None:
        """Share the user optimizer's param groups and state; check it optimizes this model."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"{self.algorithm} wraps a torch.optim.Optimizer, got "
                              f"{type(optimizer).__name__}")
        if isinstance(optimizer, AlgorithmOptimizer):
            raise ConfigError(f"{self.algorithm}: the optimizer is already an hpcasync "
                              f"{optimizer.algorithm} optimizer; wrap the plain torch optimizer")
        mine = {id(p) for p in flat.module.parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        foreign = [p for p in params if id(p) not in mine]
        if foreign:
            raise ConfigError(f"{self.algorithm}: the optimizer holds {len(foreign)} tensor(s) that "
                              "are not parameters of the model")
        torch.optim.Optimizer.__init__(self, params, dict(optimizer.defaults))
        self.flat, self.optimizer = flat, optimizer     # from here on groups and state are its
        self.defaults = optimizer.defaults
        self._guard_amp()

    def _own(self, flat: FlatModel, defaults: dict[str, Any]) -> None:
        """One param group over the model's parameters holding the algorithm's hyperparameters."""
        torch.optim.Optimizer.__init__(self, list(flat.module.parameters()), dict(defaults))
        self.flat, self.optimizer = flat, None
        self._guard_amp()

    def _guard_amp(self) -> None:
        """A family that does not handle ``GradScaler`` refuses it at its step (:func:`_amp_guard`);
        one that does (SSGD) checks in its own step, with no hook on its hot path."""
        if not self._amp_supported:
            self.register_step_pre_hook(_amp_guard)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, checked once the optimizer is built: a group of tensors that are not the
        model's parameters is a one-line error (their gradients are not in the flat buffer the
        algorithm communicates: each rank would train them on its own gradient alone, and the
        replicas part), as is a group the family cannot add after its set-up
        (:meth:`_check_new_group`). Then :meth:`_group_added` fills the family's own keys."""
        flat = self.__dict__.get("flat")
        if flat is None:            # (torch's __init__ and the families' own set-up)
            return self._add_param_group(param_group)
        params = param_group.get("params", [])
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        mine = {id(p) for p in flat.parameters}
        foreign = sum(id(p) not in mine for p in params)
        if foreign:
            raise ConfigError(f"{self.algorithm}: add_param_group got {foreign} tensor(s) that "
                              "are not parameters of the model: their gradients would not be "
                              f"{self.algorithm}'s (each rank would train them alone); add them "
                              "to the model before hpcasync.optimizer(...)")
        self._check_new_group()
        self._add_param_group(param_group)
        self._group_added(self.param_groups[-1])

    def _check_new_group(self) -> None:
        """Called by :meth:`add_param_group` after the set-up: raise where the family cannot
        take a new group (the parameter server fixes its groups at set-up)."""

    def _group_added(self, group: dict) -> None:
        """A group was just added after the set-up: fill the family's own keys."""

    def _amp_forget(self) -> None:
        """Drop the scaler's ``grad_scale``/``found_inf`` when ``step()`` raises (the scaler
        deletes them only after a step that returns), so that no later call takes them."""
        self.__dict__.pop("found_inf", None)
        self.__dict__.pop("grad_scale", None)

    def _amp_step(self) -> bool:
        """Inside ``step()``: whether to take the step, for a call from ``GradScaler.step``
        (True for any other call). The scaler has set ``found_inf`` (an inf or NaN in the
        gradients it checked) and ``grad_scale`` (None when ``scaler.unscale_(opt)`` came
        first): skip the step on an inf, else unscale the gradients in place as the scaler's
        ``unscale_`` does (the same kernel, the same bits). The gradients must be the ones every
        rank holds alike (averaged): the family's step checks that first."""
        found_inf = self.__dict__.get("found_inf")
        if found_inf is None:
            return True
        self.amp_stepped = True         # (a GradScaler drives it: hpcasync.elastic.State checks)
        if found_inf.item():
            return False
        scale = self.__dict__.get("grad_scale")
        if scale is not None:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, torch.zeros(1, device=grads[0].device),
                    scale.double().reciprocal().float().to(grads[0].device))
        return True

    # -- what torch's optimizer API needs -----------------------------------------------------------
    # param_groups and state are the wrapped optimizer's (always its current ones: its
    # load_state_dict replaces the list), or this object's own when it owns its hyperparameters
    @property
    def param_groups(self) -> list[dict]:
        inner = self.__dict__.get("optimizer")
        return inner.param_groups if inner is not None else self.__dict__["_groups"]

    @param_groups.setter
    def param_groups(self, value) -> None:
        inner = self.__dict__.get("optimizer")
        if inner is not None:
            inner.param_groups = value
        else:
            self.__dict__["_groups"] = value

    @property
    def state(self):
        inner = self.__dict__.get("optimizer")
        return inner.state if inner is not None else self.__dict__["_state"]

    @state.setter
    def state(self, value) -> None:
        inner = self.__dict__.get("optimizer")
        if inner is not None:
            inner.state = value
        else:
            self.__dict__["_state"] = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients. They stay views of the flat buffer whatever ``set_to_none`` says
        (the buffer is what the algorithm communicates)."""
        self._check_bound()
        tracker = self.__dict__.get("_unused_tracker")
        if tracker is not None:
            tracker.refresh()
        self.flat.zero_grad()

    def _check_bound(self) -> None:
        """Stop (every rank meets it at the same step) when a parameter or buffer is no longer
        its view of the flat buffer: the algorithm would silently stop training it."""
        name = self.flat.unbound()
        if name is not None:
            raise ConfigError(unbound_message(self.algorithm, name))

    def _note_unused(self) -> None:
        """Say (once per parameter, on this rank) when a parameter the optimizer trains got no
        gradient in this step: these families apply it as a zero gradient (weight decay and
        momentum still move it), where plain torch would skip it. SSGD does as torch does
        (``p.grad = None``) and opts out. The counting hooks exist from the first step on; the
        check starts at the second."""
        if not self._warns_unused:
            return
        tracker = self.__dict__.get("_unused_tracker")
        if tracker is None:
            n = len(self.flat.parameters)
            self.__dict__["_unused_tracker"] = BackwardPasses(self.flat, 1 << 30, [False] * n,
                                                              self.algorithm)
            return
        presence = tracker.presence()
        tracker.reset()
        if all(presence):
            return
        told = self.__dict__.setdefault("_told_unused", set())
        groups = group_index(self.flat, self.param_groups)
        new = [k for k, (g, got) in enumerate(zip(groups, presence))
               if g >= 0 and not got and k not in told]
        if new:
            told.update(new)
            log.warning("%s: %s got no gradient in this step: %s applies a zero gradient there "
                        "(weight decay and momentum still move it), where plain torch would skip "
                        "it; if it is never used, freeze it (requires_grad=False) or leave it out "
                        "of the optimizer (ssgd skips such parameters as torch does)",
                        self.algorithm, ", ".join(self.flat.names[k] for k in new),
                        self.algorithm)

    def _collect(self) -> None:
        """Before reading ``flat.grads``: check the parameters are still views of the flat buffer
        (:meth:`_check_bound`), say whether a trained parameter got no gradient
        (:meth:`_note_unused`), then take back gradients a ``set_to_none`` detached."""
        self._check_bound()
        self._note_unused()
        if self.flat.collect_grads() and not getattr(self, "_told_set_to_none", False):
            self._told_set_to_none = True
            log.debug("%s: gradients detached by zero_grad(set_to_none=True) were re-bound to "
                      "the flat buffer (one copy this step)", self.algorithm)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """After an explicit ``synchronize()`` (e.g. to clip the averaged gradients):
        ``with opt.skip_synchronize(): opt.step()`` steps without synchronizing again."""
        self._check_skip()
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def _check_skip(self) -> None:
        """Called by :meth:`skip_synchronize`: complain when no ``synchronize()`` came first."""

    def lr(self, group: int = 0) -> float:
        """The learning rate the algorithm uses now (``param_groups[group]["lr"]``)."""
        value = self.param_groups[group]["lr"]
        return float(value.item() if torch.is_tensor(value) else value)

    def state_dict(self) -> dict[str, Any]:
        base = (self.optimizer.state_dict() if self.optimizer is not None
                else _undecorated(torch.optim.Optimizer.state_dict)(self))
        return {**base, _STATE_KEY: {"algorithm": self.algorithm, **self._extra_state()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our state dict, or a plain torch optimizer's (its ``state``/``param_groups``)."""
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise CheckpointError(f"{self.algorithm}: not an optimizer state dict (keys: {keys})")
        extra = state_dict.get(_STATE_KEY)
        base = {k: v for k, v in state_dict.items() if k != _STATE_KEY}
        if extra is not None and extra.get("algorithm") != self.algorithm:
            raise CheckpointError(f"optimizer state of algorithm {extra.get('algorithm')!r} cannot "
                                  f"be loaded into {self.algorithm!r}")
        if self.optimizer is not None:
            self.optimizer.load_state_dict(base)
            self._after_wrapped_load(base, ours=extra is not None)
        else:
            self._load_plain(base, ours=extra is not None)
        if extra is not None:
            self._load_extra(extra)

    # -- subclass hooks -----------------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra(self, extra: dict[str, Any]) -> None:
        pass

    def _after_wrapped_load(self, base: dict[str, Any], *, ours: bool) -> None:
        """A wrapped optimizer took ``base`` (its own ``load_state_dict``): an algorithm that
        owns its update but shares a torch SGD's groups maps or drops the SGD's state here."""

    def _unused_state_warning(self, base: dict[str, Any]) -> None:
        """Say that a plain torch optimizer's per-parameter state is not used here."""
        if base.get("state"):
            log.warning("%s: the per-parameter state of the loaded torch optimizer (%s) has no "
                        "counterpart here and is not used", self.algorithm,
                        ", ".join(sorted({k for s in base["state"].values() for k in s})))

    def _load_plain(self, base: dict[str, Any], *, ours: bool) -> None:
        """Owned algorithms: take the hyperparameters of the saved param groups (lr, momentum,
        weight decay, initial_lr of a scheduler) that this algorithm has; per-parameter state of
        a plain torch optimizer is dropped with a warning unless the subclass maps it."""
        groups = base["param_groups"]
        if len(groups) != len(self.param_groups):
            raise CheckpointError(f"{self.algorithm}: the state has {len(groups)} param groups, "
                                  f"this optimizer {len(self.param_groups)}")
        for mine, saved in zip(self.param_groups, groups):
            for key, value in saved.items():
                if key != "params" and (key in mine or key == "initial_lr"):
                    mine[key] = value
        if not ours:
            self._unused_state_warning(base)

    def __repr__(self) -> str:
        inner = f" wrapping {type(self.optimizer).__name__}" if self.optimizer is not None else ""
        return f"{type(self).__name__}({self.algorithm}{inner}, lr={self.lr():g})"
