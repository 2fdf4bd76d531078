"""SSGD: synchronous data-parallel SGD (the Horovod-style baseline).

Every step, every rank averages its gradient with all the others' (one allreduce over the flat
gradient buffer) and applies the same local optimizer step, so replicas stay bitwise identical
(invariant 3). The gradient's path: ``loss.backward()`` writes into views of ``FlatModel.grads`` ->
``DistributedOptimizer.synchronize()`` allreduce-averages that one buffer in place ->
the user's ``optimizer.step()`` reads the averaged ``p.grad`` views.

Heterogeneity (``--hetero``, ``--straggler``, ``--compute-time``, ``--push-delay``; see
:mod:`hpcasync.hetero`; the worker index is the rank): :class:`StepDelay` makes a slow rank sleep
after its forward/backward, before the allreduce, so every rank waits for it — the cost a
synchronous algorithm pays for a straggler. OD-SGD uses it the same way.

``--backend horovod`` runs the same loop with Horovod's ``DistributedOptimizer`` instead (it must be
installed: ``scripts/install-horovod.sh``), for side-by-side comparisons.

Example (a user's own loop)::

    flat = FlatModel(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), flat, MPI.COMM_WORLD)
    opt.broadcast_parameters(root=0)
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections import deque

import torch
import torch.nn.functional as F

from ..comm import FlatModel, allreduce
from ..comm.broadcast import broadcast
from ..daso.comm import LinkDelay
from ..data import batches, shard_indices
from ..errors import ConfigError
from ..hetero import DelayModel
from ..hetero import check_options as check_hetero
from .context import RunContext, RunResult, max_over, mean_over

log = logging.getLogger("hpcasync")


class DistributedOptimizer:
    """Wrap a torch optimizer so ``step()`` first averages gradients across ``comm``.

    Args:
        optimizer: the user's optimizer over the parameters of ``flat``'s module.
        flat: the :class:`~hpcasync.comm.FlatModel` whose ``grads`` buffer backs every ``p.grad``.
        comm: the communicator to average over (all data-parallel ranks).
        backward_passes_per_step: gradients of this many ``step()`` calls are accumulated locally
            before one allreduce and one optimizer step (as Horovod's option of the same name).
        compress: ``None``, ``"bf16"`` or ``"fp16"``: the wire format of the allreduce.

    The wrapper forwards ``param_groups`` and ``state``, so LR schedulers work on it unchanged.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, flat: FlatModel, comm, *,
                 backward_passes_per_step: int = 1, compress: str | None = None):
        if backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self.optimizer = optimizer
        self.flat = flat
        self.comm = comm
        self.backward_passes_per_step = backward_passes_per_step
        self.compress = compress
        self.passes = 0            # backward passes accumulated since the last step
        self.steps = 0             # optimizer steps taken
        self.bytes_sent = 0        # payload bytes handed to allreduce by this rank
        self.comm_time = 0.0       # seconds spent in allreduce
        self._synchronized = False
        self._skip = False

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def broadcast_parameters(self, root: int = 0) -> None:
        """Make every replica start from ``root``'s parameters and buffers (not from seeds)."""
        for tensor in (self.flat.params, self.flat.buffers):
            if tensor.numel():
                broadcast(self.comm, tensor, root=root)

    def synchronize(self) -> None:
        """Average the flat gradient buffer across ranks, in place. Called by ``step()``."""
        t0 = time.perf_counter()
        allreduce(self.comm, self.flat.grads, average=True, compress=self.compress)
        self.comm_time += time.perf_counter() - t0
        self.bytes_sent += self.flat.grads.numel() * (2 if self.compress else 4)
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use after an explicit ``synchronize()`` (e.g. to clip averaged gradients) before step."""
        if not self._synchronized:
            log.warning("skip_synchronize() without synchronize(): gradients are not averaged")
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        if closure is not None:
            raise ConfigError("DistributedOptimizer.step does not take a closure")
        self.passes += 1
        if self.passes < self.backward_passes_per_step:
            return None          # keep accumulating into the flat gradient buffer
        if not self._skip:
            self.synchronize()
        self.passes = 0
        self._synchronized = False
        self.steps += 1
        return self.optimizer.step()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient buffer (``set_to_none`` would detach ``p.grad`` from it)."""
        if self.passes:
            return               # mid-accumulation: keep the partial sum
        self.flat.grads.zero_()

    def average_buffers(self) -> None:
        """Average floating-point module buffers (BatchNorm running statistics) across ranks."""
        if self.flat.buffers.numel():
            allreduce(self.comm, self.flat.buffers, average=True)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])


class StepDelay:
    """Heterogeneity for a synchronous runtime: after rank ``rank``'s compute, sleep
    ``natural · (factor − 1)`` and the push delay (:class:`~hpcasync.hetero.DelayModel`, worker
    index = rank). ``natural`` is the median of the last 15 steps' forward/backward times: CPU time
    of the process on a CPU device (a rank the OS kept waiting is not slow), wall time on a GPU.

    Example::

        delay = StepDelay.from_config(cfg, rank=topo.rank, size=topo.size, device=topo.device)
        delay.begin(); loss.backward(); delay.end(step)      # sleeps if this rank is slow
        opt.step()                                           # everyone waits for it here
    """

    def __init__(self, model: DelayModel, rank: int, device: str = "cpu"):
        self.model, self.rank = model, rank
        self.active = not model.trivial
        self.cpu_clock = torch.device(device).type == "cpu"
        self.recent: deque[float] = deque(maxlen=15)
        self.slept = 0.0          # seconds slept so far
        self._t0 = self._c0 = 0.0

    @classmethod
    def from_config(cls, cfg, *, rank: int, size: int, device: str = "cpu") -> "StepDelay":
        return cls(DelayModel.from_options(cfg.options, worker_ranks=range(size), seed=cfg.seed),
                   rank, device)

    def begin(self) -> None:
        if self.active:
            self._t0, self._c0 = time.perf_counter(), time.process_time()

    def end(self, step: int) -> float:
        """After the compute of step ``step``: sleep as the model says; returns seconds slept."""
        if not self.active:
            return 0.0
        natural = (time.process_time() - self._c0 if self.cpu_clock
                   else time.perf_counter() - self._t0)
        self.recent.append(natural)
        t = self.model.sleep_extra(self.rank, step, statistics.median(self.recent))
        if self.model.push_delay_s:
            self.model.sleep_push()
            t += self.model.push_delay_s
        self.slept += t
        return t

    def record(self) -> dict:
        """Summary fields: the delay model (as recorded and in words)."""
        return {"hetero": self.model.to_record(), "hetero_describe": self.model.describe()}


