"""``ParameterServer``: the eleven parameter-server algorithms as one optimizer-shaped object.

On a worker rank it is an optimizer (``zero_grad / backward / step``): ``step()`` pushes this
rank's gradient (and its BatchNorm buffers and current lr) to the server and replaces the model's
parameters by the reply (θ, SMEGA2's look-ahead θ̂, SHAT's mix, ... — the rule's ``on_reply``).
On the server rank, :meth:`ParameterServer.serve` applies the rule to every push until every worker
has called :meth:`~ParameterServer.finish`, and returns the final model; every rank ends with the
server's θ (and the mean of the workers' latest buffers)::

    ctx = hpcasync.init()                               # rank 0 serves, the others train
    opt = hpcasync.ParameterServer(model, "smega2", lr=0.1, momentum=0.9,
                                   steps_per_epoch=len(loader))
    if ctx.is_server:
        opt.serve()
    else:
        for epoch in range(epochs):
            for x, y in loader:                         # shard by ctx.worker_index / num_workers
                opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
        opt.finish()
    # here every rank's model holds the server's final θ

Design: docs/design/ps.md#parameterserver (collective construction, the first reply, defaults,
param groups, checkpoints, misuse; ``ps_ranks=K``: :mod:`.shards`).
"""
from __future__ import annotations

import atexit
import logging
import math
import weakref
from typing import Any, Callable

import torch

from .. import inject, registry
from ..comm.broadcast import broadcast
from ..errors import CheckpointError, ConfigError, ProcessFailedError, TopologyError, fail_fast
from ..optim import AlgorithmOptimizer, as_flat, group_index
from ..rules import MOMENTUM_RULES, RULES, Reply, make_rule, ps_lr_factor
from ..rules.base import STOP_IN_SIM_ONLY
from ..rules.base import check_real
from ..runtime import ft
from ..topology import default_topology
from .loop_checkpoint import LoopCheckpoints
from .ordering import ordered
from .server import PSServer
from .shards import EpochExchange, ShardLayout, check_shards, wait_ends, worker_pieces
from .transport import KIND_DONE, KIND_FINISH, KIND_PEEK, make_transport
from .wire import END_GROW, mask_flags, mask_words
from .worker import Patience

log = logging.getLogger("hpcasync")

ALGORITHMS = registry.LiveNames(registry.ps_names)     # live: a registered rule shows

#: the ParameterServers of this process not yet closed, in construction order (every rank builds
#: them in the same order): a second one gets a communicator of its own, and a server serves them
#: together (:func:`serve`)
_LIVE: list = []


