"""What every parameter-server update rule shares: the push/reply records, the :class:`Rule` base
class, hyperparameter checks, state-dict helpers and the learning-rate schedules.

A rule is the math of one asynchronous algorithm, with no MPI in it. Both runtimes (the MPI
parameter server and the one-process simulator) drive the same object::

    rule = make_rule("asgd", theta0, num_workers=4, lr=0.1)
    local.copy_(rule.initial_reply(w).params)                # worker w starts here
    reason = rule.validate(w, grad, PushMeta(version=v))     # PS: reject bad pushes ...
    reply = rule.on_push(w, grad, PushMeta(version=v))       # ... apply good ones
    rule.on_reply(local, reply, grad)                        # worker side, in place

Design: docs/design/rules.md#rule-contract (worker numbering, versions, aliasing, the worker side,
state dicts, param groups).
"""
from __future__ import annotations

import logging
import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import Tensor

from ..errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)


@dataclass
class PushMeta:
    """What a worker sends with its gradient."""
    version: int                       # PS version of the parameters the gradient was computed on
    loss: float = math.nan             # mini-batch loss at those parameters (LC-ASGD)
    oracle_loss: float = math.nan      # LC-ASGD oracle: loss at the current θ on the same batch


@dataclass
class Reply:
    """What the PS sends back: parameters (θ, or an estimate θ̂), its version, fixed-length extras."""
    params: Tensor
    version: int
    scalars: tuple[float, ...] = ()


# ----------------------------------------------------------------------------------------------
# hyperparameter checks (ConfigError naming the value)

