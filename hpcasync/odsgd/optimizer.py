"""``ODSGD``: OD-SGD (Xu et al., arXiv 2005.06728) as an optimizer for a user's own loop.

It owns its hyperparameters (there is no user optimizer: the global step is momentum SGD on the
mean gradient, the local step is LocalOpt, see :mod:`.core`). After ``step()`` the model holds the
*local* weights W^l_{t+1} the next gradient is computed on, while round t is in flight; use
:meth:`ODSGD.global_weights` to evaluate the global model and :meth:`ODSGD.finish` at the end::

    opt = hpcasync.ODSGD(model, lr=0.05, momentum=0.9)      # collective
    for epoch in range(epochs):
        for x, y in loader:
            opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
        with opt.global_weights():                          # collective: BN buffers averaged too
            evaluate(model)
    opt.finish()                                            # the model holds the global W

Param groups as in torch (``params=`` a list of parameters or of group dicts), or shared with a
``torch.optim.SGD`` (``optimizer=``; the front door passes the one you give it, so a scheduler or
a hand-written warm-up on either object is honoured): each group's ``"lr"`` (the global lr),
``"lr_local"``, ``"momentum"`` and ``"weight_decay"`` are read at every step and apply to its
slice of θ. A parameter with ``requires_grad=False``, in no group, or in a group whose lr is 0
is left bitwise untouched (global and local weights, momentum, mean square), as torch's SGD leaves
it. Forgetting :meth:`finish` does not hang: the round in flight is completed at interpreter exit
(with a warning).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import weakref

import torch

from ..errors import CheckpointError, ConfigError
from ..optim import AlgorithmOptimizer, as_flat, group_index, refuse_sgd_options
from ..topology import default_topology
from .checkpoint import global_state, load_state, local_state
from .core import ODSGDHyper, group_ranges
from .pipeline import ODSGDWorker

log = logging.getLogger("hpcasync")

_GROUP_KEYS = ("lr", "momentum", "weight_decay", "lr_local")


class ODSGD(AlgorithmOptimizer):
    """OD-SGD on every rank of ``comm``.

    Args:
        model: the model (flattened here; the same architecture on every rank).
        lr, momentum, weight_decay: the global momentum-SGD step.
        local_opt: ``"sgd"``, ``"dc"`` or ``"dc-adaptive"`` (default); lr_local (η_l), lam (λ/λ₀),
            delta (``"last-step"``/``"gap"``), ms_momentum, eps: see :class:`ODSGDHyper`.
        warmup_iters: the first N steps are plain SSGD (200).
        params: the parameters to optimize, or param-group dicts (keys ``params`` and any of
            lr, momentum, weight_decay, lr_local; the keywords above are the defaults), as
            ``torch.optim.SGD`` takes them (default: every parameter of the model, one group).
        epochs, steps_per_epoch: the run's length, if known: a warning on rank 0 when the
            warm-up covers all of it (OD-SGD would then be SSGD throughout).
        comm: the communicator (default: the job's world).
        progress: how the round in flight progresses: ``"thread"`` (default), ``"hooks"``,
            ``"none"`` (docs/design/odsgd.md#runtime has the measurements).
        broadcast: start every rank from rank 0's parameters (default True).
        optimizer: a ``torch.optim.SGD`` whose param groups this object shares (``lr_local``
            is added to each group that lacks it); its momentum buffers are not used (the
            global momentum buffer is this object's state). Its ``nesterov``, ``dampening`` and
            ``maximize`` must stay off: set later, they stop the next step with one line.

    Differences from the paper: Δ = ``last-step`` is the default, as in the authors' code; the
    ``dc-adaptive`` mean square starts at zero and is only updated by local steps (not during
    warm-up); epoch ends complete the round in flight (needed to evaluate one model) without
    changing the sequence of global updates; the round is an allreduce, not a PS push/pull
    (reason: docs/design/odsgd.md#runtime).
    """

    algorithm = "odsgd"

    def __init__(self, model, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 local_opt: str = "dc-adaptive", lr_local: float = 0.5, lam: float | None = None,
                 delta: str = "last-step", ms_momentum: float = 0.0, eps: float = 1e-7,
                 warmup_iters: int = 200, params=None, epochs: int | None = None,
                 steps_per_epoch: int | None = None, comm=None, progress: str = "thread",
                 broadcast: bool = True, optimizer: torch.optim.Optimizer | None = None):
        hp = ODSGDHyper(lr=lr, momentum=momentum, weight_decay=weight_decay, local_opt=local_opt,
                        lr_local=lr_local, lam=lam, delta=delta, ms_momentum=ms_momentum, eps=eps,
                        warmup_iters=warmup_iters)
        flat = as_flat(model)
        if optimizer is not None:
            if params is not None:
                raise ConfigError("ODSGD: pass params or optimizer, not both")
            hyper_from_sgd(optimizer)                     # nothing it would do differently
            self._wrap(flat, optimizer)
            for group in self.param_groups:
                group.setdefault("lr_local", lr_local)
        else:
            self._own(flat, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                             "lr_local": lr_local})
        if params is not None:
            self._set_groups(params)
        if comm is None:
            from ..runtime.join import is_joiner
            from ..topology import init_mpi

            # a replacement builds on its own launch's world (local), as SSGD's default does: its
            # elastic State moves it onto the grown world with the survivors' set_comm
            comm = init_mpi().COMM_WORLD if is_joiner() else default_topology().world
        self.comm = comm
        self.worker = ODSGDWorker(flat, comm, hp=hp, progress=progress)
        self._layout = None
        self._hyper_from_groups()
        _warn_short_run(comm, warmup_iters, epochs, steps_per_epoch)
        if broadcast:
            self.worker.broadcast_parameters(root=0)
        self._finished = False
        atexit.register(_at_exit, weakref.ref(self))

    @property
    def hp(self) -> ODSGDHyper:
        return self.worker.hp

    @property
    def steps(self) -> int:
        return self.worker.steps

    def step(self, closure=None):
        """After backward: round t starts with this gradient (warm-up: a blocking SSGD step); the
        model then holds the local weights the next gradient is computed on."""
        if closure is not None:
            raise ConfigError("ODSGD.step does not take a closure")
        if self._finished:
            raise ConfigError("ODSGD: step() after finish()")
        self._collect()
        self._hyper_from_groups()
        self.worker.step()

    def _set_groups(self, params) -> None:
        """Replace the one default group by the user's groups (torch's rules and defaults)."""
        groups = list(params)
        if not groups:
            raise ConfigError("ODSGD got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.param_groups = []
        for group in groups:
            self.add_param_group(dict(group))     # (the model's parameters only: the base's check)

    def _group_added(self, group: dict) -> None:
        worker = self.__dict__.get("worker")     # (before it, the defaults hold lr_local)
        if worker is not None:
            group.setdefault("lr_local", worker.hp.lr_local)

    def _hyper_from_groups(self) -> None:
        """Give the worker this step's hyperparameters: one :class:`ODSGDHyper` when one group
        holds every parameter (as before param groups), else per-range hyperparameters
        (:func:`~.core.group_ranges`; held parameters: None). Rebuilt only when they change."""
        groups = self.param_groups
        values = tuple(tuple(float(g[k]) for k in _GROUP_KEYS) for g in groups)
        index = group_index(self.flat, groups)
        layout = (values, tuple(index), tuple(_sgd_only(g) for g in groups))
        if layout == self._layout:
            return
        refuse_sgd_options(groups, _PLAIN_SGD, _RUNS)
        hp = self.worker.hp
        if len(groups) == 1 and values[0][0] != 0 and min(index) == 0:
            self.worker.hp = dataclasses.replace(hp, **dict(zip(_GROUP_KEYS, values[0])))
            self.worker.groups = None
        else:
            hypers = [None if v[0] == 0 else dataclasses.replace(hp, **dict(zip(_GROUP_KEYS, v)))
                      for v in values]
            sizes = [p.numel() for p in self.flat.parameters]
            self.worker.groups = group_ranges(self.flat.offsets, sizes, index, hypers)
        self._layout = layout

    def synchronize(self) -> None:
        """Complete and apply the round in flight (the global W then has every gradient)."""
        self.worker.synchronize()

    @contextlib.contextmanager
    def global_weights(self, *, average_buffers: bool = True):
        """Collective. Inside: the model holds the global W (and, ``average_buffers``, the
        rank-averaged BatchNorm buffers, which it keeps); after: the local weights again."""
        if average_buffers:
            self.worker.average_buffers()
        with self.worker.global_weights() as W:
            yield W

    def average_buffers(self) -> None:
        """Collective: average the float buffers (BatchNorm statistics) over the ranks."""
        self.worker.average_buffers()

    def finish(self, *, average_buffers: bool = True):
        """Collective: complete the pipeline; the model keeps the global W (and averaged buffers).
        Returns the model."""
        if not self._finished:
            if average_buffers:
                self.worker.average_buffers()
            self.worker.finish()
            self._finished = True
        return self.flat.module

    def broadcast_parameters(self, root: int = 0) -> None:
        self.worker.broadcast_parameters(root=root)

    def set_comm(self, comm) -> None:
        """Run over ``comm`` from now on (after a ULFM recovery shrank the world; see
        :meth:`ODSGDWorker.set_comm`)."""
        self.comm = comm
        self.worker.set_comm(comm)

    # -- state ------------------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        """This rank's view: the global state (identical on every rank) and its own local
        weights, mean square and buffers (:meth:`local_state_dict`)."""
        self.worker.synchronize()
        return {"global": global_state(self.worker), "local": local_state(self.worker)}

    def _load_extra(self, extra: dict) -> None:
        load_state(self.worker, extra["global"], extra["local"])

    def local_state_dict(self) -> dict:
        """This rank's own part: its local weights, mean square and buffers (after the round in
        flight). ``hpcasync.save_checkpoint`` keeps every rank's, ``State.persist`` writes every
        rank's commit, and a resume on as many ranks loads its own
        (:meth:`load_local_state_dict`): the resumed run is the uninterrupted one."""
        self.worker.synchronize()
        return local_state(self.worker)

    def load_local_state_dict(self, local: dict | None) -> None:
        """Load what :meth:`local_state_dict` gave on this rank (after :meth:`load_state_dict`,
        whose local part, another rank's, it replaces)."""
        if local:
            load_state(self.worker, global_state(self.worker), local)

    def _load_plain(self, base: dict, *, ours: bool) -> None:
        """A plain torch optimizer's state (e.g. ``torch.optim.SGD``): its lr, momentum and weight
        decay, and its momentum buffers as the global momentum buffer v."""
        bufs = _momentum_buffers(base)
        super()._load_plain({**base, "state": {}} if ours or any(b is not None for b in bufs)
                            else base, ours=ours)
        if not ours:
            self._take_momentum(bufs)

    def _after_wrapped_load(self, base: dict, *, ours: bool) -> None:
        """The shared SGD took ``base``: its momentum buffers (a plain SGD's state) become the
        global momentum buffer v, and leave the SGD (v is this object's state)."""
        for group in self.param_groups:
            group.setdefault("lr_local", self.hp.lr_local)
        if not ours:
            bufs = _momentum_buffers(base)
            if not any(b is not None for b in bufs):
                self._unused_state_warning(base)
            self._take_momentum(bufs)
        self.optimizer.state.clear()

    def _take_momentum(self, bufs: list) -> None:
        if any(b is not None for b in bufs):
            mine = [p for g in self.param_groups for p in g["params"]]
            if len(bufs) != len(mine) or any(
                    b is not None and b.shape != p.shape for b, p in zip(bufs, mine)):
                raise CheckpointError("ODSGD: the optimizer state's momentum buffers do not fit "
                                      "this model")
            at = {id(p): o for p, o in zip(self.flat.parameters, self.flat.offsets)}
            with torch.no_grad():
                for p, b in zip(mine, bufs):
                    view = self.worker.glob.buf[at[id(p)]: at[id(p)] + p.numel()]
                    view.copy_(b.reshape(-1) if b is not None else torch.zeros(p.numel()))


_PLAIN_SGD = (("nesterov", False), ("dampening", 0), ("maximize", False))
_RUNS = "odsgd's global step is momentum SGD"


def _momentum_buffers(base: dict) -> list:
    """A torch optimizer state dict's momentum buffers, one per parameter (None where absent)."""
    state = base.get("state") or {}
    return [state.get(i, {}).get("momentum_buffer")
            for g in base["param_groups"] for i in g["params"]]


def _sgd_only(group: dict) -> tuple:
    return tuple(group.get(key, plain) for key, plain in _PLAIN_SGD)


def hyper_from_sgd(sgd: torch.optim.SGD) -> dict:
    """Group 0's lr, momentum and weight decay of a ``torch.optim.SGD`` (the defaults; ODSGD
    shares its groups, ``optimizer=``). Its global step is heavy-ball momentum SGD: Nesterov,
    dampening or maximize would be silently different, so they are errors."""
    refuse_sgd_options(sgd.param_groups, _PLAIN_SGD, _RUNS)
    first = sgd.param_groups[0]
    return {k: first[k] for k in ("lr", "momentum", "weight_decay")}


def _warn_short_run(comm, warmup_iters: int, epochs, steps_per_epoch) -> None:
    """Rank 0 warns when the run's length is known and the SSGD warm-up covers all of it."""
    if epochs is None or steps_per_epoch is None:
        return
    total = int(epochs) * int(steps_per_epoch)
    if warmup_iters >= total and comm.Get_rank() == 0:
        log.warning("OD-SGD: %d epoch(s) x %d steps = %d steps, all inside the %d warm-up steps; "
                    "OD-SGD degenerates to SSGD. Lower warmup_iters (--odsgd-warmup-iters) "
                    "below %d to see OD-SGD", int(epochs), int(steps_per_epoch), total,
                    warmup_iters, total)


def _at_exit(ref) -> None:
    opt = ref()
    if opt is not None and not opt._finished and opt.worker.round is not None:
        log.warning("ODSGD: finish() was not called; completing the round in flight at exit "
                    "(the model holds this rank's local weights)")
        opt.worker.synchronize()
