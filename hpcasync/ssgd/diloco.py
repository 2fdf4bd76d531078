"""DiLoCo (Douillard et al., arXiv 2311.08105) and Streaming DiLoCo (Douillard et al., arXiv
2501.18512): H inner steps of the user's optimizer on each rank's own replica, then an outer step
on the averaged pseudo-gradient, as torchft's ``torchft.local_sgd.DiLoCo`` computes it.

With N ranks, θ the global parameters of a fragment (the whole model when F = 1), θ_i rank i's:

- every inner step: the user's optimizer on θ_i, its own gradient (nothing crosses the wire);
- the model is cut into F fragments; every h = H/F inner steps one fragment syncs, in turn
  (fragment s mod F at the s-th sync), so each fragment syncs every H steps;
- τ (``fragment_sync_delay``) steps before its sync the fragment's pseudo-gradient
  Δ_i = θ − θ_i is taken and averaged, Δ̄ = (Σ_i Δ_i)/N (summed, then divided);
- at the sync: the fragment's parameters are set to θ, the outer optimizer (default SGD with
  Nesterov momentum, lr 0.7, momentum 0.9: the paper's) steps with gradient Δ̄, the result is
  the new θ, and each rank's parameters become θ + α·(θ_i − θ) (``fragment_update_alpha``;
  α = 0: θ), θ_i being its parameters at the sync (τ steps after Δ_i was taken).

**Hierarchical** (``node_comm``, the CLI's ``--diloco-hierarchical``): the ranks of a node train
one replica with synchronous SGD (each inner step averages the gradients over ``node_comm``, the
node's fast link), and DiLoCo runs across the nodes: Δ̄ is the mean over the nodes of their
replicas' pseudo-gradients. As each node's ranks hold the same Δ, local rank l averages only
the l-th of L chunks of it with local rank l of the other nodes, and the node gathers the chunks:
one copy of the fragment crosses the slow link per node and sync, carried in L parallel pieces
(the layout of DASO's global groups). Every node must have the same number of ranks.

The inner optimizer's state is never averaged. Differences from torchft's (same floats
otherwise, ``tests/mpi/test_diloco.py``): no quorum or healing (the ranks are the MPI job's;
deaths are the fault-tolerance layer's, as for every algorithm here); the pseudo-gradient travels
as one flat float32 sum per sync (torchft: one allreduce per parameter; the sums are the same),
or with ``quantize=True`` as FP8 with a scale per rank's chunk (torchft: per block of its Triton
kernel, on a GPU only; :mod:`hpcasync.ssgd.quantize`); the floating buffers (BatchNorm
statistics) are averaged at each sync (torchft leaves them).

Example (a user's own loop)::

    opt = hpcasync.optimizer("diloco", model, torch.optim.AdamW(model.parameters(), lr=4e-4),
                             sync_every=500)
    for x, y in loader:
        opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
    opt.finish()                     # every rank holds the global model

Design: docs/design/ssgd.md, "DiLoCo".
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging

import torch

from ..comm import allreduce, mpi_buffer
from .quantize import quantized_mean
from ..comm.shm import partition
from ..errors import ConfigError
from .localsgd import LocalSGD

__all__ = ["DiLoCo"]

log = logging.getLogger("hpcasync")

#: the paper's H and outer optimizer (SGD, Nesterov momentum)
DEFAULT_SYNC_EVERY, OUTER_LR, OUTER_MOMENTUM = 500, 0.7, 0.9


class DiLoCo(LocalSGD):
    """DiLoCo / Streaming DiLoCo around the user's (inner) optimizer (module doc).

    Args:
        optimizer, model, comm: as :class:`~hpcasync.ssgd.DistributedOptimizer`; ``optimizer``
            is the inner one.
        sync_every: H, inner steps between two syncs of each fragment (a multiple of F).
        outer_optimizer: a function of a list of parameters returning the outer optimizer
            (default: ``torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)``), one per
            fragment.
        fragments: F (the modules that own parameters, in the model's order, cut into F runs of
            about equal parameter counts), or a list of modules (each fragment's parameters);
            default 1.
        fragment_sync_delay: τ < H/F, inner steps between taking a fragment's pseudo-gradient
            and applying it (0: DiLoCo).
        fragment_update_alpha: α in [0, 1], the share of the rank's own parameters mixed into
            the outer step's result.
        node_comm: the ranks training one replica with synchronous SGD (the hierarchical
            layout, module doc; e.g. ``topology.local``); default None: one replica per rank.
            Collective over ``comm`` when given. Not under ULFM: the node groups are not rebuilt
            after a death (a one-line error).
        quantize: exchange the outer gradients as FP8 with a scale per chunk, averaged in
            float32 (torchft's ``should_quantize``; :mod:`hpcasync.ssgd.quantize`); not with
            ``node_comm``.
    """

    algorithm = "diloco"

    def __init__(self, optimizer: torch.optim.Optimizer, model, comm=None, *,
                 sync_every: int = DEFAULT_SYNC_EVERY, outer_optimizer=None, fragments=1,
                 fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0,
                 node_comm=None, quantize: bool = False):
        if isinstance(fragments, int) and not isinstance(fragments, bool):
            check(sync_every, fragments, fragment_sync_delay, fragment_update_alpha)
        if quantize and node_comm is not None:
            raise ConfigError("diloco: quantize and node_comm (--diloco-quantize, "
                              "--diloco-hierarchical) do not go together: the node mean is exact")
        super().__init__(optimizer, model, comm, period=1, warmup_steps=0)
        self.node_comm, self._peers, self.quantize = node_comm, None, bool(quantize)
        self.bytes_across = 0      # of bytes_sent, what crossed between nodes (the outer syncs)
        if node_comm is not None:
            self._peers = _node_peers(self.comm, node_comm)
        groups = _fragments(self.flat.module, fragments)
        check(sync_every, len(groups), fragment_sync_delay, fragment_update_alpha)
        make = outer_optimizer or functools.partial(nesterov_sgd, lr=OUTER_LR,
                                                    momentum=OUTER_MOMENTUM)
        self.sync_every, self.delay = sync_every, fragment_sync_delay
        self.alpha = float(fragment_update_alpha)
        self.fragments = groups
        self.outer = [make(ps) for ps in groups]
        with torch.no_grad():
            self.globals = [[p.detach().clone() for p in ps] for ps in groups]   # θ per fragment
        self.local_step = 0        # inner steps since the last sync (torchft's _local_step)
        self.syncs = 0             # syncs done (torchft's manager step)
        self._pending: list[torch.Tensor] | None = None    # Δ̄ of the fragment taken early
        self._told_unsynced = False    # finish() said a fragment took no outer step

    @classmethod
    def cli_keywords(cls, given: dict, topo=None) -> dict:
        """The ``--diloco-*`` options as keywords: ``outer_lr``/``outer_momentum`` make the outer
        optimizer (SGD, Nesterov when the momentum is not 0), ``hierarchical`` the node groups
        (``topo.local``)."""
        kw = dict(given)
        outer = (kw.pop("outer_lr", OUTER_LR), kw.pop("outer_momentum", OUTER_MOMENTUM))
        hierarchical = kw.pop("hierarchical", False)
        check(kw.get("sync_every", DEFAULT_SYNC_EVERY), kw.get("fragments", 1),
              kw.get("fragment_sync_delay", 0), kw.get("fragment_update_alpha", 0.0), outer)
        if kw.get("quantize") and hierarchical:
            raise ConfigError("--diloco-quantize and --diloco-hierarchical do not go together: "
                              "the node mean is exact")
        kw["outer_optimizer"] = functools.partial(nesterov_sgd, lr=outer[0], momentum=outer[1])
        if hierarchical and topo is not None:
            kw["node_comm"] = topo.local
        return kw

    def broadcast_parameters(self, root: int = 0) -> None:
        """Rank ``root``'s parameters everywhere, and they are θ."""
        super().broadcast_parameters(root)
        with torch.no_grad():
            for gs, ps in zip(self.globals, self.fragments):
                for g, p in zip(gs, ps):
                    g.copy_(p)

    # -- the schedule ----------------------------------------------------------------------------
    @property
    def _per_fragment(self) -> int:
        return self.sync_every // len(self.fragments)

    def step(self, closure=None):
        """The inner step; then, on schedule, the fragment's pseudo-gradient (collective) and
        its outer step. A step whose communication fails is undone (as LocalSGD's)."""
        h, nxt = self._per_fragment, self.local_step + 1
        with self._undone_on_failure(nxt in (h - self.delay, h) and (
                nxt == h - self.delay or self.sync_buffers)):
            result = super(LocalSGD, self).step(closure)     # the inner step (local: LocalSGD's)
            self.local_step += 1
            if self.local_step == h - self.delay:
                self._pending = self._pseudo_gradient(self.syncs % len(self.fragments))
            if self.local_step == h:
                self._sync(self.syncs % len(self.fragments))
                self.local_step = 0
        return result

    def _counters(self) -> dict:
        return {**super()._counters(), **self._schedule_state(), "bytes_across": self.bytes_across}

    def _set_counters(self, c: dict) -> None:
        super()._set_counters(c)
        self.bytes_across = c["bytes_across"]
        self._load_schedule(c)

    def _schedule_state(self) -> dict:
        """θ, the outer optimizers' state, the counters, a pseudo-gradient not yet applied."""
        return {"local_step": self.local_step, "syncs": self.syncs,
                "globals": [[g.clone() for g in gs] for gs in self.globals],
                "outer": [copy.deepcopy(o.state_dict()) for o in self.outer],
                "pending": None if self._pending is None else [d.clone() for d in self._pending]}

    def _load_schedule(self, d: dict) -> None:
        self.local_step, self.syncs = int(d["local_step"]), int(d["syncs"])
        with torch.no_grad():
            for gs, saved in zip(self.globals, d["globals"]):
                for g, t in zip(gs, saved):
                    g.copy_(t)
        for o, t in zip(self.outer, d["outer"]):
            o.load_state_dict(t)
        self._pending = None if d["pending"] is None else [t.clone() for t in d["pending"]]

    # -- hierarchical: SSGD inside the node --------------------------------------------------
    def _step_comm(self):
        """Hierarchical: every inner step averages the gradients and buffers over the node (the
        local phase of LocalSGD, otherwise)."""
        return super()._step_comm() if self.node_comm is None else self.node_comm

    def set_comm(self, comm) -> None:
        if self.node_comm is not None:
            raise ConfigError("hierarchical DiLoCo (node_comm, --diloco-hierarchical) does not "
                              "survive a death: its node groups are not rebuilt")
        super().set_comm(comm)

    # -- the outer step ------------------------------------------------------------------------
    def _pseudo_gradient(self, f: int) -> list[torch.Tensor]:
        """Δ̄ of fragment f: (Σ_i (θ − θ_i)) / N, one flat sum (hierarchical: over the nodes)."""
        deltas = [g - p.detach() for g, p in zip(self.globals[f], self.fragments[f])]
        flat = torch.cat([d.reshape(-1) for d in deltas])
        if self.quantize:
            sent = quantized_mean(self.comm, flat)
            self.bytes_sent += sent
            self.bytes_across += sent
        elif self._peers is None:
            allreduce(self.comm, flat)
            flat /= self.comm.Get_size()
            self.bytes_sent += flat.numel() * flat.element_size()
            self.bytes_across += flat.numel() * flat.element_size()
        else:
            self._node_mean(flat)
        out, k = [], 0
        for d in deltas:
            out.append(flat[k:k + d.numel()].view_as(d))
            k += d.numel()
        return out

    def _node_mean(self, flat: torch.Tensor) -> None:
        """In place: the mean over the nodes of ``flat`` (equal on the ranks of a node). Local
        rank l averages chunk l with its peers of the other nodes; the node gathers the chunks."""
        from mpi4py import MPI

        bounds = partition(flat.numel(), self.node_comm.Get_size())
        lo, hi = bounds[self.node_comm.Get_rank()]
        chunk = flat[lo:hi]
        allreduce(self._peers, chunk)
        chunk /= self._peers.Get_size()
        host = flat.cpu()                          # (flat itself on the CPU)
        buf, dtype = mpi_buffer(host)
        self.node_comm.Allgatherv(MPI.IN_PLACE, [buf, [b - a for a, b in bounds],
                                                 [a for a, _ in bounds], dtype])
        if host is not flat:
            flat.copy_(host)
        self.bytes_sent += flat.numel() * flat.element_size()    # its chunk out, the rest in
        self.bytes_across += chunk.numel() * chunk.element_size()

    def _sync(self, f: int) -> None:
        params, delta = self.fragments[f], self._pending
        self._pending = None
        with torch.no_grad():
            local = [p.detach().clone() for p in params]
            for p, g in zip(params, self.globals[f]):
                p.copy_(g)
        saved = [p.grad for p in params]
        for p, d in zip(params, delta):
            p.grad = d
        self.outer[f].step()
        self.outer[f].zero_grad()
        for p, g in zip(params, saved):           # the inner gradients' views stay bound
            p.grad = g
        with torch.no_grad():
            for p, g, loc in zip(params, self.globals[f], local):
                g.copy_(p)
                p.lerp_(loc, self.alpha)
        if self.sync_buffers:
            self.average_buffers()
        self.syncs += 1
        self._equal_since = self.steps if len(self.fragments) == 1 and self.alpha == 0 else -1

    def check_run_length(self, steps: int) -> None:
        """A run of ``steps`` inner steps per rank (the CLI's, before training) takes an outer
        step of every fragment: the last one's first comes after H (``sync_every``) inner
        steps, and :meth:`finish` ends on θ, so a shorter run would end on its initial
        parameters: a one-line ``ConfigError``."""
        if steps < self.sync_every:
            none = steps < self._per_fragment       # not even the first fragment's outer step
            raise ConfigError(
                f"diloco: sync_every (--diloco-sync-every) {self.sync_every} is more than the "
                f"run's {steps} inner steps per rank: {'no' if none else 'not every'} fragment "
                "would take an outer step and the model at the end (the global parameters) "
                f"would be {'the initial one' if none else 'partly the initial one'}; lower "
                f"--diloco-sync-every to at most {steps} or train more epochs")

    def finish(self) -> None:
        """The end of training: every rank holds the global parameters θ (the last outer
        steps' results; inner steps since each fragment's last sync are dropped). Said once if
        a fragment never took an outer step (its parameters are the initial ones)."""
        if self.syncs < len(self.fragments) and not self._told_unsynced:
            self._told_unsynced = True
            log.warning("diloco: finish() after %d inner steps with sync_every %d: %s took no "
                        "outer step, so the model ends on %s initial parameters", self.steps,
                        self.sync_every, "no fragment" if not self.syncs else
                        f"{len(self.fragments) - self.syncs} of {len(self.fragments)} fragments",
                        "its" if not self.syncs else "their")
        self._to_global()

    def _to_global(self) -> None:
        with torch.no_grad():
            for params, globals_ in zip(self.fragments, self.globals):
                for p, g in zip(params, globals_):
                    p.copy_(g)
        if self.sync_buffers:
            self.average_buffers()
        self._equal_since = self.steps

    def average_parameters(self) -> None:
        """Every rank's parameters set to the global θ (as :meth:`finish`)."""
        self._to_global()

    @contextlib.contextmanager
    def global_weights(self):
        """Inside: the model holds the global θ (to evaluate it); after: each rank's own
        parameters again. Local: no communication (the buffers stay each rank's)."""
        with torch.no_grad():
            own = self.flat.params.clone()
            for params, globals_ in zip(self.fragments, self.globals):
                for p, g in zip(params, globals_):
                    p.copy_(g)
        try:
            yield self
        finally:
            with torch.no_grad():
                self.flat.params.copy_(own)

    @property
    def replicas_equal(self) -> bool:
        return self.steps == 0 or self._equal_since == self.steps

    # -- state -----------------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {**super()._extra_state(), **self._schedule_state()}

    def _load_extra(self, extra: dict) -> None:
        super()._load_extra(extra)
        if "globals" in extra:
            self._load_schedule(extra)


def nesterov_sgd(params, *, lr: float, momentum: float):
    """DiLoCo's outer optimizer (the default's, and the CLI's): SGD with Nesterov momentum
    (plain SGD at 0)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)


def check(sync_every, fragments, fragment_sync_delay, fragment_update_alpha,
          outer=(OUTER_LR, OUTER_MOMENTUM)) -> None:
    """One-line errors for bad options (``fragments``: their number)."""
    for name, value, low in (("sync_every", sync_every, 1), ("fragments", fragments, 1),
                             ("fragment_sync_delay", fragment_sync_delay, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"diloco {name} must be an integer >= {low}, got {value!r}")
    if sync_every % fragments:
        raise ConfigError(f"diloco sync_every={sync_every} is not a multiple of the {fragments} "
                          "fragments")
    if fragment_sync_delay >= sync_every // fragments:
        raise ConfigError(f"diloco fragment_sync_delay={fragment_sync_delay} must be below "
                          f"sync_every / fragments = {sync_every // fragments}")
    if not isinstance(fragment_update_alpha, (int, float)) or not 0 <= fragment_update_alpha <= 1:
        raise ConfigError(f"diloco fragment_update_alpha must be in [0, 1], got "
                          f"{fragment_update_alpha!r}")
    lr, momentum = outer
    if not (isinstance(lr, (int, float)) and lr > 0 and isinstance(momentum, (int, float))
            and 0 <= momentum < 1):
        raise ConfigError(f"diloco outer lr must be > 0 and momentum in [0, 1), got {lr!r}, "
                          f"{momentum!r}")


def _fragments(module, fragments) -> list[list[torch.nn.Parameter]]:
    """The parameters of each fragment: a list of modules, or F runs of about equal parameter
    counts of the modules that own parameters, in the model's module order."""
    if isinstance(fragments, (list, tuple)):
        groups = [[p for p in m.parameters() if p.requires_grad] for m in fragments]
    else:
        if not isinstance(fragments, int) or isinstance(fragments, bool) or fragments < 1:
            raise ConfigError(f"diloco fragments must be an integer >= 1 or a list of modules, "
                              f"got {fragments!r}")
        units = [list(m.parameters(recurse=False)) for m in module.modules()]
        units = [u for u in units if u]                 # the modules owning parameters, in order
        if fragments > len(units):
            raise ConfigError(f"diloco fragments={fragments}: the model has {len(units)} "
                              "modules with parameters")
        total = sum(p.numel() for u in units for p in u)
        groups, acc = [[]], 0
        for u in units:
            if acc >= total * len(groups) / fragments and len(groups) < fragments:
                groups.append([])
            groups[-1].extend(u)
            acc += sum(p.numel() for p in u)
        groups = [[p for p in g if p.requires_grad] for g in groups]
    if any(not g for g in groups):
        raise ConfigError("diloco: a fragment has no trainable parameter")
    return groups


def _node_peers(comm, node_comm):
    """The communicator of local rank l of every node (collective over ``comm``); a job whose
    nodes differ in size, or a node_comm that is not a partition of ``comm``, is a one-line
    error on every rank."""
    from ..runtime.ft import ulfm_enabled

    sizes = comm.allgather((node_comm.Get_size(), node_comm.Get_rank()))
    if len({s for s, _ in sizes}) != 1:
        raise ConfigError(f"hierarchical DiLoCo needs nodes of equal size; the node sizes are "
                          f"{sorted({s for s, _ in sizes})}")
    L = sizes[0][0]
    if comm.Get_size() % L or sum(r == 0 for _, r in sizes) != comm.Get_size() // L:
        raise ConfigError("hierarchical DiLoCo: node_comm must split comm into its nodes")
    if ulfm_enabled():
        raise ConfigError("hierarchical DiLoCo (node_comm, --diloco-hierarchical) does not "
                          "survive a death (its node groups are not rebuilt): run it without "
                          "--with-ft ulfm (a death then ends the job; restart from a checkpoint)")
    return comm.Split(node_comm.Get_rank(), comm.Get_rank())