class ParameterServer(AlgorithmOptimizer):
    """One PS algorithm: the server's rule on the server rank, an optimizer on the workers.

    Args:
        model: the model (same architecture on every rank; the server's initial parameters win).
        algorithm: one of asgd, dcasgd, dcasgd-a, lcasgd, shat, shat-root, ensemble, asp, smega2,
            dana, nag.
        lr: the base learning rate (a worker's ``param_groups[0]["lr"]``, sent with each push).
        **hyper: the rule's other hyperparameters (``momentum``, ``weight_decay``, ``lam``, ...;
            :func:`hpcasync.rules.rule_hyperparameters` lists them per rule).
        comm: the communicator (default: the job's world).
        ps_rank: the server's rank in ``comm`` (default: the topology's, 0 unless ``hpcasync.init``
            was told otherwise).
        transport: ``"rma"`` (default), ``"rma-put"`` or ``"p2p"`` (:mod:`.transport`).
        ps_ranks: K servers ``ps_rank``.. each serving a shard of θ (:mod:`.shards`; init's: 1).
        steps_per_epoch: pushes per worker per epoch; gives the server epochs (records,
            ``serve(on_epoch=...)``) and the warm-up its clock.
        epochs: epochs to record at the server (None: as many as the pushes cross).
        warmup_epochs: the paper schedule's warm-up (None: the rule's default, 5 for smega2/dana/
            nag, 0 for the others).
        average_buffers: the server's model takes the mean of the workers' latest float buffers.
        start: a worker takes its first reply at its first forward pass (a one-shot forward
            pre-hook) or step; False: only when :meth:`start` is called (the CLI's worker loop,
            whose resumed workers may have nothing left to do).
        optimizer: a ``torch.optim.SGD`` whose param groups this object shares (the front door
            passes the one you give it): a write to its ``lr`` or ``weight_decay`` (a scheduler
            built on it, a hand-written warm-up) is what the next push carries, as a write to
            ``opt.param_groups`` is; its ``momentum`` too where momentum is the algorithm's
            (smega2, dana, nag). None: this object holds its own groups (``lr``,
            ``param_groups``).

    What trains is the model as it is when training starts: the server takes its model's
    parameters at :meth:`serve` (a ``model.load_state_dict`` after this constructor, on every
    rank, is kept), and a worker whose model was changed after this constructor checks at its
    first reply that the server's θ holds the same change (else one line: load it on the server
    rank too). A change to a worker's parameters between two steps (in place, under
    ``no_grad``) would be overwritten by the next reply: it is an error (one line), except for
    the rules whose workers keep a model of their own (shat, shat-root, ensemble), where the
    change trains. ``requires_grad`` is read at every push: a parameter frozen on the pushing
    worker is left untouched by that push, one unfrozen is trained from its next push on.
    """

    #: ``on_survivors(comm)``: the final close goes over the survivors and hands them on
    #: (:meth:`close`; set by :class:`hpcasync.elastic.State` under ULFM)
    on_survivors: Callable[[Any], None] | None = None
    #: a :class:`~.growth.PSGrowth`: under grow-back (set by :class:`hpcasync.elastic.State`) the
    #: server spawns a replacement for a dead worker and stops every worker for it
    #: (:meth:`regrow`, ``GrowInterrupt``)
    growth: Any = None

    def __init__(self, model, algorithm: str = "asgd", *, lr: float, comm=None,
                 ps_rank: int | None = None, transport: str = "rma", ps_ranks: int | None = None,
                 steps_per_epoch: int | None = None, epochs: int | None = None,
                 warmup_epochs: float | None = None, average_buffers: bool = True,
                 start: bool = True, param_groups: list[dict] | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **hyper: Any):
        if algorithm not in RULES:
            raise ConfigError(f"unknown parameter-server algorithm {algorithm!r} "
                              f"(choose from {', '.join(RULES)})")
        self.algorithm = algorithm
        self.hyper = {"lr": lr, **hyper}
        probe = make_rule(algorithm, torch.zeros(1), 1, **self.hyper)  # check before any collective
        if getattr(probe, "stop_stale", False):
            raise ConfigError(STOP_IN_SIM_ONLY)
        if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int)
                                            or steps_per_epoch < 1):
            raise ConfigError(f"steps_per_epoch must be a positive integer, got {steps_per_epoch!r}")
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int)
                                   or epochs < 1):
            raise ConfigError(f"epochs must be a positive integer (None: as many as the pushes "
                              f"cross), got {epochs!r}")
        if (ps_lr_factor(algorithm, 2, warmup_epochs) is not None and warmup_epochs != 0
                and steps_per_epoch is None):
            raise ConfigError(
                f"{algorithm} warms its learning rate up over "
                f"{5 if warmup_epochs is None else warmup_epochs:g} epochs (the paper's schedule): "
                "pass steps_per_epoch=<pushes per worker and epoch, e.g. len(loader)>, or "
                "warmup_epochs=0 to train without it")
        flat = as_flat(model)
        if comm is None or ps_rank is None:
            topo = default_topology()
            if comm is None and ps_ranks is None:
                ps_ranks = topo.ps_ranks             # hpcasync.init(ps_ranks=...)
            comm = topo.world if comm is None else comm
            ps_rank = topo.ps_rank if ps_rank is None else ps_rank
        if comm.Get_size() < 2:
            raise TopologyError(f"{algorithm} needs a parameter server and at least one worker: "
                                "start 2 or more ranks")
        if not 0 <= ps_rank < comm.Get_size():
            raise TopologyError(f"ps rank {ps_rank} does not exist in a world of "
                                f"{comm.Get_size()} ranks")
        ps_ranks = check_shards(1 if ps_ranks is None else ps_ranks, comm.Get_size(), flat.numel)
        if steps_per_epoch is not None and epochs is not None:    # the run's length is known
            W = comm.Get_size() - ps_ranks
            make_rule(algorithm, torch.zeros(1), W, **self.hyper).check_run_length(
                W * steps_per_epoch * epochs)
        self._own_groups(flat, param_groups, probe, optimizer)
        self.steps_per_epoch, self.epochs = steps_per_epoch, epochs
        self.warmup_epochs = warmup_epochs
        self.sync_buffers = bool(average_buffers) and flat.buffer_numel > 0
        self._transport_name, self._start = transport, start
        self.steps, self.comm, self.ps_rank, self.attached = 0, comm, ps_rank, False
        self._closed = False
        try:
            self._attach(comm, ps_rank, ps_ranks, probe)
        except Exception as exc:       # noqa: BLE001 - ULFM: a rank died while setting up
            if not self._died_while_attaching(exc, comm):
                raise
        _LIVE.append(weakref.ref(self))
        atexit.register(ParameterServer._at_exit, weakref.ref(self))

    def _died_while_attaching(self, exc: BaseException, comm) -> bool:
        """Under ULFM, an MPI error of the set-up's collectives where a rank of ``comm`` died
        (found by a barrier: a collective over a duplicate reports a death with its own error
        class): ``comm`` is revoked and the object stays unattached (:attr:`attached` False:
        each call says the death in one line; :class:`hpcasync.elastic.State`'s first sync
        resets, and the reset attaches it on the survivors)."""
        from mpi4py import MPI

        from .takeover import known_dead

        if not (ft.ulfm_enabled() and isinstance(exc, MPI.Exception) and known_dead(comm)):
            return False
        from ..runtime.elastic import revoke_all

        revoke_all([comm])
        log.info("a rank died while the %s parameter server was set up (%s); the elastic loop "
                 "sets it up again on the survivors", self.algorithm, exc)
        return True

    def _attach(self, comm, ps_rank: int, ps_ranks: int, probe) -> None:
        """Collective over ``comm``: every rank takes the server's parameters and buffers, the
        shards, transports and rules are built, the role's state starts fresh (the
        constructor's; a takeover's on the survivors, :meth:`take_over`)."""
        flat, algorithm = self.flat, self.algorithm
        others = [o for o in (ref() for ref in _LIVE) if o is not None and not o._closed
                  and o is not self]
        self._own_comm = bool(others)   # its messages apart from the other optimizers' (same tags)
        if self._own_comm:
            comm = comm.Dup()
        self.comm, self.ps_rank = comm, ps_rank
        for tensor in (flat.params, flat.buffers):          # every worker starts from the server's
            if tensor.numel():
                broadcast(comm, tensor, root=ps_rank)
        inject.point("attach")
        self._mark = self._param_version()     # the model as built: a later change is the user's
        if len(set(comm.allgather(self._groups_key))) > 1:
            raise ConfigError(f"{algorithm}: the ranks' optimizers have different param groups "
                              "(each parameter must be in the same group on every rank, or "
                              "outside them on every rank)")
        if self._index is not None:
            probe.set_groups(torch.zeros(1, dtype=torch.int64), len(self.param_groups))
        self.layout = L = ShardLayout.build(comm, ps_rank=ps_rank, shards=ps_ranks,
                                            numel=flat.numel)
        self.shard, self.worker_ranks = L.shard, L.workers
        # one transport per shard this rank is in (a server: its own; a worker: all K)
        self.transports = [make_transport(
            self._transport_name, c, ps_rank if L.K == 1 else 0, L.slice(flat.params, s).numel(),
            extra=flat.buffer_numel if s == 0 else 0,
            reply_scalars=probe.reply_scalars, groups=len(self.param_groups),
            params=len(flat.parameters))
            for s, c in enumerate(L.comms) if c is not None]
        self.transport = self.transports[0]
        for t in self.transports[1:]:       # a push is one "push" phase: shard 0's
            t.push_phase = "shard_push"
        self.num_workers, self.worker = self.transport.num_workers, self.transport.worker
        self.is_server = self.transport.is_ps
        W = self.num_workers
        theta = flat.params.detach().cpu()
        self.rules = [make_rule(algorithm, L.slice(theta, s).clone(), W, **self.hyper)
                      for s in (range(L.K) if not self.is_server else [max(L.shard, 0)])]
        if self._index is not None:               # param groups, or parameters never trained
            for s, rule in zip(range(L.K) if not self.is_server else [max(L.shard, 0)], self.rules):
                rule.set_groups(L.slice(self._index, s), len(self.param_groups))
                rule.lr, _, rule.weight_decay = self._hyper_now()
        self.rule = self.rules[0]
        self.versions = [0] * len(self.rules)
        self.needs_loss = algorithm == "lcasgd"
        # SHAT/ENSEMBLE: a worker's model is its own, not a copy of a reply (checkpoints carry it)
        self.keeps_local = bool(getattr(self.rule, "keeps_local", False))
        # worker side
        self.version = self.rejected = 0
        self._resume_local: torch.Tensor | None = None
        self.started = self.finished = self.stopped = False
        self._grow_pending = False      # the server stopped this worker for a grow-back
        self._ended: bool | None = None   # the end handshake's result, once it was made
        self._survivors: tuple | None = None     # close() over survivors: (server, size) there
        self._regrow_with: dict | None = None    # server, between a grow's stop and regrow()
        self._grown_places: dict | None = None   # server, after regrow(): the replaced commits
        self._finish_at: int | None = None            # finish_after()
        self._reply = torch.empty(flat.numel) if not self.is_server else None
        # server side
        self.served = False
        self._buffers = torch.zeros(W, flat.buffer_numel) if self.is_server else None
        self._seen = [False] * W
        self.server: PSServer | None = None          # serve()'s loop
        self._clock: list | None = None               # take_over(): where the epoch clock starts
        self._ordered = None                          # make_server(): the transport in push order
        self._epoch_exchange: EpochExchange | None = None   # make_server(), K > 1
        self._closed = False
        # save_checkpoint / load_checkpoint from a user's loop (:mod:`.loop_checkpoint`)
        self.checkpoints = LoopCheckpoints(self)
        self._frozen_now = self._frozen_mask()        # server: the groups the rules follow now
        self._frozen_index: dict[tuple, torch.Tensor | None] = {}
        if self.is_server:
            log.info("%s", self.describe())
        self._hook, self.attached = None, True
        if not self.is_server and self._start:
            ref = weakref.ref(self)
            self._hook = flat.module.register_forward_pre_hook(
                lambda module, args: ref() is not None and ref().start())

    def holding(self, shard: int = -1, shards: int = 1) -> dict:
        """What this rank brings to a takeover (:meth:`take_over`), taken once before its
        collectives, so that a death inside them runs it again from the same: ``vote``
        (:func:`.takeover.elect`'s ``(version, steps, shard, versions)``; ``shard``: the one
        this rank serves, -1 on a worker; ``shards``: how many), ``theta`` (a worker's last
        reply, a server's θ in the model, the model itself before the set-up completed), the
        float ``buffers``, the integer ones (``ints``: ``num_batches_tracked``) and a
        SHAT/ENSEMBLE worker's ``local`` model."""
        if not self.attached:           # a death while it was set up: every θ is the initial one
            theta, version, versions = self.flat.params.detach().cpu().clone(), 0, None
        elif self.is_server:
            self.load_theta()
            theta, version, versions = self.flat.params.detach().cpu().clone(), \
                int(self.rule.version), None
        else:
            theta, version, versions = self.last_reply(), int(self.version), list(self.versions)
        local = (self.local_model() if self.attached and self.keeps_local and not self.is_server
                 else None)
        ints = {n: b.detach().cpu().clone() for n, b in self.flat.module.named_buffers()
                if not b.is_floating_point()}
        return {"vote": (version, self.steps, shard, versions or [version] * shards),
                "theta": theta, "buffers": self.flat.buffers.detach().clone(), "ints": ints,
                "local": local}

    def take_over(self, comm, ps_rank: int, held: dict, *, ps_ranks: int = 1,
                  theta: torch.Tensor | None = None, positions: list[int] | None = None,
                  survivors: list | None = None) -> None:
        """Collective over ``comm``, the survivors of a dead server (ULFM): rank ``ps_rank`` of
        ``comm`` serves from now on (with the ``ps_ranks - 1`` after it), from ``theta`` (the
        shards assembled from their freshest sources) or else the θ it held (``held``,
        :meth:`holding`: the freshest when it is the survivor with the newest reply), with fresh
        rules whose epoch clock starts at each worker's ``positions[w]`` (its pushes so far);
        each worker keeps its own buffers (and SHAT's and ENSEMBLE's workers their own models)
        and takes its first reply from the new server at its next step. ``survivors``, on the
        new server: what each rank of ``comm`` held (:meth:`holding`'s ``buffers`` and
        ``ints``; None for a replacement), whose BatchNorm state the server takes
        (:meth:`_seed_buffers`). The old windows are left to ``MPI_Finalize``. Run again on a
        smaller world when a rank dies inside it."""
        self._set_up_again(comm, ps_rank, held, ps_ranks, theta, positions)
        if self.is_server and survivors is not None and self.shard <= 0:   # (shard 0's buffers)
            self._seed_buffers(survivors)
        if self.shard <= 0 and self.flat.buffer_numel:
            inject.dump(f"takeover-{'server' if self.is_server else 'worker'}-"
                        f"{comm.Get_rank()}", model=self.flat.buffers,
                        worker_ranks=list(self.worker_ranks),
                        survivors=(None if not self.is_server or survivors is None else
                                   [h and h["buffers"] for h in survivors]),
                        ints={n: b for n, b in self.flat.module.named_buffers()
                              if not b.is_floating_point()})

    def _set_up_again(self, comm, ps_rank: int, held: dict, ps_ranks: int = 1,
                      theta: torch.Tensor | None = None, positions: list | None = None) -> None:
        """:meth:`take_over`'s and :meth:`regrow`'s set-up over ``comm`` (collective)."""
        for t in getattr(self, "transports", []):
            t.close(collective=False)
        self.transports = []
        if getattr(self, "_hook", None) is not None:
            self._hook.remove()
            self._hook = None
        if comm.Get_rank() == ps_rank:
            self.flat.params.copy_(held["theta"] if theta is None else theta)
        steps = held["vote"][1]
        inject.point("adopt", fire=comm.Get_rank() == ps_rank)
        self._attach(comm, ps_rank, ps_ranks,
                     make_rule(self.algorithm, torch.zeros(1), 1, **self.hyper))
        self.steps, self._clock = steps, positions
        if not self.is_server:
            self.flat.buffers.copy_(held["buffers"])
            if held["local"] is not None:
                self.resume_local(held["local"])

    def _seed_buffers(self, survivors: list) -> None:
        """The new server's BatchNorm state after a takeover (the set-up's broadcast gave every
        worker the server's buffers; each worker then takes its own back): its buffer table
        holds each remaining worker's float buffers, marked seen, and its model their mean as
        :meth:`load_theta` computes it (bitwise); its integer buffers (``num_batches_tracked``)
        take the survivors' max (a server never trains: no count of its own). Its own buffers
        from its time as a worker are not in the table (it no longer pushes); a replacement
        (None) has no row until its first push."""
        held = [h for h in survivors if h is not None]
        ints = {n: torch.stack([h["ints"][n] for h in held]).max(0).values
                for n in held[0]["ints"]}
        for name, buf in self.flat.module.named_buffers():
            if name in ints:
                buf.copy_(ints[name].to(buf))
        rows = [survivors[r] for r in self.worker_ranks]
        if not self.flat.buffer_numel or not any(rows):
            return
        if self.sync_buffers:
            self.load_buffer_state({
                "buffers": torch.stack([h["buffers"].cpu() if h is not None else
                                        torch.zeros(self.flat.buffer_numel) for h in rows]),
                "seen": [h is not None for h in rows]})
            self.load_theta()
        else:                        # no average: the mean of the workers' buffers all the same
            self.flat.buffers.copy_(torch.stack([h["buffers"] for h in rows if h is not None])
                                    .mean(0).to(self.flat.buffers))

    # -- param groups ---------------------------------------------------------------------------
    def _own_groups(self, flat, param_groups, probe, optimizer) -> None:
        """The param groups: ``optimizer``'s, shared (its ``lr``/``weight_decay`` per group, its
        ``momentum`` where the algorithm's momentum is that); else one per user group (default:
        one over the model), each with its ``lr`` and ``weight_decay``, and the rule's
        ``momentum`` (one for all groups; exposed so that schedulers such as OneCycleLR cycle
        it). Parameters in no group are never moved, nor are those with ``requires_grad=False``
        while they have it (``rules.base``, param groups)."""
        momentum = getattr(probe, "momentum", 0.0)
        self._server_momentum = momentum            # a shared SGD's momentum is not the rule's
        self._momentum_in_groups = optimizer is None or self.algorithm in MOMENTUM_RULES
        wd = self.hyper.get("weight_decay", 0.0)
        lr = self.hyper["lr"]
        if optimizer is not None:
            if param_groups is not None:
                raise ConfigError(f"{self.algorithm}: pass param_groups or optimizer, not both")
            self._wrap(flat, optimizer)
        elif param_groups is None:
            groups = [{"params": list(flat.module.parameters())}]
        else:
            mine = {id(p) for p in flat.module.parameters()}
            groups = []
            for g in param_groups:
                extra = sorted(set(g) - {"params", "lr", "weight_decay", "momentum"})
                if extra:
                    raise ConfigError(f"{self.algorithm}: param group keys {extra} are not used "
                                      "by the parameter server (lr, weight_decay, momentum are)")
                params = [g["params"]] if torch.is_tensor(g["params"]) else list(g["params"])
                if any(id(p) not in mine for p in params):
                    raise ConfigError(f"{self.algorithm}: a param group holds tensors that are "
                                      "not parameters of the model")
                groups.append({**g, "params": params})
            moms = {float(g.get("momentum", momentum)) for g in groups}
            if len(moms) > 1:
                raise ConfigError(f"{self.algorithm}: the param groups disagree on momentum "
                                  f"({sorted(moms)}); the server has one momentum for all groups")
            momentum = moms.pop() if moms else momentum
        if optimizer is None:
            torch.optim.Optimizer.__init__(self, groups, {"lr": lr, "weight_decay": wd,
                                                          "momentum": momentum})
            self.flat, self.optimizer = flat, None
        where = group_index(flat, self.param_groups)
        self._members = group_index(flat, self.param_groups, requires_grad=False)
        self._groups_key = (len(self.param_groups), tuple(self._members))
        self._index = self._element_index(where)
        self._hyper_now()                                  # check the values now

    def _check_new_group(self) -> None:
        raise ConfigError(f"{self.algorithm}: add_param_group after hpcasync.optimizer(...) is not "
                          "supported by a parameter-server rule: its server fixed the param "
                          "groups (each one's slice of θ) at set-up; create every group before "
                          "(a group with lr 0, or requires_grad=False, trains nothing until you "
                          "change it)")

    def _element_index(self, where: list[int]) -> torch.Tensor | None:
        """Per element of θ the group of its parameter (``where``: per parameter, -1 for never
        moved), or None when one group holds every parameter (the rules' plain path)."""
        if len(self.param_groups) == 1 and min(where) >= 0:
            return None
        return self.flat.per_element(where, dtype=torch.int64).cpu()

    def _frozen_mask(self) -> tuple[int, ...]:
        """Which parameters have ``requires_grad=False`` now (:func:`~.wire.mask_words`)."""
        return mask_words(not p.requires_grad for p in self.flat.parameters)

    def _follow_frozen(self, words: tuple[int, ...]) -> None:
        """Server: a push from a worker whose frozen parameters are ``words``: the rule's groups
        leave exactly those (and the parameters in no group) untouched by it."""
        if words == self._frozen_now:
            return
        self._frozen_now = words
        if words not in self._frozen_index:
            if len(self._frozen_index) >= 8:
                self._frozen_index.pop(next(iter(self._frozen_index)))
            flags = mask_flags(words, len(self._members))
            index = self._element_index([-1 if f else g for g, f in zip(self._members, flags)])
            self._frozen_index[words] = (None if index is None else
                                         self.layout.slice(index, max(self.shard, 0)))
        self.rule.set_groups(self._frozen_index[words], len(self.param_groups))

    def _param_version(self) -> int:
        """The sum of the parameters' version counters: torch raises a tensor's on every in-place
        change made through it (``load_state_dict``, edits under ``no_grad``, an optimizer's
        step); our own writes go through the flat buffer, which does not raise them."""
        return sum(p._version for p in self.flat.parameters)

    def _hyper_now(self):
        """What a push carries: lr and weight decay (one per group when there are several) and
        the momentum, checked (one line if the groups' momenta were set apart)."""
        groups = self.param_groups
        if self._momentum_in_groups:
            momentum = groups[0].get("momentum", 0.0)
            if any(g.get("momentum", 0.0) != momentum for g in groups):
                raise ConfigError(f"{self.algorithm}: the param groups disagree on momentum "
                                  f"({[g.get('momentum') for g in groups]}); the server has one "
                                  "momentum for all groups")
        else:
            momentum = self._server_momentum
        momentum = check_real("momentum", float(momentum), low=0.0, high=1.0, high_open=True)
        lrs = tuple(self.lr(i) for i in range(len(groups)))
        wds = tuple(float(g["weight_decay"]) for g in groups)
        if len(groups) == 1:
            return lrs[0], momentum, wds[0]
        return lrs, momentum, wds

    # -- worker side ----------------------------------------------------------------------------
    def start(self) -> None:
        """Worker: take the server's first reply (done at construction unless ``start=False``)."""
        self._worker_only("start")
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if not self.started:
            changed = self._param_version() != self._mark
            mine = self.flat.params.detach().cpu().clone() if changed else None
            head = self._replies(None, poll=Patience(
                f"{self.algorithm} worker {self.worker}: waiting for the parameter server's first "
                f"reply for %d s: does rank {self.ps_rank} call opt.serve()? (several "
                "parameter-server optimizers: hpcasync.serve(opt_a, opt_b) on the server)"))
            self.version, self.started = head.version, True
            if mine is not None and head.version == 0:
                self._check_same_change(mine)
            if self._resume_local is not None:      # a resumed SHAT/ENSEMBLE worker: its own model
                self.flat.params.copy_(self._resume_local)
                self._resume_local = None
            self._mark = self._param_version()

    def _check_same_change(self, mine: torch.Tensor) -> None:
        """Worker, at its first reply from a server that has applied nothing yet, when its model
        was changed after the constructor (e.g. ``model.load_state_dict``): that reply (θ, every
        rule's first reply before any push) must hold the same values, since θ is what trains;
        else one line. (A server resumed from a rule state replies later versions: the load was
        a checkpoint's, on every rank.)"""
        if not torch.equal(self._reply, mine):
            raise ConfigError(
                f"{self.algorithm} worker {self.worker}: the model's parameters were changed after "
                "hpcasync.optimizer(...) (e.g. model.load_state_dict) on this worker, but the "
                f"parameter server (rank {self.ps_rank}) holds other values, and its θ is what "
                "trains: make the same change on every rank, the server's included, before "
                "training starts")

    def _check_unchanged(self) -> None:
        """Worker, before a push: a change of its parameters since the last reply (in place,
        e.g. under ``no_grad``) would be overwritten by the next reply, where torch would train
        it: one line. Workers that keep a model of their own train it, changes included."""
        if self._param_version() == self._mark or self.keeps_local:
            return
        raise ConfigError(
            f"{self.algorithm} worker {self.worker}: the model's parameters were changed in place "
            "between two steps (load_state_dict, or an edit under torch.no_grad()); with a "
            "parameter server the next reply replaces them by the server's θ, so the change would "
            "be lost: make such changes on every rank before training starts (the server takes "
            "its model's values at serve())")

    def resume_local(self, local: torch.Tensor) -> None:
        """Worker (rules that keep a local model, ``keeps_local``): continue from ``local`` (a
        checkpoint's) instead of the server's θ; applied after the first reply (or now, after it)."""
        self._worker_only("resume_local")
        if local.numel() != self.flat.numel:
            raise CheckpointError(f"worker {self.worker}'s saved local model has {local.numel()} "
                                  f"elements, the model {self.flat.numel}")
        self._resume_local = local.detach().to(self.flat.params).clone()
        if self.started:
            self.flat.params.copy_(self._resume_local)
            self._resume_local = None

    def local_model(self) -> torch.Tensor:
        """Worker: its model for a checkpoint (a CPU copy; the one :meth:`start` will apply)."""
        local = self._resume_local if self._resume_local is not None else self.flat.params
        return local.detach().cpu().clone()

    def step(self, closure=None, *, loss=None):
        """Push this rank's gradient, take the reply into the model (the worker's step).

        ``loss``: the mini-batch loss at the parameters the gradient was computed on (a tensor or
        float); lcasgd needs it, the others send it for the server's divergence check and logs.
        """
        if closure is not None:
            raise ConfigError(f"{self.algorithm}: step() does not take a closure")
        self._worker_only("step")
        if self._grow_pending:
            self._leave_for_grow()
        if loss is None and self.needs_loss:
            raise ConfigError(f"{self.algorithm} predicts each worker's loss: call "
                              "opt.step(loss=loss) with the batch's loss")
        value = math.nan if loss is None else float(loss.detach() if torch.is_tensor(loss) else loss)
        self._collect()
        self.push(loss=value)
        if self._finish_at is not None and self.steps >= self._finish_at:
            self.finish()
        return None

    def finish_after(self, steps: int | None) -> None:
        """Worker: :meth:`finish` right after the ``steps``-th step (None: only when called). A
        Horovod script has no finish call; with its length known, every worker then holds the
        server's final model after its last step."""
        self._worker_only("finish_after")
        self._finish_at = None if steps is None else int(steps)

    def push(self, grad: torch.Tensor | None = None, *, loss: float = math.nan,
             oracle_loss: float = math.nan, last: bool = False, stop: bool = False):
        """Worker: one push of ``grad`` (default: the flat gradient buffer) and this rank's float
        buffers, then the reply into the model's parameters. Returns the reply's header. The
        CLI's worker loop uses the keywords (LC-ASGD's oracle, its last-push flag, preemption)."""
        if self.finished:
            raise ConfigError(f"{self.algorithm}: step() after finish()")
        if not self.started:
            self.start()
        else:
            self._check_unchanged()
        g = self.flat.grads if grad is None else grad
        pieces = worker_pieces(self.layout, g.cpu(), self.flat.numel)
        lr, momentum, weight_decay = self._hyper_now()
        frozen = self._frozen_mask()
        for s, (t, piece) in enumerate(zip(self.transports, pieces)):   # all leave, then replies
            t.push(piece, self.flat.buffers.cpu() if s == 0 else None, version=self.versions[s],
                   loss=loss, oracle_loss=oracle_loss, last=last, stop=stop, lr=lr,
                   momentum=momentum, weight_decay=weight_decay, frozen=frozen)
        head = self._replies(g)
        self._mark = self._param_version()
        self.version = head.version
        self.steps += 1
        self.rejected += not head.accepted
        if last:
            self.finished = True
        elif head.stop:
            self.finished = self.stopped = True         # the server stopped the job (preemption)
            if self.growth is not None:     # (or a grow-back: then the next call leaves)
                self.finish(collective=False)
        return head

    def _replies(self, g, poll=None):
        """Worker: every shard's reply into its slice of the model, through that shard's
        worker-side rule (``g``: the pushed gradient, None for the first reply). One header back:
        accepted if every shard accepted, stop if any stops (they agree, :mod:`.shards`); its
        version is shard 0's (``versions`` holds each shard's)."""
        L, heads = self.layout, []
        for s, t in enumerate(self.transports):
            out = L.slice(self._reply, s)
            head = t.recv_reply(out, poll=poll)
            self.rules[s].on_reply(L.slice(self.flat.params, s),
                                   Reply(out.to(self.flat.device), head.version, head.scalars),
                                   L.slice(g, s) if g is not None and head.accepted else None)
            self.versions[s] = head.version
            heads.append(head)
        head = heads[0]
        if len(heads) > 1:
            if len({h.accepted for h in heads}) > 1:
                log.warning("%s worker %d: the shards disagree on accepting a push (%s)",
                            self.algorithm, self.worker, [h.accepted for h in heads])
            head.accepted = all(h.accepted for h in heads)
            head.stop = any(h.stop for h in heads)
        return head

    def peek(self, out: torch.Tensor) -> None:
        """Worker: every server's current θ slice into ``out`` (a PEEK message to each; LC-ASGD's
        oracle)."""
        for t in self.transports:
            t.push(self.flat.grads, kind=KIND_PEEK)
        for s, t in enumerate(self.transports):
            t.recv_reply(self.layout.slice(out, s))

    def last_reply(self) -> torch.Tensor:
        """Worker: a CPU copy of the θ it holds from the server (its last reply; before the
        first, the broadcast start). A worker taking over a dead server starts from it."""
        return (self._reply if self.started else self.flat.params).detach().cpu().clone()

    def finish(self, *, stop_requested: Callable[[], bool] | None = None, collective=True):
        """Worker: no more pushes. Waits for the server's end message, reports the step count,
        then (``collective``) takes the final model with every other rank. Returns the model on
        ``collective``, else whether the server stopped the job (preemption)."""
        self._worker_only("finish")
        if self._grow_pending:
            self._leave_for_grow()
        if self._closed:
            return self.flat.module
        if self._ended is None:        # (once: a grow-back's stop may have taken the end)
            self._ended = self._end(stop_requested)
        stop = self._ended
        if self.growth is not None and self.transport.end_code == END_GROW:
            self._grow_pending = True
            if collective:
                self._leave_for_grow()
        if not collective:
            return stop
        self.close()
        return self.flat.module

    def _end(self, stop_requested) -> bool:
        """Worker: the end handshake (FINISH unless stopped, its requests taken, the end message,
        DONE with its step count); whether the server stopped the job."""
        if not self.started and not self.finished and self._hook is not None:
            self.start()        # a user's worker that never stepped (e.g. resumed at its end)
        if self.started and not self.finished:
            for t, v in zip(self.transports, self.versions):
                t.push(torch.zeros(0), kind=KIND_FINISH, version=v)
        self.finished = True
        self.checkpoints.flush()       # its FINISH header counted them: the server takes them now
        if len(self.transports) == 1:
            stop = self.transport.wait_end(stop_requested)
        else:
            stop = wait_ends(self.transports, stop_requested)
        for t in self.transports:
            t.push(torch.zeros(0), kind=KIND_DONE, version=self.steps)
        return stop

    # -- server side ----------------------------------------------------------------------------
    def make_server(self, **callbacks: Any) -> PSServer:
        """Server: the :class:`PSServer` loop over this rule, with the epoch clock, the lr factor
        and (``average_buffers``) the workers' buffers wired in; ``callbacks`` go to PSServer."""
        self._server_only("serve")
        self.served = True
        self._adopt_model()
        W = self.num_workers
        ppe = W * self.steps_per_epoch if self.steps_per_epoch else None
        on_buffers = self._take_buffers if self.sync_buffers else None
        told = callbacks.get("on_failure")

        def on_failure(record: dict) -> None:     # a dead worker leaves the buffer average
            self._seen[record["worker"]] = False
            if told is not None:
                told(record)
        callbacks["on_failure"] = on_failure
        if self.layout.K > 1:
            hook = self._epoch_exchange = EpochExchange(self, callbacks.get("on_epoch"))
            callbacks.update(on_epoch=hook, on_served=hook.end, worker_ranks=self.layout.workers)
        self._ordered = ordered(self.transport, self.layout)      # K > 1: shard 0's order
        return PSServer(self._ordered, self.rule, pushes_per_epoch=ppe, epochs=self.epochs,
                        lr_factor=ps_lr_factor(self.algorithm, W, self.warmup_epochs),
                        on_buffers=on_buffers, on_frozen=self._follow_frozen, **callbacks)

    def _adopt_model(self) -> None:
        """Server, before serving: θ takes the model's current parameters when they were changed
        after the constructor (``model.load_state_dict(...)`` in the usual torch order: model,
        optimizer, then the loads), so the model as the user left it is what trains."""
        s = max(self.shard, 0)
        mine = self.layout.slice(self.flat.params, s).detach().cpu()
        if torch.equal(mine, self.rule.theta):
            return
        log.info("PS %s: the server's model was changed after hpcasync.optimizer(...): training "
                 "starts from its current parameters", self.algorithm)
        if self.rule.version == 0:               # nothing applied yet: the rule as if built now
            rule = make_rule(self.algorithm, mine.clone(), self.num_workers, **self.hyper)
            if self._index is not None:
                rule.set_groups(self.layout.slice(self._index, s), len(self.param_groups))
            rule.lr, _, rule.weight_decay = self._hyper_now()
            self.rules[0] = self.rule = rule
        else:                                     # a loaded rule state: its θ takes the change
            self.rule.theta.copy_(mine)

    def serve(self, *, on_epoch: Callable[[int, torch.nn.Module], Any] | None = None,
              collective: bool = True, **callbacks: Any):
        """Server: apply the rule to every push until every worker has finished; then every rank
        takes the final model (``collective``). ``on_epoch(epoch, model)`` is called with θ in the
        model at each epoch crossing (with ``steps_per_epoch``), e.g. to evaluate. Returns the
        model. Several ParameterServers in one job are served together: :func:`serve`."""
        others = [o for o in live() if o is not self and o.is_server and not o.served]
        if others:
            raise ConfigError(
                f"rank {self.comm.Get_rank()} serves {len(others) + 1} parameter-server "
                f"optimizers ({', '.join(o.algorithm for o in [self, *others])}): serve them "
                "together with hpcasync.serve(opt_a, opt_b, ...) (one opt.serve() at a time would "
                "wait for its pushes while the workers wait for the other's replies)")
        server, collector = self._begin_serving(on_epoch, callbacks)
        server.serve()
        return self._end_serving(server, collector, collective)

    def _begin_serving(self, on_epoch, callbacks) -> tuple[PSServer, Any]:
        """Server: its loop (:meth:`make_server`), with the epoch callback, the checkpoint
        requests and (:attr:`growth`) the grow-back wired in."""
        def crossed(epoch: int, record: dict) -> None:
            self.load_theta()
            log.info("PS %s: epoch %d crossed at version %d (%d pushes accepted, %d rejected)",
                     self.algorithm, epoch, self.rule.version, record.get("pushes", 0),
                     record.get("rejected_pushes", 0))
            if on_epoch is not None:
                on_epoch(epoch, self.flat.module)
        callbacks.setdefault("on_push", lambda w, staleness, loss: inject.point("served"))
        if self.growth is not None:
            self.growth.wire(callbacks, lambda: server, self.transport, self.comm.Get_size())
        server = self.make_server(on_epoch=crossed, **callbacks)
        if self._clock:
            server.start_at(self._clock)
        self.server = server
        collector = self.checkpoints.attach(server)     # a loaded clock; the workers' requests
        return server, collector

    def _end_serving(self, server: PSServer, collector, collective: bool):
        """Server, after its loop: the checkpoints asked for, the end messages, θ in the model
        and (``collective``) the final model on every rank; after a grow-back's stop, what the
        run goes on from (:meth:`regrow`), and ``GrowInterrupt``."""
        collector.close()
        server.finish()
        self.load_theta()
        if server.grow:
            self._keep_for_grow(server, collector)
            self._leave_for_grow()
        if collective:
            self.close()
        return self.flat.module

    # -- grow-back in your own loop (:attr:`growth`) ------------------------------------------
    def _keep_for_grow(self, server: PSServer, collector) -> None:
        """Server, after the grow-back's stop: the clock the server goes on with after
        :meth:`regrow` (each replaced worker's position back at its last commit the server took,
        0 without one: its replacement redoes the pushes after it) and each replaced worker's
        commit (:meth:`hpcasync.elastic.State.sync` gives it to the replacement)."""
        places = {w: self.checkpoints.commits.get(w) for w in server.failed}
        clock = {k: v for k, v in server.state_dict().items() if k != "rule"}
        clock["failed_workers"] = server.replaced_workers()
        positions = list(server.positions)
        for w, commit in places.items():
            positions[w] = commit["steps"] if commit is not None else 0
        self._regrow_with = {"clock": {"server": clock, "positions": positions},
                             "places": places, "buffers": self._buffers.clone(),
                             "seen": list(self._seen), "rule": self.rule}

    def _leave_for_grow(self):
        """Every rank, once the server stopped the workers for a grow-back: the transports
        closed over the survivors and the death absorbed (:attr:`on_survivors`); the server
        spawns what it has not for the emptied places; then ``GrowInterrupt``."""
        from ..runtime.elastic import GrowInterrupt

        self._grow_pending, before = False, self.comm.Get_size()
        self.close(broadcast_model=False)
        root, size = self._survivors or (self.ps_rank, before)
        groups = self.growth.top_up(before - size, size) if self.is_server else None
        raise GrowInterrupt(root, groups)

    def regrow(self, comm, ps_rank: int) -> None:
        """Collective over ``comm``, the world grown back after :meth:`_leave_for_grow` (the same
        collectives as a replacement's constructor): set up again, rank ``ps_rank`` serving;
        the server keeps its rule (θ, per-worker state), the workers' buffers and its clock
        (a replaced worker's position at its commit); a worker keeps its step count, buffers and
        (SHAT, ENSEMBLE) its own model, and takes its next reply from the server."""
        kept = self._regrow_with if self.is_server else None
        held = self.holding()
        self.transports = []                # (closed by _leave_for_grow)
        self._set_up_again(comm, ps_rank, held)
        if kept is not None:
            self.rules[0] = self.rule = kept["rule"]
            self._buffers.copy_(kept["buffers"])
            self._seen[:] = kept["seen"]
            self.checkpoints.resume_clock = kept["clock"]
            self._grown_places = kept["places"]

    def grown_places(self) -> dict:
        """Server, once after :meth:`regrow`: each replaced worker's commit (None: none)."""
        places, self._grown_places = self._grown_places or {}, None
        return places

    def describe(self) -> str:
        """The rule, its hyperparameters and the defaults in force, in words (logged by the
        server at construction)."""
        W = self.num_workers
        hyper = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in self.hyper.items())
        factor = ps_lr_factor(self.algorithm, W, self.warmup_epochs)
        warm = (5.0 if self.warmup_epochs is None else self.warmup_epochs) if factor else 0
        shards = (f"; {self.layout.K} shard servers (ranks {self.layout.servers})"
                  if self.layout.K > 1 else "")
        short = (f", longer than the run's {self.epochs} epoch(s): the lr ends at "
                 f"{factor(float(self.epochs)):.0%} of its full value"
                 if warm and self.epochs is not None and warm > self.epochs else "")
        return (f"{self.algorithm} on {W} workers ({hyper}); lr warm-up from lr/{W} over "
                f"{warm:g} epochs (warmup_epochs{short})" if warm else
                f"{self.algorithm} on {W} workers ({hyper}); no lr warm-up (warmup_epochs)") + \
            ("; the server's model takes the workers' mean BatchNorm buffers (average_buffers)"
             if self.sync_buffers else "") + f"; transport {self.transport.name}" + shards

    def _take_buffers(self, w: int, extra: torch.Tensor) -> None:
        self._buffers[w].copy_(extra)
        self._seen[w] = True

    def load_theta(self) -> None:
        """Server: the model takes θ (and the mean of the workers' latest buffers)."""
        self._server_only("load_theta")
        self.layout.slice(self.flat.params, max(self.shard, 0)).copy_(self.rule.theta)
        if self.sync_buffers and any(self._seen):
            self.flat.buffers.copy_(self._buffers[torch.tensor(self._seen)].mean(0))

    def buffer_state(self) -> dict:   # server: the workers' latest buffers, for a checkpoint
        return {"buffers": self._buffers.clone(), "seen": [int(x) for x in self._seen]}

    def load_buffer_state(self, state: dict) -> None:
        self._buffers.copy_(state["buffers"])
        self._seen[:] = [bool(x) for x in state["seen"]]

    # -- both -----------------------------------------------------------------------------------
    def close(self, comm=None, root: int | None = None, *, collective: bool = True,
              broadcast_model: bool = True) -> None:
        """Collective: free the transport and give every rank of ``comm`` (default the job's) the
        server's final parameters and buffers (``root``: the server's rank in ``comm``).
        ``collective=False``: a rank died, the windows are left to MPI_Finalize.

        With :attr:`on_survivors` (set by :class:`hpcasync.elastic.State` under ULFM) the
        default ``comm`` is the survivors' (``MPI_Comm_shrink``, also when nobody died: every
        rank takes the same branch): after a worker's death they take the final model over it
        and ``on_survivors(comm)`` moves the front door onto them."""
        if self._closed:
            return
        servers, survivors = list(self.layout.servers), None
        if comm is None and collective and self.on_survivors is not None:
            survivors, lost = ft.survivors(self.comm, True)
            if lost:
                moved = [ft.translate(r, self.comm, survivors) for r in servers]
                if min(moved) < 0:
                    dead = servers[moved.index(min(moved))]
                    raise ft.PSFailed(f"the parameter server (rank {dead}) died after "
                                      "serving; the final model is lost: restart from a "
                                      "checkpoint")
                servers = moved
                comm, root, collective = survivors, servers[0], False
                self._survivors = (root, survivors.Get_size())
            else:
                survivors.Free()
                survivors = None
        self._closed = True
        if self._ordered is not None and self._ordered is not self.transport:
            self._ordered.finish(collective=collective)  # :mod:`.ordering`'s messages
        if self._epoch_exchange is not None:             # a shard server's epoch messages
            self._epoch_exchange.finish(collective=collective)
        for t in self.transports:
            t.close(collective=collective)
        if collective:
            self.layout.free()
        if broadcast_model:
            self.hand_out(comm, root, servers)
        if self._own_comm and collective:
            self.comm.Free()
        if survivors is not None:
            self.on_survivors(survivors)

    def hand_out(self, comm=None, root: int | None = None, servers: list[int] | None = None
                 ) -> None:
        """Collective over ``comm`` (default the job's; ``root``: the server's rank in it,
        ``servers``: the shard servers' ranks in it, default the layout's translated): every rank
        takes the server's final parameters (each shard from its server) and buffers, and the
        workers' mean integer buffers (:func:`mean_int_buffers`). The end of :meth:`close`; the
        CLI calls it after its own checks of who survived."""
        comm = self.comm if comm is None else comm
        root = self.ps_rank if root is None else root
        if servers is None:
            servers = [ft.translate(r, self.comm, comm) for r in self.layout.servers]
        if self.layout.K > 1:               # each server's slice from it (root: shard 0's server)
            for s, server in enumerate(servers):
                broadcast(comm, self.layout.slice(self.flat.params, s), root=root if s == 0
                          else server)
            if self.flat.buffers.numel():
                broadcast(comm, self.flat.buffers, root=root)
        else:
            for tensor in (self.flat.params, self.flat.buffers):
                if tensor.numel():
                    broadcast(comm, tensor, root=root)
        mean_int_buffers(comm, self.flat.module, self.is_server)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (after ``finish()``/``serve()``, collective)."""
        return self._closed

    def int_buffers(self) -> dict[str, torch.Tensor]:
        """The model's non-float buffers (BatchNorm's ``num_batches_tracked``, a counter of the
        user's): they are not in the flat buffer that travels with each push."""
        return {n: b for n, b in self.flat.module.named_buffers() if not b.is_floating_point()}

    def _at_exit_check(self) -> None:
        """Interpreter exit: a worker that never called finish() finishes now (so the server can
        end); a server that never served ends the job, saying so (the workers wait for it)."""
        if self._closed or not self.attached:
            return
        try:
            if self.is_server and not self.served:
                fail_fast(ConfigError(
                    f"rank {self.ps_rank} is the parameter server of {self.algorithm} and exited "
                    "without calling opt.serve(): the workers wait for it. Call opt.serve() on "
                    "the server rank (ctx.is_server)"))
            elif not self.is_server and self.started:
                log.warning("%s worker %d: finish() was not called; finishing at exit",
                            self.algorithm, self.worker)
                self.finish()
        except Exception as exc:  # noqa: BLE001 - at exit: report and end the job, never hang
            fail_fast(exc)

    @staticmethod
    def _at_exit(ref) -> None:
        opt = ref()          # a weak reference: registering must not keep the optimizer alive
        if opt is not None:
            opt._at_exit_check()

    def _check_attached(self) -> None:
        if not self.attached:
            raise ProcessFailedError(f"a rank died while the {self.algorithm} parameter server was "
                                     "set up; this loop cannot go on without it (under "
                                     "hpcasync.elastic.run it is set up again on the survivors)")

    def _worker_only(self, what: str) -> None:
        self._check_attached()
        if self.is_server:
            raise ConfigError(f"rank {self.comm.Get_rank()} is the parameter server of "
                              f"{self.algorithm}: call opt.serve() there, not {what}() "
                              "(hpcasync.init() tells each rank its role: ctx.is_server)")

    def _server_only(self, what: str) -> None:
        self._check_attached()
        if not self.is_server:
            raise ConfigError(f"rank {self.comm.Get_rank()} is a worker of {self.algorithm}: "
                              f"{what}() runs on the parameter server (rank {self.ps_rank}); "
                              "workers call step() and finish()")

    def _extra_state(self) -> dict:
        state = {"hyper": {k: v for k, v in self.hyper.items() if k != "lr"}}
        if not self.attached:
            state.update(steps=self.steps)
        elif self.is_server:
            state.update(rule=self.rule.state_dict(), **self.buffer_state())
        else:
            state.update(version=self.version, steps=self.steps)
        return state

    def _after_wrapped_load(self, base: dict, *, ours: bool) -> None:
        """The shared SGD took ``base``: a plain SGD's momentum buffers have no counterpart in
        the rules (their state is the server's): said, and dropped."""
        if not ours:
            self._unused_state_warning(base)
        self.optimizer.state.clear()

    def _load_extra(self, extra: dict) -> None:
        if not self.attached:
            return
        if not self.is_server and "steps" in extra:    # its pushes, as the server counts them
            self.steps = int(extra["steps"])
        if self.is_server and "rule" in extra:
            self.rule.load_state_dict(extra["rule"])
            self.load_buffer_state(extra)
            self.load_theta()

    def __repr__(self) -> str:
        role = "server" if self.is_server else f"worker {self.worker}/{self.num_workers}"
        return f"ParameterServer({self.algorithm}, {role}, lr={self.lr():g})"


