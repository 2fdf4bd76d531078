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

from .. import registry
from ..comm.broadcast import broadcast
from ..errors import CheckpointError, ConfigError, TopologyError, fail_fast
from ..optim import AlgorithmOptimizer, as_flat, group_index
from ..rules import RULES, Reply, make_rule, ps_lr_factor
from ..rules.base import check_real
from ..topology import default_topology
from .loop_checkpoint import LoopCheckpoints
from .ordering import ordered
from .server import PSServer
from .shards import EpochExchange, ShardLayout, check_shards, wait_ends, worker_pieces
from .transport import KIND_DONE, KIND_FINISH, KIND_PEEK, make_transport
from .worker import Patience

log = logging.getLogger("hpcasync")

ALGORITHMS = registry.LiveNames(registry.ps_names)     # live: a registered rule shows


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
    """

    def __init__(self, model, algorithm: str = "asgd", *, lr: float, comm=None,
                 ps_rank: int | None = None, transport: str = "rma", ps_ranks: int | None = None,
                 steps_per_epoch: int | None = None, epochs: int | None = None,
                 warmup_epochs: float | None = None, average_buffers: bool = True,
                 start: bool = True, param_groups: list[dict] | None = None, **hyper: Any):
        if algorithm not in RULES:
            raise ConfigError(f"unknown parameter-server algorithm {algorithm!r} "
                              f"(choose from {', '.join(RULES)})")
        self.algorithm = algorithm
        self.hyper = {"lr": lr, **hyper}
        probe = make_rule(algorithm, torch.zeros(1), 1, **self.hyper)  # check before any collective
        if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int)
                                            or steps_per_epoch < 1):
            raise ConfigError(f"steps_per_epoch must be a positive integer, got {steps_per_epoch!r}")
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
        self._own_groups(flat, param_groups, probe)
        self.comm, self.ps_rank = comm, ps_rank
        self.steps_per_epoch, self.epochs = steps_per_epoch, epochs
        self.warmup_epochs = warmup_epochs
        self.sync_buffers = bool(average_buffers) and flat.buffer_numel > 0
        for tensor in (flat.params, flat.buffers):          # every worker starts from the server's
            if tensor.numel():
                broadcast(comm, tensor, root=ps_rank)
        if len(set(comm.allgather(self._groups_key))) > 1:
            raise ConfigError(f"{algorithm}: the ranks' optimizers have different param groups "
                              "(each parameter must be in the same group on every rank, and "
                              "outside them on every rank)")
        if self._index is not None:
            probe.set_groups(torch.zeros(1, dtype=torch.int64), len(self.param_groups))
        self.layout = L = ShardLayout.build(comm, ps_rank=ps_rank, shards=ps_ranks,
                                            numel=flat.numel)
        self.shard, self.worker_ranks = L.shard, L.workers
        # one transport per shard this rank is in (a server: its own; a worker: all K)
        self.transports = [make_transport(
            transport, c, ps_rank if L.K == 1 else 0, L.slice(flat.params, s).numel(),
            extra=flat.buffer_numel if s == 0 else 0,
            reply_scalars=probe.reply_scalars, groups=len(self.param_groups))
            for s, c in enumerate(L.comms) if c is not None]
        self.transport = self.transports[0]
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
        self.version = 0
        self.steps = self.rejected = 0
        self._resume_local: torch.Tensor | None = None
        self.started = self.finished = self.stopped = False
        self._reply = torch.empty(flat.numel) if not self.is_server else None
        # server side
        self.served = False
        self._buffers = torch.zeros(W, flat.buffer_numel) if self.is_server else None
        self._seen = [False] * W
        self.server: PSServer | None = None          # serve()'s loop
        self._ordered = None                          # make_server(): the transport in push order
        self._epoch_exchange: EpochExchange | None = None   # make_server(), K > 1
        self._closed = False
        # save_checkpoint / load_checkpoint from a user's loop (:mod:`.loop_checkpoint`)
        self.checkpoints = LoopCheckpoints(self)
        if self.is_server:
            log.info("%s", self.describe())
        atexit.register(ParameterServer._at_exit, weakref.ref(self))
        self._hook = None
        if not self.is_server and start:
            ref = weakref.ref(self)
            self._hook = flat.module.register_forward_pre_hook(
                lambda module, args: ref() is not None and ref().start())

    # -- param groups ---------------------------------------------------------------------------
    def _own_groups(self, flat, param_groups, probe) -> None:
        """One param group per user group (default: one over the model), each with its ``lr``
        and ``weight_decay``, and the rule's ``momentum`` (one for all groups; exposed so that
        schedulers such as OneCycleLR cycle it). Parameters in no group, or with
        ``requires_grad=False``, are never moved (``rules.base``, param groups)."""
        momentum = getattr(probe, "momentum", 0.0)
        wd = self.hyper.get("weight_decay", 0.0)
        lr = self.hyper["lr"]
        if param_groups is None:
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
        torch.optim.Optimizer.__init__(self, groups, {"lr": lr, "weight_decay": wd,
                                                      "momentum": momentum})
        self.flat, self.optimizer = flat, None
        where = group_index(flat, self.param_groups)
        self._groups_key = (len(self.param_groups), tuple(where))
        grouped = len(self.param_groups) > 1 or min(where) < 0
        self._index = flat.per_element(where, dtype=torch.int64).cpu() if grouped else None
        self._hyper_now()                                  # check the values now

    def _hyper_now(self):
        """What a push carries: lr and weight decay (one per group when there are several) and
        the momentum, checked (one line if the groups' momenta were set apart)."""
        groups = self.param_groups
        momentum = groups[0].get("momentum", 0.0)
        if any(g.get("momentum", 0.0) != momentum for g in groups):
            raise ConfigError(f"{self.algorithm}: the param groups disagree on momentum "
                              f"({[g.get('momentum') for g in groups]}); the server has one "
                              "momentum for all groups")
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
            head = self._replies(None, poll=Patience(
                f"{self.algorithm} worker {self.worker}: waiting for the parameter server's first "
                f"reply for %d s: does rank {self.ps_rank} call opt.serve()?"))
            if self._resume_local is not None:      # a resumed SHAT/ENSEMBLE worker: its own model
                self.flat.params.copy_(self._resume_local)
                self._resume_local = None
            self.version, self.started = head.version, True

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
        if loss is None and self.needs_loss:
            raise ConfigError(f"{self.algorithm} predicts each worker's loss: call "
                              "opt.step(loss=loss) with the batch's loss")
        value = math.nan if loss is None else float(loss.detach() if torch.is_tensor(loss) else loss)
        self._collect()
        self.push(loss=value)
        return None

    def push(self, grad: torch.Tensor | None = None, *, loss: float = math.nan,
             oracle_loss: float = math.nan, last: bool = False, stop: bool = False):
        """Worker: one push of ``grad`` (default: the flat gradient buffer) and this rank's float
        buffers, then the reply into the model's parameters. Returns the reply's header. The
        CLI's worker loop uses the keywords (LC-ASGD's oracle, its last-push flag, preemption)."""
        if self.finished:
            raise ConfigError(f"{self.algorithm}: step() after finish()")
        if not self.started:
            self.start()
        g = self.flat.grads if grad is None else grad
        pieces = worker_pieces(self.layout, g.cpu(), self.flat.numel)
        lr, momentum, weight_decay = self._hyper_now()
        for s, (t, piece) in enumerate(zip(self.transports, pieces)):   # all leave, then replies
            t.push(piece, self.flat.buffers.cpu() if s == 0 else None, version=self.versions[s],
                   loss=loss, oracle_loss=oracle_loss, last=last, stop=stop, lr=lr,
                   momentum=momentum, weight_decay=weight_decay)
        head = self._replies(g)
        self.version = head.version
        self.steps += 1
        self.rejected += not head.accepted
        if last:
            self.finished = True
        elif head.stop:
            self.finished = self.stopped = True         # the server stopped the job (preemption)
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
        if self._closed:
            return self.flat.module
        if not self.started and not self.finished and self._hook is not None:
            self.start()        # a user's worker that never stepped (e.g. resumed at its end)
        self.checkpoints.flush()                  # the server has them before it sees FINISH
        if self.started and not self.finished:
            for t, v in zip(self.transports, self.versions):
                t.push(torch.zeros(0), kind=KIND_FINISH, version=v)
        self.finished = True
        if len(self.transports) == 1:
            stop = self.transport.wait_end(stop_requested)
        else:
            stop = wait_ends(self.transports, stop_requested)
        for t in self.transports:
            t.push(torch.zeros(0), kind=KIND_DONE, version=self.steps)
        if not collective:
            return stop
        self.close()
        return self.flat.module

    # -- server side ----------------------------------------------------------------------------
    def make_server(self, **callbacks: Any) -> PSServer:
        """Server: the :class:`PSServer` loop over this rule, with the epoch clock, the lr factor
        and (``average_buffers``) the workers' buffers wired in; ``callbacks`` go to PSServer."""
        self._server_only("serve")
        self.served = True
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
                        on_buffers=on_buffers, **callbacks)

    def serve(self, *, on_epoch: Callable[[int, torch.nn.Module], Any] | None = None,
              collective: bool = True, **callbacks: Any):
        """Server: apply the rule to every push until every worker has finished; then every rank
        takes the final model (``collective``). ``on_epoch(epoch, model)`` is called with θ in the
        model at each epoch crossing (with ``steps_per_epoch``), e.g. to evaluate. Returns the
        model."""
        def crossed(epoch: int, record: dict) -> None:
            self.load_theta()
            log.info("PS %s: epoch %d crossed at version %d (%d pushes accepted, %d rejected)",
                     self.algorithm, epoch, self.rule.version, record.get("pushes", 0),
                     record.get("rejected_pushes", 0))
            if on_epoch is not None:
                on_epoch(epoch, self.flat.module)
        server = self.make_server(on_epoch=crossed, **callbacks)
        self.server = server
        collector = self.checkpoints.attach(server)     # a loaded clock; the workers' requests
        server.serve()
        collector.close()
        server.finish()
        self.load_theta()
        if collective:
            self.close()
        return self.flat.module

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
        return (f"{self.algorithm} on {W} workers ({hyper}); lr warm-up from lr/{W} over "
                f"{warm:g} epochs (warmup_epochs)" if warm else
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
        ``collective=False``: a rank died, the windows are left to MPI_Finalize."""
        if self._closed:
            return
        self._closed = True
        if self._ordered is not None and self._ordered is not self.transport:
            self._ordered.finish(collective=collective)  # :mod:`.ordering`'s messages
        if self._epoch_exchange is not None:             # a shard server's epoch messages
            self._epoch_exchange.finish(collective=collective)
        for t in self.transports:
            t.close(collective=collective)
        if collective:
            self.layout.free()
        if not broadcast_model:
            return
        comm = self.comm if comm is None else comm
        root = self.ps_rank if root is None else root
        if self.layout.K > 1:           # each server's slice from it (root: shard 0's server)
            for s, server in enumerate(self.layout.servers):
                broadcast(comm, self.layout.slice(self.flat.params, s), root=root if s == 0
                          else server)
            if self.flat.buffers.numel():
                broadcast(comm, self.flat.buffers, root=root)
            return
        for tensor in (self.flat.params, self.flat.buffers):
            if tensor.numel():
                broadcast(comm, tensor, root=root)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (after ``finish()``/``serve()``, collective)."""
        return self._closed

    def _at_exit_check(self) -> None:
        """Interpreter exit: a worker that never called finish() finishes now (so the server can
        end); a server that never served ends the job, saying so (the workers wait for it)."""
        if self._closed:
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

    def _worker_only(self, what: str) -> None:
        if self.is_server:
            raise ConfigError(f"rank {self.comm.Get_rank()} is the parameter server of "
                              f"{self.algorithm}: call opt.serve() there, not {what}() "
                              "(hpcasync.init() tells each rank its role: ctx.is_server)")

    def _server_only(self, what: str) -> None:
        if not self.is_server:
            raise ConfigError(f"rank {self.comm.Get_rank()} is a worker of {self.algorithm}: "
                              f"{what}() runs on the parameter server (rank {self.ps_rank}); "
                              "workers call step() and finish()")

    def _extra_state(self) -> dict:
        state = {"hyper": {k: v for k, v in self.hyper.items() if k != "lr"}}
        if self.is_server:
            state.update(rule=self.rule.state_dict(), **self.buffer_state())
        else:
            state.update(version=self.version, steps=self.steps)
        return state

    def _load_extra(self, extra: dict) -> None:
        if self.is_server and "rule" in extra:
            self.rule.load_state_dict(extra["rule"])
            self.load_buffer_state(extra)
            self.load_theta()

    def __repr__(self) -> str:
        role = "server" if self.is_server else f"worker {self.worker}/{self.num_workers}"
        return f"ParameterServer({self.algorithm}, {role}, lr={self.lr():g})"
