"""Local SGD and post-local SGD (Lin, Stich, Patel, Jaggi, ICLR 2020): SSGD for a warm-up, then
each rank steps its own optimizer on its own replica and the replicas' parameters are averaged
every ``period`` steps.

With N ranks, step k (0-based) of each rank:

- k < ``warmup_steps``: SSGD — the gradients are averaged (divided by N, then summed) before the
  optimizer's step, so replicas stay equal;
- k ≥ ``warmup_steps``: the rank's own gradient, its own optimizer step; then, when
  (k − ``warmup_steps``) is a multiple of ``period``, θ_i ← (1/N)·Σ_j θ_j over the parameters of
  the optimizer's groups that have a gradient (divided by N, then summed). The optimizer's state
  (momentum, Adam's moments) stays local.

This is torch's ``PostLocalSGDOptimizer`` with a ``PeriodicModelAverager(period, warmup_steps)``
over DDP with ``post_localSGD_hook`` (``start_localSGD_iter = warmup_steps``, no gradient
allreduce after it): the same floats on the same inputs (``tests/mpi/test_localsgd.py``).
Where it differs:

- floating buffers (BatchNorm statistics) are averaged with the parameters, and with the
  gradients during the warm-up (DDP instead broadcasts rank 0's buffers before every forward);
- :meth:`LocalSGD.average_parameters` averages the replicas at any step (the CLI calls it at
  each epoch's end, so that every rank evaluates, checkpoints and ends with the same model);
- :attr:`LocalSGD.replicas_equal` says whether the replicas are equal now; between two
  averages :meth:`LocalSGD.local_state_dict` holds each rank's replica, which checkpoints keep
  for every rank (``hpcasync.save_checkpoint``, the CLI's).

Example (a user's own loop)::

    opt = hpcasync.optimizer("localsgd", model, torch.optim.SGD(model.parameters(), lr=0.1),
                             period=8, warmup_steps=100)
    for x, y in loader:
        opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
    opt.average_parameters()         # one model on every rank before evaluating

Design: docs/design/ssgd.md, "Local SGD".
"""
from __future__ import annotations

import contextlib
import copy
import logging

import torch

from ..comm import allreduce
from ..errors import ConfigError
from ..runtime.ft import ulfm_enabled
from .optimizer import DistributedOptimizer

__all__ = ["LocalSGD"]

log = logging.getLogger("hpcasync")

#: the defaults: torch's documented example (``PeriodicModelAverager(period=4, warmup_steps=100)``)
DEFAULT_PERIOD, DEFAULT_WARMUP_STEPS = 4, 100