def live() -> list[ParameterServer]:
    """The ParameterServers of this process not yet closed, in construction order."""
    out = [o for o in (ref() for ref in _LIVE) if o is not None and not o.closed]
    _LIVE[:] = [weakref.ref(o) for o in out]
    return out


def mean_int_buffers(comm, module: torch.nn.Module, is_server: bool) -> None:
    """Collective over ``comm``: every rank's integer and bool buffers take the workers' mean,
    rounded down (the servers count nothing; BatchNorm's ``num_batches_tracked`` and counters of
    the user's), so every rank ends with the same ``state_dict``."""
    from mpi4py import MPI

    bufs = [b for b in module.buffers() if not b.is_floating_point() and not b.is_complex()]
    if not bufs:
        return
    vec = torch.zeros(sum(b.numel() for b in bufs) + 1, dtype=torch.int64)
    if not is_server:
        vec[:-1] = torch.cat([b.detach().reshape(-1).to("cpu", torch.int64) for b in bufs])
        vec[-1] = 1
    comm.Allreduce(MPI.IN_PLACE, vec.numpy(), op=MPI.SUM)
    mean = torch.div(vec[:-1], max(int(vec[-1]), 1), rounding_mode="floor")
    with torch.no_grad():
        offset = 0
        for b in bufs:
            b.copy_(mean[offset: offset + b.numel()].view_as(b).to(b))
            offset += b.numel()


