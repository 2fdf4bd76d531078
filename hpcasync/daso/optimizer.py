"""``DASO``: a wrapper around the user's torch optimizer that runs DASO around each ``step()``.

DASO (Coquelin, Debus, Götz, von der Lehr, Kahn, Siggel, Streit: "Accelerating neural network
training with distributed asynchronous and selective optimization", arXiv 2104.05588; reference code
Heat ``heat/optim/dp_optimizer.py``) trains with P nodes of L ranks. Per batch, after backward:

1. gradient sync: node-local average (cycling epochs, every ``local_skip`` batches) or average over
   all ranks (blocking epochs);
2. the user's optimizer step;
3. receive: the global group whose send is due waits for the sum S and merges
   x ← (2B·x + S)/(2B + P) (parameters and float buffers), then broadcasts x inside its node;
4. send: every ``global_skip`` batches one global group (round-robin) starts a nonblocking sum of
   its parameters and buffers, cast to bf16 on the wire by default (the only 16-bit message:
   blocking averages stay float32);
5. last batch of a cycling epoch: blocking average over all ranks of the parameters, buffers and
   the optimizer's state (momentum), so every replica ends the epoch identical and the next epoch
   (blocking ones too) starts from one common state; a blocking epoch averages the buffers.

Which batch does what is :mod:`.schedule`; the collectives are :mod:`.comm`; the formula is
:mod:`.merge`. This class only strings them together and keeps the messages in flight.

Args:
    optimizer: the user's optimizer over the parameters of ``flat``'s module (any torch optimizer).
    flat: the :class:`~hpcasync.comm.FlatModel` of the model (build it before the optimizer).
    topo: a :class:`~hpcasync.topology.Topology`; nodes may be uneven (after a death: global
        group j is local rank j mod L_p of every node p, see :mod:`.comm`).
    total_epochs: epochs of the run (the cool-down counts back from it).
    batches_per_epoch: batches (``step()`` calls) per epoch, a count; or ``sampler``:
    sampler: an :class:`~hpcasync.data.sharding.ElasticSampler` (anything with ``num_batches``,
        the batches left for every rank): each epoch counts the batches it deals, and an epoch
        whose world changed (an elastic reset, a load) is recounted as the batches done plus the
        sampler's left (:mod:`hpcasync.elastic`: the rest of the epoch is dealt over the
        survivors). Call ``sampler.record_batch()`` after ``step()``, as the elastic example does.
    warmup_epochs=4, cooldown_epochs=4, global_skip=4, local_skip=1, batches_to_wait=1,
    max_global_skips=8, plateau_patience=3, plateau_threshold=0.05: see :class:`DasoSchedule`.
    cast="bf16": wire format of the nonblocking global sends ("bf16", "fp16", None/"none").
    chunk_elems=DASO_CHUNK_ELEMS: largest piece of a global send (10 M elements).
    local_backend="mpi": node-local gradient averages with own allreduce, or ``"horovod"``.
    link_delay_us_per_mb=0: emulated inter-node link (see :mod:`.comm`).

Example (the user's loop stays as it is, plus ``epoch_end``)::

    flat = FlatModel(model)
    opt = DASO(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), flat, topo,
               total_epochs=E, batches_per_epoch=n)
    opt.broadcast_parameters()
    for epoch in range(E):
        for x, y in loader:                # n batches
            opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
        opt.epoch_end(epoch_loss)          # rank-averaged inside; drives the plateau schedule

``state_dict()`` is complete at any batch (every rank at the same batch: the sends in flight are
completed and kept with the batch they merge at), so ``hpcasync.elastic.State.commit()`` works
mid-epoch; inside a cycling epoch each rank's state is its own (:attr:`DASO.replicas_equal`).

Differences from the paper / Heat (see also :mod:`.schedule` and :mod:`.merge`):

* float buffers (BatchNorm statistics) travel and merge with the parameters;
* the end-of-epoch average includes the optimizer's per-parameter state (momentum): blocking
  epochs average gradients (see :mod:`.schedule`), which keeps replicas identical only if the
  momentum is identical too. Heat instead averages parameters after every blocking step;
* the cast applies only on the wire of the nonblocking global sends; blocking averages (warm-up and
  cool-down gradients, the epoch-end average, BatchNorm buffers) are float32, so a blocking epoch
  is SSGD exactly and the model is never rounded to 16 bits as a whole. (The Heat versions we
  read apply ``downcast_type`` when ``global_skip < 1``, i.e. to the blocking-phase parameter
  averages, and send float32 while cycling; the paper casts the global synchronisation.);
* with one node (P = 1: the default on a single multi-GPU box) there is no global phase: the
  node-local average already is the average over every rank, and the send/merge would only mix
  each rank with its own stale copy (keeping 2B/(2B+1) of every step). DASO logs this once;
* order at a batch where a receive and a send coincide: receive (merge + node broadcast) first,
  then send, so the new snapshot includes the merge. Heat's ``_global_sync`` sends first, then
  receives the previous send;
* initial parameters and buffers are broadcast from one rank (:meth:`broadcast_parameters`), not
  left to identical seeds;
* node-local averaging is on gradients (as Heat's DDP), but through our own allreduce or Horovod
  rather than ``torch.distributed``; the momentum and other optimizer state stay per rank;
* parameters torch would leave untouched stay bitwise as they are: those with
  ``requires_grad=False`` or in no param group see no gradient (``p.grad`` is None during the
  user's step) and, with those of a param group whose lr is 0 at the send, are held out of the
  global merge; the epoch-end average of such parameters is exact where every replica agrees
  (rank 0's value plus the average difference from it);
* no AMP/LR-scheduler plumbing: the wrapper forwards ``param_groups``/``state`` so torch LR
  schedulers work on it directly. ``backward_passes_per_step`` is not offered.
"""
from __future__ import annotations