class LocalSGD(DistributedOptimizer):
    """Post-local SGD around the user's optimizer (module doc).

    Args:
        optimizer, model, comm: as :class:`~hpcasync.ssgd.DistributedOptimizer`.
        period: H, steps between two averages of the parameters (≥ 1).
        warmup_steps: SSGD steps first (post-local SGD; 0: local SGD from the first step).
        average_buffers: average the floating buffers with the parameters (default True).

    ``compress``, ``overlap``, ``bucket_bytes`` and ``backward_passes_per_step`` are not taken:
    the warm-up's gradients travel as one pre-divided sum, as the reference's.
    """

    algorithm = "localsgd"
    _amp_supported = False      # (its steps are local: a GradScaler's skip would be one rank's)

    def __init__(self, optimizer: torch.optim.Optimizer, model, comm=None, *,
                 period: int = DEFAULT_PERIOD, warmup_steps: int = DEFAULT_WARMUP_STEPS,
                 average_buffers: bool = True):
        self.check(period, warmup_steps, algorithm=self.algorithm)
        self.period, self.warmup_steps = period, warmup_steps
        self.averages = 0          # parameter averages taken
        self._equal_since = -1     # the step count after the last average
        self._survivable = ulfm_enabled()    # a failed step can be redone (else the job ends)
        self._own_grads = False    # the gradients are torch's own tensors (local steps)
        super().__init__(optimizer, model, comm, average_buffers=average_buffers, overlap=False)

    def _whole_reduction(self):
        return self._reduce_gradients

    @classmethod
    def cli_keywords(cls, given: dict, topo=None) -> dict:
        """Checks ``period`` and ``warmup_steps`` (the CLI's ``--localsgd-*``, ``--slowmo-period``)."""
        cls.check(given.get("period"), given.get("warmup_steps"), algorithm=cls.algorithm)
        return dict(given)

    @staticmethod
    def check(period, warmup_steps, *, algorithm: str = "localsgd") -> None:
        """One-line errors for a bad ``period`` / ``warmup_steps`` (None: the default), naming
        ``algorithm`` (SlowMo's and DiLoCo's periods are checked here too)."""
        for name, value, low in (("period", period, 1), ("warmup_steps", warmup_steps, 0)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < low):
                raise ConfigError(f"{algorithm} {name} must be an integer >= {low}, got {value!r}")

    # -- the step --------------------------------------------------------------------------------
    def _step_comm(self):
        """The warm-up averages every step over ``comm``; after it nothing (None)."""
        return self.comm if self.steps < self.warmup_steps else None

    def _reduce_gradients(self, presence) -> None:
        """Over :meth:`_step_comm` (the warm-up's: all ranks), the gradients (with the "used by
        some rank" flags in front) divided by its size, then summed; with None, nothing: each
        rank keeps its own."""
        comm = self._step_comm()
        if comm is None:
            return
        span = self.flat.presence_and_grads[:self.flat.presence.numel() + self.flat.numel]
        span.div_(comm.Get_size())
        allreduce(comm, span)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """SSGD's, except before a local step with ``set_to_none`` (torch's default): then the
        gradients are torch's own, as in one process: every ``p.grad`` is set to None, the
        backward makes fresh ones and the local step applies them as the wrapped optimizer
        does, with no gradient hook and no copy into the flat buffer (a parameter without a
        gradient keeps None and is skipped; two backward passes add up, as torch's)."""
        if set_to_none and self._step_comm() is None:
            self._check_bound()
            self.reducer.discard()
            self._passes.pause()
            for p in self.flat.parameters:
                p.grad = None
            self._own_grads = self._none_if_unused = True
            return
        self._own_grads = False
        self._passes.resume()
        super().zero_grad(set_to_none)

    def synchronize(self) -> None:
        """SSGD's over :meth:`_step_comm` (the warm-up's). Without one: local, nothing crosses
        the wire (each rank's own gradients; one no rank of its own got stays None)."""
        if self._step_comm() is not None:
            return super().synchronize()
        self._check_bound()
        if self._own_grads:             # torch's own gradients (zero_grad before a local step)
            self._passes.reset()
            self._synchronized = True
            return
        self.reducer.finish()
        self.flat.collect_grads()
        self._release_unused()
        self._passes.reset()
        self._synchronized = True

    def _note_local_clip(self) -> None:
        if self._step_comm() is not None:     # (a local step's clip acts on the gradient stepped)
            super()._note_local_clip()

    def step(self, closure=None):
        """The inner step, then (every ``period`` steps after the warm-up) the average. A step
        whose communication fails (a dead rank) is undone: parameters, buffers, the optimizer's
        state and the counters are those before it, so that redoing it (the CLI's recovery)
        applies it once."""
        k = self.steps
        averages = k >= self.warmup_steps and (k - self.warmup_steps) % self.period == 0
        with self._undone_on_failure(averages):
            result = super().step(closure)
            if averages:
                self._average(only_with_grad=True)
        return result

    @contextlib.contextmanager
    def _undone_on_failure(self, communicates: bool):
        """Inside, a step that communicates after the optimizer's step: on an exception the
        state before it comes back (a copy of it, taken only for such steps and only under ULFM,
        where a death is survived and the step redone), then re-raise."""
        if not (communicates and self._survivable):
            yield
            return
        saved = (self.flat.params.clone(), self.flat.buffers.clone(),
                 copy.deepcopy(self.optimizer.state_dict()), copy.deepcopy(self._counters()))
        try:
            yield
        except BaseException:
            with torch.no_grad():
                self.flat.params.copy_(saved[0])
                self.flat.buffers.copy_(saved[1])
            self.optimizer.load_state_dict(saved[2])
            self._set_counters(saved[3])
            raise

    def _counters(self) -> dict:
        return {"steps": self.steps, "averages": self.averages, "equal_since": self._equal_since,
                "bytes_sent": self.bytes_sent}

    def _set_counters(self, c: dict) -> None:
        self.steps, self.averages = c["steps"], c["averages"]
        self._equal_since, self.bytes_sent = c["equal_since"], c["bytes_sent"]

    def average_parameters(self) -> None:
        """Average every parameter of the optimizer's groups (and the floating buffers) over the
        ranks now; collective."""
        self._average(only_with_grad=False)

    def _average(self, *, only_with_grad: bool) -> None:
        params = [p for g in self.param_groups for p in g["params"]
                  if p.grad is not None or not only_with_grad]
        if params:
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            flat.div_(self.comm.Get_size())
            allreduce(self.comm, flat)
            self.bytes_sent += flat.numel() * flat.element_size()
            with torch.no_grad():
                k = 0
                for p in params:
                    p.copy_(flat[k:k + p.numel()].view_as(p))
                    k += p.numel()
        if self.sync_buffers:
            self.average_buffers()
            self.bytes_sent += self.flat.buffer_numel * 4
        self.averages += 1
        self._equal_since = self.steps

    def finish(self) -> None:
        """The end of training: one model on every rank (:meth:`average_parameters`), as the
        other algorithms' ``finish()`` leaves every rank with the final model."""
        self.average_parameters()

    own_optimizer_state = True

    def local_state_dict(self) -> dict | None:
        """This rank's own state: its optimizer's, and between two averages (the replicas
        differ) its parameters and floating buffers too, so that a checkpoint at any step keeps
        every replica (the CLI's and ``hpcasync.save_checkpoint``'s ``per_rank``)."""
        out = super().local_state_dict() or {}
        if not self.replicas_equal:
            out["params"] = self.flat.params.detach().clone()
            if self.flat.buffers.numel():
                out["buffers"] = self.flat.buffers.detach().clone()
        return out or None

    def load_local_state_dict(self, local: dict | None) -> None:
        super().load_local_state_dict(local)
        if local and "params" in local:
            with torch.no_grad():
                self.flat.params.copy_(local["params"])
                if "buffers" in local:
                    self.flat.buffers.copy_(local["buffers"])

    @property
    def replicas_equal(self) -> bool:
        """True while the replicas are equal: during the warm-up and right after an average."""
        return self.steps <= self.warmup_steps or self._equal_since == self.steps

    def check_run_length(self, steps: int) -> None:
        """Said once on rank 0 when a run of ``steps`` steps per rank (the CLI's, before
        training) never leaves the SSGD warm-up or takes no periodic average (as DASO and
        OD-SGD say their degenerate runs)."""
        if self.comm.Get_rank() != 0:
            return
        if self.warmup_steps >= steps:
            log.warning("%s: the run's %d steps per rank are all inside the %d SSGD warm-up "
                        "steps (warmup_steps%s): it is SSGD throughout", self.algorithm, steps,
                        self.warmup_steps, ", --localsgd-warmup-steps"
                        if self.algorithm == "localsgd" else "")
        elif steps - self.warmup_steps < self.period:
            log.warning("%s: period %d (--%s-period) is more than the run's %d local steps per "
                        "rank: no periodic sync is taken; the CLI averages the replicas at each "
                        "epoch's end", self.algorithm, self.period, self.algorithm,
                        steps - self.warmup_steps)

    def _extra_state(self) -> dict:
        return {**super()._extra_state(), "averages": self.averages,
                "equal_since": self._equal_since}

    def _load_extra(self, extra: dict) -> None:
        super()._load_extra(extra)
        self.averages = int(extra.get("averages", 0))
        self._equal_since = int(extra.get("equal_since", -1))