def check_real(name: str, value: Any, *, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite float inside the given bounds, else ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    value = float(value)
    if low is not None and (value < low or (low_open and value == low)):
        raise ConfigError(f"{name} must be {'>' if low_open else '>='} {low:g}, got {value!r}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ConfigError(f"{name} must be {'<' if high_open else '<='} {high:g}, got {value!r}")
    return value


def check_int(name: str, value: Any, *, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if low is not None and value < low:
        raise ConfigError(f"{name} must be >= {low}, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def noise_over_target(sigma2: Any, epsilon: Any) -> int:
    """``max(1, ⌈σ²/ε⌉)`` for gradient noise σ² >= 0 and target ε > 0: the batch of Rennala SGD
    and the delay threshold of Ringmaster ASGD in their papers' theorems."""
    sigma2 = check_real("sigma2", sigma2, low=0.0)
    epsilon = check_real("epsilon", epsilon, low=0.0, low_open=True)
    return max(1, math.ceil(sigma2 / epsilon))


# ----------------------------------------------------------------------------------------------
# state-dict helpers

def clone_tree(obj: Any) -> Any:
    """Deep copy of nested dicts/lists/tuples whose leaves are tensors or plain values."""
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def tree_bytes(obj: Any) -> int:
    """Bytes held by the tensors in a nested structure."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tree_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tree_bytes(v) for v in obj)
    return 0


def need(d: dict, key: str) -> Any:
    """``d[key]``, or CheckpointError naming the missing key."""
    try:
        return d[key]
    except (KeyError, TypeError):
        raise CheckpointError(f"rule state is missing {key!r}") from None


def load_tensor(d: dict, key: str, like: Tensor) -> Tensor:
    """``d[key]`` as a fresh tensor with ``like``'s shape, dtype and device."""
    value = need(d, key)
    if not isinstance(value, Tensor) or value.shape != like.shape:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise CheckpointError(f"rule state {key!r} has shape {shape}, expected {tuple(like.shape)}")
    return value.detach().to(dtype=like.dtype, device=like.device).clone()


def load_worker_tensors(d: dict, key: str, like: Tensor, num_workers: int) -> dict[int, Tensor]:
    """A ``{worker: tensor}`` entry of a state dict, each tensor shaped like ``like``."""
    value = need(d, key)
    if not isinstance(value, dict):
        raise CheckpointError(f"rule state {key!r} is not a per-worker mapping")
    out = {}
    for w, t in value.items():
        if not isinstance(w, int) or not 0 <= w < num_workers:
            raise CheckpointError(f"rule state {key!r} names unknown worker {w!r}")
        out[w] = load_tensor({key: t}, key, like)
    return out


# ----------------------------------------------------------------------------------------------
# scalar-or-per-element arithmetic (a float: the one-group code; a tensor: one value per element)

def with_decay(grad: Tensor, theta: Tensor, wd: float | Tensor) -> Tensor:
    """``g + wd·θ`` (a new tensor), or ``grad`` itself when ``wd`` is the float 0."""
    if isinstance(wd, Tensor):
        return torch.addcmul(grad, theta, wd)
    return grad.add(theta, alpha=wd) if wd != 0 else grad


def sub_scaled_(y: Tensor, x: Tensor, a: float | Tensor) -> Tensor:
    """``y ← y − a·x`` in place (bitwise the same per element for a float or a tensor ``a``)."""
    if isinstance(a, Tensor):
        return y.addcmul_(x, a, value=-1)
    return y.sub_(x, alpha=a)


# ----------------------------------------------------------------------------------------------


#: the one line of an MPI run asked to stop stale computations
STOP_IN_SIM_ONLY = ("stopping stale computations (--ringmaster-stop, --rennala-stop, "
                    "stop_stale=True) runs in the simulator only (hpcasync sim): an MPI worker is "
                    "not interrupted inside its step, and its stale gradient is dropped when it "
                    "arrives")

class Rule:
    """Base class: θ, version, lr, weight decay, alive workers, validation and state handling.

    Subclasses implement ``_update`` (the math, in place) and, where the reply is not plain θ,
    ``_make_reply``; they extend ``_state``/``_load`` with their own state and
    ``_join``/``_leave`` with per-worker bookkeeping.

    Args:
        theta0: initial parameters, a 1-D floating tensor (float32 in practice); copied.
        num_workers: N, the number of workers (>= 1).
        lr: learning rate η (> 0). Settable later (``rule.lr = x``) by LR schedules (>= 0).
        weight_decay: L2 factor added to the gradient, ``g + wd·θ`` (default 0).
    """

    name: str = "rule"
    reply_scalars: int = 0

    def __init__(self, theta0: Tensor, num_workers: int, *, lr: float, weight_decay: float = 0.0):
        if not isinstance(theta0, Tensor) or theta0.dim() != 1 or not theta0.is_floating_point():
            what = (f"a {theta0.dim()}-D {theta0.dtype} tensor" if isinstance(theta0, Tensor)
                    else type(theta0).__name__)
            raise ConfigError(f"theta0 must be a flat (1-D) floating tensor, got {what}")
        self.num_workers = check_int("num_workers", num_workers, low=1)
        self._theta = theta0.detach().clone().contiguous()
        self._version = 0
        self._index = self._frozen = None          # param groups (set_groups): none
        self._spread_cache: dict[tuple, Tensor] = {}
        self.lr = check_real("lr", lr, low=0.0, low_open=True)
        self.weight_decay = check_real("weight_decay", weight_decay, low=0.0)
        self._alive = [True] * self.num_workers
        self.moved = False          # the last push changed θ (and the version)

    # -- basic properties ---------------------------------------------------------------------
    @property
    def theta(self) -> Tensor:
        """The PS's parameters (what is evaluated). Read-only by convention: do not modify."""
        return self._theta

    @property
    def version(self) -> int:
        """Number of updates of θ (one per accepted push, except in the rules that drop or
        batch gradients: Ringmaster, Rennala)."""
        return self._version

    @property
    def numel(self) -> int:
        return self._theta.numel()

    @property
    def lr(self) -> float | tuple[float, ...]:
        """η: a float, or with param groups (:meth:`set_groups`) one value per group."""
        return self._lr

    @lr.setter
    def lr(self, value) -> None:
        self._lr = self._per_group("lr", value)

    @property
    def weight_decay(self) -> float | tuple[float, ...]:
        """The L2 factor: a float, or with param groups one value per group."""
        return self._wd

    @weight_decay.setter
    def weight_decay(self, value) -> None:
        self._wd = self._per_group("weight_decay", value)

    @property
    def groups(self) -> int:
        """Number of param groups (1 without :meth:`set_groups`)."""
        return 1 if self._index is None else len(self._lr)

    def set_groups(self, index: Tensor | None, groups: int | None = None) -> None:
        """Param groups over θ: ``index[j]`` is element j's group (0..G-1), or -1 where torch's
        optimizer never moves it (docs/design/rules.md#rule-contract); ``groups`` is G
        (default: ``max(index) + 1``).
        ``lr`` and ``weight_decay`` then hold one value per group (the current ones are given
        to every group). ``None``: back to one group over every element."""
        if index is None:
            lr, wd = self._first(self._lr), self._first(self._wd)
            self._index = self._frozen = None
            self._lr, self._wd = lr, wd
            return
        index = torch.as_tensor(index).to(device=self._theta.device, dtype=torch.int64)
        if index.shape != self._theta.shape:
            raise ConfigError(f"group index has shape {tuple(index.shape)}, θ {tuple(self._theta.shape)}")
        G = int(index.max()) + 1 if groups is None and index.numel() else int(groups or 1)
        if index.numel() and (int(index.min()) < -1 or int(index.max()) >= G):
            raise ConfigError(f"group index outside -1..{G - 1}")
        lr, wd = self._first(self._lr), self._first(self._wd)
        frozen = (index < 0).nonzero().flatten()
        self._frozen = frozen if frozen.numel() else None
        self._index = torch.where(index < 0, G, index)       # G: the extra entry 0 (frozen)
        self._spread_cache.clear()
        self._lr, self._wd = (lr,) * G, (wd,) * G

    def spread(self, values: tuple[float, ...]) -> Tensor:
        """Per-group values as a per-element vector over θ (θ's dtype; 0 on frozen elements).
        The last few are cached (a schedule that holds still costs nothing)."""
        out = self._spread_cache.get(values)
        if out is None:
            table = torch.tensor(list(values) + [0.0], dtype=torch.float64)
            out = table.to(self._theta).index_select(0, self._index)
            if len(self._spread_cache) >= 4:
                self._spread_cache.pop(next(iter(self._spread_cache)))
            self._spread_cache[values] = out
        return out

    def coef(self, fn=None) -> float | Tensor:
        """``fn(lr)`` (default: lr) as the math uses it: a float without groups, else computed
        per group in float64 and spread over θ (0 on frozen elements)."""
        if self._index is None:
            return self._lr if fn is None else fn(self._lr)
        return self.spread(self._lr if fn is None else tuple(fn(x) for x in self._lr))

    @property
    def wd(self) -> float | Tensor:
        """The weight decay as the math uses it: a float (0.0 when every group's is 0), else a
        per-element vector."""
        if self._index is None:
            return self._wd
        return self.spread(self._wd) if any(self._wd) else 0.0

    def _per_group(self, name: str, value):
        """``value`` checked: a float without groups; with groups a tuple of G floats (a float
        is given to every group)."""
        many = isinstance(value, (tuple, list)) or (isinstance(value, Tensor) and value.dim() == 1)
        values = [float(v) for v in value] if many else [value]
        values = [check_real(name, v, low=0.0) for v in values]
        if self._index is None:
            if len(values) != 1:
                raise ConfigError(f"{name}: {len(values)} values for a rule without param groups")
            return values[0]
        G = len(self._lr)
        if len(values) == 1:
            values = values * G
        if len(values) != G:
            raise ConfigError(f"{name}: {len(values)} values for {G} param groups")
        return tuple(values)

    @staticmethod
    def _first(value):
        return value[0] if isinstance(value, tuple) else value

    @property
    def num_active(self) -> int:
        """Workers not retired."""
        return sum(self._alive)

    def is_alive(self, worker: int) -> bool:
        return 0 <= worker < self.num_workers and self._alive[worker]

    def worker_summary(self) -> dict:
        """The per-worker state as plain data, for a run's summary (``rule_workers``): which
        workers are alive, and what the rule keeps of its own (:meth:`_summary`)."""
        return {"active": self.num_active, "alive": [bool(a) for a in self._alive],
                **self._summary()}

    def _summary(self) -> dict:
        return {}

    def staleness(self, meta: PushMeta) -> int:
        """τ = version − meta.version: updates applied since the pushed gradient's parameters."""
        return self._version - int(meta.version)

    # -- the protocol ---------------------------------------------------------------------------
    def initial_reply(self, worker: int) -> Reply:
        """What worker ``worker`` starts from; (re)joins it and records what was sent."""
        worker = self._worker_index(worker)
        if not self._alive[worker]:
            self._alive[worker] = True
            log.info("%s: worker %d rejoined", self.name, worker)
        self._join(worker)
        return self._make_reply(worker, pushed=False)

    def on_push(self, worker: int, grad: Tensor, meta: PushMeta) -> Reply:
        """Apply worker ``worker``'s gradient (assumed valid: see :meth:`validate`), reply to it.
        Elements of no param group (:meth:`set_groups`) take a zero gradient."""
        if self._frozen is not None:
            grad = grad.index_fill(0, self._frozen, 0.0)
        self.moved = self._update(worker, grad, meta) is not False
        self._version += self.moved
        return self._make_reply(worker, pushed=True)

    def on_reply(self, local: Tensor, reply: Reply, grad: Tensor | None) -> None:
        """Worker side, in place on its flat parameters: by default take the reply's parameters."""
        local.copy_(reply.params)

    def retire(self, worker: int) -> None:
        """Worker ``worker`` died: drop its per-worker state; its later pushes are rejected."""
        worker = self._worker_index(worker)
        if self._alive[worker]:
            self._alive[worker] = False
            self._leave(worker)
            log.info("%s: worker %d retired (%d active)", self.name, worker, self.num_active)

    def check_run_length(self, pushes: int) -> None:
        """A run of ``pushes`` pushes in all (every worker's budget) that these settings would
        leave untrained ends in one line (:class:`ConfigError`) before it starts; the
        server calls it where the run's length is known. Default: every length trains."""

    def validate(self, worker: Any, grad: Any, meta: Any) -> str | None:
        """Why this push must be rejected, or None: unknown/retired worker, a gradient that is not a
        flat tensor of the right length and dtype, NaN/Inf, a version from the future or negative,
        or missing metadata the rule needs."""
        try:
            w = operator.index(worker)
        except TypeError:
            return f"worker id {worker!r} is not an integer"
        if not 0 <= w < self.num_workers:
            return f"unknown worker {w} (workers are 0..{self.num_workers - 1})"
        if not self._alive[w]:
            return f"worker {w} was retired"
        if not isinstance(grad, Tensor):
            return f"gradient is a {type(grad).__name__}, not a tensor"
        if grad.dim() != 1 or grad.numel() != self.numel:
            return f"gradient has shape {tuple(grad.shape)}, expected ({self.numel},)"
        if grad.dtype != self._theta.dtype:
            return f"gradient dtype {grad.dtype}, expected {self._theta.dtype}"
        if not isinstance(meta, PushMeta):
            return f"metadata is a {type(meta).__name__}, not a PushMeta"
        try:
            version = operator.index(meta.version)
        except TypeError:
            return f"version {meta.version!r} is not an integer"
        if version < 0:
            return f"negative version {version}"
        if version > self._version:
            return f"version {version} is from the future (PS is at {self._version})"
        if not bool(torch.isfinite(grad).all()):
            return "gradient contains NaN or Inf"
        return self._validate_meta(meta)

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """A deep copy of the PS state (tensors, ints, lists, dicts; ``weights_only``-safe)."""
        return clone_tree(self._state())

    def load_state_dict(self, d: dict) -> None:
        """Restore from :meth:`state_dict` of a rule built with the same arguments."""
        if not isinstance(d, dict):
            raise CheckpointError(f"rule state must be a dict, got {type(d).__name__}")
        if need(d, "num_workers") != self.num_workers:
            raise CheckpointError(f"rule state is for {d['num_workers']} workers, "
                                  f"this run has {self.num_workers}: resume a parameter server "
                                  "with as many workers as wrote the checkpoint")
        self._theta = load_tensor(d, "theta", self._theta)
        self._version = int(need(d, "version"))
        lr = need(d, "lr")
        self.lr = tuple(lr.tolist()) if lr.dim() else float(lr.item())
        alive = list(need(d, "alive"))
        if len(alive) != self.num_workers:
            raise CheckpointError("rule state 'alive' does not list every worker")
        self._alive = [bool(a) for a in alive]
        self._load(d)

    def state_bytes(self) -> int:
        """Bytes of the rule's PS-side state, θ included. This is the rule's part of the PS's
        memory only: the transport's windows/buffers and the server's buffer table come on top
        (``hpcasync.ps.memory``; a run records ``ps_state_bytes`` beside ``ps_transport_bytes``,
        ``ps_buffers_bytes`` and ``ps_total_bytes``)."""
        return tree_bytes(self._state())

    # -- hooks for subclasses --------------------------------------------------------------------
    def _update(self, worker: int, grad: Tensor, meta: PushMeta) -> bool | None:
        """The math, in place. Returns False when θ did not change (a gradient dropped or held
        for a later step: Ringmaster, Rennala): the version then stays."""
        raise NotImplementedError

    def _make_reply(self, worker: int, *, pushed: bool) -> Reply:
        return Reply(self._theta, self._version)

    def _join(self, worker: int) -> None:
        pass

    def _leave(self, worker: int) -> None:
        pass

    def _validate_meta(self, meta: PushMeta) -> str | None:
        return None

    def _state(self) -> dict:
        """The live state (no copies); subclasses add their entries."""
        return {"num_workers": self.num_workers, "version": self._version, "theta": self._theta,
                "lr": torch.tensor(self._lr, dtype=torch.float64),
                "alive": [int(a) for a in self._alive]}

    def _load(self, d: dict) -> None:
        pass

    _buf: Tensor | None = None              # the shared momentum buffer of the rules that have one

    def _momentum_buffer(self) -> Tensor | None:
        """The shared momentum buffer, made (zeros) the first time ``momentum`` > 0: a schedule
        (OneCycleLR) may turn momentum on after the start, as with ``torch.optim.SGD``."""
        if self._buf is None and getattr(self, "momentum", 0.0):
            self._buf = self._theta.new_zeros(self._theta.shape)
        return self._buf

    def _load_buffer(self, d: dict) -> None:
        self._buf = load_tensor(d, "momentum_buf", self._theta) if "momentum_buf" in d else None

    def _worker_index(self, worker: Any) -> int:
        w = operator.index(worker)
        if not 0 <= w < self.num_workers:
            raise ValueError(f"unknown worker {w} (workers are 0..{self.num_workers - 1})")
        return w

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(numel={self.numel}, num_workers={self.num_workers}, "
                f"lr={self._lr}, version={self._version})")


# ----------------------------------------------------------------------------------------------
# learning-rate schedules (the runtime applies them by setting ``rule.lr``)

def warmup_lr(base_lr: float, epoch_float: float, warmup_epochs: float, start_lr: float) -> float:
    """Linear warm-up from ``start_lr`` at epoch 0 to ``base_lr`` at ``warmup_epochs``; then
    ``base_lr``. ``epoch_float`` is fractional (``epoch + batch / batches_per_epoch``).

    Example (SMEGA2's warm-up from lr/N over 5 epochs)::

        rule.lr = warmup_lr(0.1, epoch + b / nb, 5, 0.1 / num_workers)
    """
    if warmup_epochs <= 0 or epoch_float >= warmup_epochs:
        return base_lr
    frac = max(epoch_float, 0.0) / warmup_epochs
    return start_lr + (base_lr - start_lr) * frac


def step_decay_lr(base_lr: float, epoch: float, milestones: Iterable[float] = (80, 120),
                  gamma: float = 0.1) -> float:
    """``base_lr · gamma^k`` where k is the number of milestones already reached (epoch >= m)."""
    k = sum(1 for m in milestones if epoch >= m)
    return base_lr * gamma ** k


def smega2_lr(epoch_float: float, *, base_lr: float = 0.1, num_workers: int,
              warmup_epochs: float = 5, milestones: Iterable[float] = (80, 120),
              gamma: float = 0.1) -> float:
    """SMEGA2's reference schedule: linear warm-up from ``base_lr/N`` over ``warmup_epochs`` (per
    batch), step decay ×``gamma`` at ``milestones`` (whole epochs)."""
    lr = step_decay_lr(base_lr, math.floor(epoch_float), milestones, gamma)
    return warmup_lr(lr, epoch_float, warmup_epochs, base_lr / num_workers)


class StopsStale:
    """A rule that drops gradients computed at too old a θ and, with ``stop_stale``, has them
    stopped before they arrive: after each step of θ a driver that can interrupt a worker (the
    simulator's :class:`~hpcasync.sim.engine.AsyncSim`) asks :meth:`is_stale` of the version
    each worker computes at and, where True, calls :meth:`stop` and restarts that worker from
    its reply. The MPI server cannot interrupt a worker and refuses it (:data:`STOP_IN_SIM_ONLY`).
    Mixed in before the rule's base class; the rule defines :meth:`is_stale`."""

    stop_stale = False

    def set_stop_stale(self, stop_stale: bool) -> None:
        if not isinstance(stop_stale, bool):
            raise ConfigError(f"stop_stale must be True or False, got {stop_stale!r}")
        self.stop_stale, self.stopped = stop_stale, 0

    def is_stale(self, version: int) -> bool:
        raise NotImplementedError

    def stop(self, worker: int) -> Reply:
        """Worker ``worker``'s computation is stopped: what it starts again from (θ now)."""
        self.stopped += 1
        return self._make_reply(self._worker_index(worker), pushed=False)

    def _stop_state(self) -> dict:
        return {"stopped": self.stopped} if self.stop_stale else {}

    def _summary(self) -> dict:
        return {**super()._summary(), **self._stop_state()}   # stopped computations (sim)

    def _load_stop(self, d: dict) -> None:
        self.stopped = int(d.get("stopped", 0))