def serve(*optimizers: ParameterServer, on_epoch: Callable[[ParameterServer, int, torch.nn.Module],
                                                           Any] | None = None) -> list:
    """Server: serve several ParameterServers of one job together (a GAN's generator and
    discriminator, a model per task), each until its workers have finished; each then gives every
    rank its final model, in the order the workers finish them. ``on_epoch(opt, epoch, model)``
    at each epoch crossing of ``opt``. Returns the models::

        opt_d = hpcasync.optimizer("asgd", disc, torch.optim.SGD(disc.parameters(), lr=0.01))
        opt_g = hpcasync.optimizer("asgd", gen, torch.optim.SGD(gen.parameters(), lr=0.01))
        if ctx.is_server:
            hpcasync.serve(opt_d, opt_g)
        else:
            ...                               # opt_d.step(), opt_g.step() in any order
            opt_d.finish(); opt_g.finish()    # every worker in the same order

    One optimizer: the same as ``opt.serve()``. Sharded servers (``ps_ranks`` > 1) serve one
    optimizer only."""
    import time

    if not optimizers:
        raise ConfigError("hpcasync.serve() needs the parameter-server optimizers to serve")
    for opt in optimizers:
        if not isinstance(opt, ParameterServer):
            raise ConfigError(f"hpcasync.serve() serves parameter-server optimizers, got "
                              f"{type(opt).__name__}")
        opt._server_only("serve")
        if opt.served:
            raise ConfigError(f"{opt.algorithm}: this optimizer was served already")
        if opt.layout.K > 1 and len(optimizers) > 1:
            raise ConfigError(f"{opt.algorithm}: a sharded server (ps_ranks={opt.layout.K}) "
                              "serves one optimizer; use ps_ranks=1 to serve several together")
    missing = [o for o in live() if o.is_server and not o.served and o not in optimizers]
    if missing:
        raise ConfigError(f"hpcasync.serve(): {len(missing)} more parameter-server "
                          "optimizer(s) of this job are not among those given: pass every one")
    if len(optimizers) == 1:
        epoch_cb = None if on_epoch is None else (lambda e, m: on_epoch(optimizers[0], e, m))
        return [optimizers[0].serve(on_epoch=epoch_cb)]
    loops = []
    for opt in optimizers:
        epoch_cb = None if on_epoch is None else (lambda e, m, o=opt: on_epoch(o, e, m))
        server, collector = opt._begin_serving(epoch_cb, {})
        server.begin()
        loops.append((opt, server, collector))
    pause = 2e-5
    while loops:
        moved = False
        for item in list(loops):
            opt, server, collector = item
            if server.all_done():
                server.end()
                opt._end_serving(server, collector, True)
                loops.remove(item)
                moved = True
            elif server.serve_waiting():
                moved = True
        if moved:
            pause = 2e-5
        else:
            time.sleep(pause)
            pause = min(1e-3, pause * 2)
    return [opt.flat.module for opt in optimizers]