import hashlib
import logging
from collections import deque

import torch

from ..comm import DASO_CHUNK_ELEMS, flatten, unflatten_into
from ..comm.broadcast import broadcast
from ..errors import ConfigError
from ..optim import AlgorithmOptimizer, as_flat, group_index
from ..topology import default_topology
from .comm import DasoComm, InFlight, Received, pack_state, unpack_state
from .merge import held_ranges, merge_
from .schedule import CYCLING, BatchPlan, DasoSchedule

log = logging.getLogger(__name__)


class DASO(AlgorithmOptimizer):
    """See the module docstring. A ``torch.optim.Optimizer`` sharing the wrapped optimizer's
    ``param_groups``/``state`` (:mod:`hpcasync.optim`); ``topo`` defaults to the job's topology
    (:func:`hpcasync.topology.default_topology`, as set by ``hpcasync.init``)."""

    algorithm = "daso"

    def __init__(self, optimizer: torch.optim.Optimizer, flat, topo=None, *, total_epochs: int,
                 batches_per_epoch: int | None = None, sampler=None, warmup_epochs: int = 4,
                 cooldown_epochs: int = 4,
                 global_skip: int = 4, local_skip: int = 1, batches_to_wait: int = 1,
                 max_global_skips: int = 8, cast: str | None = "bf16",
                 chunk_elems: int = DASO_CHUNK_ELEMS, plateau_patience: int = 3,
                 plateau_threshold: float = 0.05, local_backend: str = "mpi",
                 link_delay_us_per_mb: float = 0.0):
        if (batches_per_epoch is None) == (sampler is None):
            raise ConfigError("DASO counts the batches of an epoch: give batches_per_epoch (an "
                              "integer) or sampler (an ElasticSampler), one of them")
        if sampler is not None and not hasattr(sampler, "num_batches"):
            raise ConfigError(f"DASO sampler must say the batches it has left (num_batches, as "
                              f"an ElasticSampler does); got {type(sampler).__name__}")
        if sampler is None and (not isinstance(batches_per_epoch, int) or batches_per_epoch < 1):
            raise ConfigError(f"DASO batches_per_epoch must be an integer >= 1, "
                              f"got {batches_per_epoch!r}")
        self._wrap(as_flat(flat), optimizer)
        flat = self.flat
        from ..runtime.join import is_joiner

        joiner = topo is None and is_joiner()
        if topo is None:
            topo = _own_topology() if joiner else default_topology()
        self.topo, self._own_topo = topo, joiner
        self.batches_per_epoch, self.sampler = batches_per_epoch, sampler
        self._recount = False           # the world changed inside the epoch: count it again
        self.schedule = DasoSchedule(
            total_epochs=total_epochs, num_groups=topo.max_local_size, warmup_epochs=warmup_epochs,
            cooldown_epochs=cooldown_epochs, global_skip=global_skip, local_skip=local_skip,
            batches_to_wait=batches_to_wait, max_global_skips=max_global_skips,
            plateau_patience=plateau_patience, plateau_threshold=plateau_threshold)
        self.comm = DasoComm(topo, cast=cast, chunk_elems=chunk_elems, local_backend=local_backend,
                             link_delay_us_per_mb=link_delay_us_per_mb)
        self.inflight: deque[InFlight] = deque()   # this rank's global sends, oldest first
        self._keep: dict[int, list] = {}            # send batch -> ranges its merge keeps
        self.steps = 0
        self.last_plan: BatchPlan | None = None
        self._synced_plan: BatchPlan | None = None  # set by synchronize(), used by step()
        self._skip = False
        self._lost_before = -1          # receives of messages sent before this batch: dropped
        self._comm_args = {"cast": cast, "chunk_elems": chunk_elems,
                           "local_backend": local_backend,
                           "link_delay_us_per_mb": link_delay_us_per_mb}
        self.global_phase = topo.num_nodes > 1      # one node: no global send / merge
        if not self.global_phase and topo.rank == 0 and not joiner:
            log.info("DASO: one node (%d ranks): no global phase (no sends, no merges); the "
                     "node-local average is the average over all ranks", topo.size)
        n = flat.params.numel() + flat.buffers.numel()
        self._scratch = torch.empty(n, dtype=flat.params.dtype, device=flat.params.device)
        if self.schedule.degenerate and topo.rank == 0:
            log.warning("DASO: %d epoch(s) with %d warm-up + %d cool-down epochs leave no cycling "
                        "epoch; DASO degenerates to blocking averaging (SSGD). Lower "
                        "--daso-warmup-epochs/--daso-cooldown-epochs to see DASO",
                        total_epochs, warmup_epochs, cooldown_epochs)

    def broadcast_parameters(self, root: int = 0) -> None:
        """Make every replica start from world rank ``root``'s parameters and buffers."""
        for tensor in (self.flat.params, self.flat.buffers):
            if tensor.numel():
                broadcast(self.topo.world, tensor, root=root)

    # -- one batch ----------------------------------------------------------------------------
    def synchronize(self) -> BatchPlan:
        """Do this batch's gradient sync now (e.g. to clip averaged gradients), then
        ``with opt.skip_synchronize(): opt.step()``. Returns the batch's plan."""
        if self._synced_plan is not None:
            raise ConfigError("DASO synchronize() called twice for one batch")
        plan = self.schedule.advance(self._epoch_batches())
        self._collect()
        self.comm.progress(self.inflight)
        if plan.grad_sync == "global":
            self.comm.global_average(self.flat.grads)
        elif plan.grad_sync == "local":
            self.comm.local_average(self.flat.grads)
        self._synced_plan = plan
        return plan

    def _epoch_batches(self) -> int:
        """The batch count of the current epoch: the one given, or the sampler's (module doc of
        ``sampler``); after a change of world inside the epoch, the schedule is recounted."""
        if self.sampler is None:
            return self.batches_per_epoch
        n = self.schedule.batch + self.sampler.num_batches
        if self._recount:
            self.schedule.recount(n)
            self._recount = False
        return n

    def _check_skip(self) -> None:
        if self._synced_plan is None:
            raise ConfigError("DASO skip_synchronize() without synchronize() first")

    def step(self, closure=None):
        """Gradient sync, the user's step, then this batch's global receive / send / average."""
        if closure is not None:
            raise ConfigError("DASO.step does not take a closure")
        if self._synced_plan is None:
            self.synchronize()
        elif not self._skip:
            log.warning("DASO: step() after synchronize() without skip_synchronize(): "
                        "the batch is not synced twice")
        plan, self._synced_plan = self._synced_plan, None
        groups = group_index(self.flat, self.param_groups)
        frozen = [(p, p.grad) for p, g in zip(self.flat.parameters, groups) if g < 0]
        for p, _ in frozen:              # as in torch: no gradient, no weight decay or momentum
            p.grad = None
        try:
            result = self.optimizer.step()
        finally:
            for p, view in frozen:
                p.grad = view
        with torch.no_grad():
            if self.global_phase and plan.receive_group is not None:
                self._receive(plan)
            if self.global_phase and plan.send_group is not None:
                self._send(plan)
            if plan.average == "all":
                self._average_everything()
            elif plan.average == "buffers":
                self.comm.global_average(self.flat.buffers)
        self.steps += 1
        self.last_plan = plan
        return result

    def _send(self, plan: BatchPlan) -> None:
        due = plan.batch + self.schedule.knobs.batches_to_wait
        snapshot = pack_state(self.flat.params, self.flat.buffers)      # a fresh tensor per send
        msg = self.comm.start(snapshot, group=plan.send_group, batch=plan.batch, due=due)
        if msg is not None:
            self.inflight.append(msg)
            self._keep[plan.batch] = self._held()     # what its merge leaves alone

    def _receive(self, plan: BatchPlan) -> None:
        group, state = plan.receive_group, self._scratch
        if plan.batch - self.schedule.knobs.batches_to_wait < self._lost_before:
            return           # its message was sent before a recovery, and dropped there
        if self.comm.member(group):
            if not self.inflight or self.inflight[0].due_batch != plan.batch:
                raise RuntimeError(f"DASO: no global message due at batch {plan.batch} "
                                   f"(in flight: {list(m.due_batch for m in self.inflight)})")
            msg = self.inflight.popleft()
            total = self.comm.complete(msg)
            pack_state(self.flat.params, self.flat.buffers, out=state)
            merge_(state, total, batches_to_wait=msg.due_batch - msg.sent_batch,
                   num_nodes=self.topo.num_nodes, keep=self._keep.pop(msg.sent_batch, ()))
        self.comm.node_broadcast(state, root=self.comm.root_of(group))
        unpack_state(state, self.flat.params, self.flat.buffers)

    def set_topology(self, topo, *, average: bool) -> None:
        """Run on ``topo`` from now on: the survivors after dead ranks were shrunk out (ULFM,
        :meth:`~hpcasync.runtime.elastic.FaultTolerance.reset`, ``Topology.shrunk``: a node that
        lost a rank keeps its other ranks, nodes may be uneven). The global messages in flight are
        dropped (their receives in this epoch are skipped), the collectives are rebuilt on the
        new communicators, the schedule cycles over the largest node's size; the epoch, its
        batch and the knobs are kept. ``average``: average every replica's parameters, buffers
        and optimizer state over the survivors (what a cycling epoch's end does), so that nodes
        that had drifted apart go on from one state. Also the survivors and their replacements
        after a grow-back (``average=False``: the state is then synced from a survivor). With a
        ``sampler`` the epoch is recounted at the next step. Collective over ``topo.world``."""
        if self._own_topo:              # a replacement's topology of itself alone
            self.topo.free()
            self._own_topo = False
        self.topo = topo
        self.inflight.clear()
        self._keep.clear()
        self._lost_before = self.schedule.batch
        self._synced_plan = None
        self.comm = DasoComm(topo, **self._comm_args)
        self.schedule.num_groups = topo.max_local_size
        self.global_phase = topo.num_nodes > 1
        self._recount = True
        if average:
            with torch.no_grad():
                self._average_everything()

    def _held(self) -> list[tuple[int, int]]:
        """Ranges of θ that torch's step leaves untouched now: parameters with
        ``requires_grad=False`` or in no param group, and those of a group whose lr is 0."""
        zero_lr = [float(g["lr"]) == 0.0 for g in self.param_groups]
        held = [g < 0 or zero_lr[g] for g in group_index(self.flat, self.param_groups)]
        sizes = [p.numel() for p in self.flat.parameters]
        return held_ranges(self.flat.offsets, sizes, held)

    def _average_everything(self) -> None:
        """Blocking average over all ranks of parameters, buffers and the optimizer's state.

        Held parameters (:meth:`_held`) average as ref + mean(x − ref) with ref = rank 0's value:
        bitwise unchanged where every replica agrees (a plain float sum of P equal values divided
        by P is not always exact), the same on every rank where they differ."""
        extra = optimizer_state_tensors(self.optimizer)
        state = flatten([self.flat.params, self.flat.buffers, *extra])
        keep = self._held()
        ref = flatten([state[a:b] for a, b in keep])
        if keep:
            broadcast(self.topo.world, ref, root=0)
            _each_range(keep, ref, lambda dst, r: dst.sub_(r), state)
        self.comm.global_average(state)
        if keep:
            _each_range(keep, ref, lambda dst, r: dst.copy_(torch.where(dst == 0, r, dst + r)),
                        state)
        unflatten_into(state, [self.flat.params, self.flat.buffers, *extra])

    # -- epochs -------------------------------------------------------------------------------
    def epoch_end(self, train_loss: float) -> dict:
        """Close the epoch: average ``train_loss`` over all ranks, adapt the schedule.

        Returns the epoch's record: ``train_loss`` (rank-averaged), ``daso_phase``,
        ``daso_global_skip``/``daso_local_skip``/``daso_batches_to_wait`` (the knobs this epoch
        ran with), ``daso_plateau``, ``daso_epoch``/``daso_batches`` (the schedule's count of the
        epoch closed and of its batches), and this rank's seconds waiting on global messages
        (``daso_global_wait_s``), in blocking global averages (``daso_blocking_global_s``), in
        node-local communication (``daso_local_s``), ``daso_global_bytes``, ``daso_local_bytes``
        and ``daso_sends``.
        """
        if self.inflight:
            raise RuntimeError(f"DASO: {len(self.inflight)} global message(s) still in flight "
                               f"at the end of an epoch")
        loss = self.topo.world.allreduce(float(train_loss)) / self.topo.size
        record = {"train_loss": loss, **self.schedule.end_epoch(loss)}
        self._lost_before = -1
        for key, value in self.comm.counters().items():
            record[f"daso_{key}"] = round(value, 4) if isinstance(value, float) else value
        self.comm.reset_counters()
        return record

    @property
    def replicas_equal(self) -> bool:
        """Every replica holds the same parameters and state now: between epochs and in the
        blocking epochs (warm-up, cool-down); inside a cycling epoch the nodes drift apart and
        each rank's state (its sends in flight) is its own."""
        sch = self.schedule
        return not sch.batch or sch.phase != CYCLING or not self.global_phase

    def checksum(self) -> str:
        """SHA-256 of this replica's parameters and float buffers (bitwise identity check)."""
        state = pack_state(self.flat.params, self.flat.buffers).cpu().contiguous()
        return hashlib.sha256(state.numpy().tobytes()).hexdigest()

    def _extra_state(self) -> dict:
        """Complete at any batch: the schedule, and each global send in flight completed now
        (its sum S, the batch it merges at, the ranges its merge keeps), so a load goes on as
        the undisturbed run would. Waiting is collective over the send's group: every rank
        saves at the same batch (a commit, a checkpoint); a send completes the same whenever it
        is waited for."""
        inflight = [{"group": m.group, "sent": m.sent_batch, "due": m.due_batch,
                     "nbytes": m.nbytes, "sum": self.comm.complete(m).clone(),
                     "keep": [list(r) for r in self._keep.get(m.sent_batch, ())]}
                    for m in self.inflight]
        return {"schedule": self.schedule.state_dict(), "steps": self.steps,
                "lost_before": self._lost_before, "inflight": inflight}

    def _load_extra(self, extra: dict) -> None:
        self.schedule.load_state_dict(extra["schedule"])
        self.steps = int(extra["steps"])
        self._lost_before = int(extra.get("lost_before", -1))
        self._synced_plan = None
        self._recount = True            # (maybe) another world: a sampler recounts the epoch
        self.inflight.clear()
        self._keep.clear()
        for m in extra.get("inflight", ()):
            total = m["sum"].to(device=self._scratch.device)
            self.inflight.append(InFlight(int(m["group"]), Received(total), int(m["sent"]),
                                          int(m["due"]), 0.0, int(m["nbytes"])))
            self._keep[int(m["sent"])] = [tuple(r) for r in m["keep"]]


def _own_topology():
    """A replacement spawned by an elastic grow-back builds its DASO on a topology of itself
    alone (local: no collective the survivors would have to match); its ``hpcasync.elastic``
    State moves it onto the grown world with the survivors' ``set_topology``."""
    from ..topology import Topology, init_mpi

    return Topology.build(init_mpi().COMM_SELF, ranks_per_node=1)


def _each_range(ranges, packed: torch.Tensor, fn, state: torch.Tensor) -> None:
    """``fn(state[a:b], piece)`` for each range and its consecutive piece of ``packed``."""
    at = 0
    for a, b in ranges:
        fn(state[a:b], packed[at: at + b - a])
        at += b - a


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's per-parameter floating state shaped like its parameter (SGD's
    ``momentum_buffer``, Adam's ``exp_avg``/``exp_avg_sq``), in parameter order, keys sorted."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            for key in sorted(st):
                v = st[key]
                if torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape:
                    out.append(v)
    return out