def add_arguments(parser) -> None:
    group = parser.add_argument_group("ssgd")
    group.add_argument("--compress", choices=("none", "bf16", "fp16"), default="none",
                       help="wire format of gradient allreduces (ssgd, daso)")
    group.add_argument("--link-delay-us-per-mb", type=float, default=0.0,
                       help="ssgd: emulated slow inter-node link, µs per 10^6 bytes of each "
                            "step's gradient message (only with more than one node; default 0)")


def validate(cfg) -> None:
    check_hetero(cfg.options)
    d = cfg.options.get("link_delay_us_per_mb", 0.0)
    if not isinstance(d, (int, float)) or not 0 <= d < float("inf"):
        raise ConfigError(f"--link-delay-us-per-mb must be a finite number >= 0, got {d!r}")
    if cfg.backend == "horovod":
        try:
            import horovod.torch  # noqa: F401
        except ImportError:
            raise ConfigError("--backend horovod: Horovod is not installed; "
                              "run scripts/install-horovod.sh") from None


def _make_optimizer(cfg, model):
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay)


def run(ctx: RunContext) -> RunResult:
    cfg, topo = ctx.cfg, ctx.topo
    model = ctx.make_model()
    if cfg.backend == "horovod":
        from .horovod_backend import HorovodOptimizer

        opt = HorovodOptimizer(_make_optimizer(cfg, model), model, topo.world)
        flat = None
    else:
        flat = FlatModel(model)
        compress = None if cfg.options.get("compress", "none") == "none" else cfg.options["compress"]
        opt = DistributedOptimizer(_make_optimizer(cfg, model), flat, topo.world, compress=compress)
    opt.broadcast_parameters(root=0)
    delay = StepDelay.from_config(cfg, rank=topo.rank, size=topo.size, device=topo.device)
    if ctx.is_root and delay.active:
        log.info("ssgd: heterogeneity: %s", delay.model.describe())
    # emulated slow inter-node link (as DASO's, hpcasync.daso.comm): each step's gradient message
    # crosses it once per node, at its wire size; only a job of more than one node pays
    link = LinkDelay(cfg.options.get("link_delay_us_per_mb", 0.0) if topo.num_nodes > 1 else 0.0)
    numel = sum(p.numel() for p in model.parameters())
    wire_bytes = numel * (2 if cfg.options.get("compress", "none") != "none" and flat else 4)
    start_epoch, start_batch, loss_carry = 1, 0, 0.0
    state = ctx.resume_state()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_epoch, start_batch, loss_carry = state["epoch"], state["batch"], state["loss_sum"]

    def snapshot(epoch: int, batch: int, loss_sum: float) -> dict:
        """Everything a resumed run needs to continue bitwise: replicas are identical, so rank 0's."""
        return {"model": model.state_dict(), "optimizer": opt.state_dict(),
                "epoch": epoch, "batch": batch, "loss_sum": loss_sum}

    device = topo.device
    for epoch in range(start_epoch, cfg.epochs + 1):
        indices = shard_indices(len(ctx.train), shard_index=topo.rank, num_shards=topo.size,
                                seed=cfg.seed, epoch=epoch)
        nbatches = len(indices) // cfg.batch_size
        first = start_batch if epoch == start_epoch else 0
        loss_sum = loss_carry if epoch == start_epoch else 0.0
        ctx.progress.start(nbatches - first, f"epoch {epoch}/{cfg.epochs}")
        slept = delay.slept
        model.train()
        for i, (x, y) in enumerate(batches(ctx.train, indices, cfg.batch_size, start_batch=first),
                                   start=first):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            delay.begin()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            delay.end(opt.steps)         # a straggler sleeps here; the allreduce waits for it
            opt.step()
            link.block(wire_bytes)
            loss_sum += ctx.step_done(epoch, i + 1, loss.item())
            if i + 1 < nbatches:
                ctx.consistent_point(topo.world, lambda: snapshot(epoch, i + 1, loss_sum),
                                     epoch=epoch, step=opt.steps, writer=topo.rank == 0)
        opt.average_buffers()
        train_loss = mean_over(topo.world, loss_sum / max(1, nbatches))
        ctx.epoch_end(epoch, model, train_loss=train_loss,
                      bytes_communicated=topo.world.allreduce(opt.bytes_sent),
                      comm_time_s=round(opt.comm_time, 4),
                      sleep_time_max_s=round(max_over(topo.world, delay.slept - slept), 4))
        ctx.consistent_point(topo.world, lambda: snapshot(epoch + 1, 0, 0.0), epoch=epoch,
                             step=opt.steps, writer=topo.rank == 0, force=True)
    return RunResult(model=model, summary={
        "backend": cfg.backend, "steps": opt.steps,
        "bytes_communicated": topo.world.allreduce(opt.bytes_sent), **delay.record(),
        "sleep_time_s": topo.world.allgather(round(delay.slept, 4))})
