"""A model's parameters, gradients and buffers as flat contiguous float32 vectors.

``FlatModel(module)`` moves every parameter into ONE 1-D float32 tensor ``params`` and re-binds each
``p.data`` to a view of it; the matching ``grads`` tensor provides each ``p.grad`` as a view, so
``loss.backward()`` accumulates straight into ``grads`` (autograd adds into an existing ``.grad`` in
place). Floating-point module buffers (BatchNorm running mean/var) become views of a third flat
tensor, ``buffers``; integer buffers (``num_batches_tracked``) stay as they are and are listed in
``int_buffers``. A whole model then travels as one message (one allreduce, one RMA Put), with no
packing step (PyTorch's ``parameters_to_vector`` / Horovod's fusion buffer copy on every call).

Layout: parameters in ``module.named_parameters()`` order (shared parameters once), each at
``offsets[k]`` with ``numel`` elements; θ = params, ∇θ = grads.

Rules that keep the views alive:

* zero gradients with ``flat.zero_grad()`` (= ``grads.zero_()``), or any ``zero_grad()``: the
  default ``set_to_none=True`` drops the views (the next backward then allocates fresh, unshared
  ``.grad`` tensors); every algorithm calls :meth:`collect_grads` before it reads ``grads``, which
  copies such gradients back and re-binds the views. :meth:`check` lists what is detached.
* ``grads`` is the head of ``grads_and_buffers``, whose tail ``buffer_wire`` carries a copy of
  ``buffers`` when a step averages both in one message; in front of ``grads`` lies ``presence``
  (one float per parameter: did it get a gradient this step), ``presence_and_grads`` the two.
* build the FlatModel after moving the module to its device and before creating the optimizer; never
  ``module.to(...)`` afterwards (:meth:`unbound` names the parameter it detached; every
  algorithm's step stops with that name).
* the parameters and floating buffers are float32 and on one device (:func:`check_model`):
  another dtype, or several devices, is a one-line error, not a silent cast or move.

Example::

    flat = FlatModel(net)
    flat.zero_grad(); loss_fn(net(x), y).backward()
    allreduce(comm, flat.grads, average=True)
    opt.step()                       # updates the views, hence flat.params
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from . import persistent


def flatten(tensors, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Concatenate ``tensors`` into one new 1-D tensor (optionally cast to ``dtype``)."""
    tensors = list(tensors)
    if not tensors:
        return torch.empty(0, dtype=dtype or torch.float32)
    return torch.cat([t.detach().reshape(-1).to(dtype or t.dtype) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors) -> None:
    """Copy consecutive slices of 1-D ``flat`` into ``tensors`` (in order; sizes must add up)."""
    tensors = list(tensors)
    need = sum(t.numel() for t in tensors)
    if flat.dim() != 1 or flat.numel() != need:
        raise ConfigError(f"flat tensor has {flat.numel()} elements, the tensors need {need}")
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()


def _layout(tensors) -> tuple[list[int], int]:
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += t.numel()
    return offsets, total


def check_model(module: nn.Module) -> None:
    """Raise a one-line :class:`~hpcasync.errors.ConfigError` naming the first parameter or
    floating buffer of ``module`` that is not float32, or the devices when they are on more
    than one. The flat tensors are float32 and on one device: building them over a float64,
    float16 or bfloat16 model would train it in float32 and leave it float32 (torch, Horovod and
    DDP train it in its own dtype), and over a model split across devices would move every
    tensor to the first one's."""
    named = [(n, t) for n, t in module.named_parameters()]
    named += [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
    for name, t in named:
        if t.dtype != torch.float32:
            what = "parameter" if isinstance(t, nn.Parameter) else "buffer"
            raise ConfigError(
                f"{what} {name} is {str(t.dtype)[6:]}: hpcasync's optimizers train float32 "
                "parameters (one flat float32 buffer), and would silently train and leave this "
                "model float32; keep it float32 (model.float()) and use torch.autocast for "
                "bfloat16/float16 compute, or for another dtype use hpcasync.horovod's "
                "DistributedOptimizer (SSGD in each parameter's dtype)")
    devices = list(dict.fromkeys(str(t.device) for _, t in named))
    if len(devices) > 1:
        first = {str(t.device): n for n, t in reversed(named)}
        raise ConfigError(
            f"the model's parameters and buffers are on {len(devices)} devices ("
            + ", ".join(f"{d}: {first[d]}" for d in devices) + "): hpcasync's optimizers keep "
            "them in one flat buffer on one device; move the whole model to one device (one "
            "rank per GPU), or use hpcasync.horovod's DistributedOptimizer (per-tensor on "
            "several devices)")


class FlatModel:
    """Flat float32 views of a module's parameters, gradients and floating buffers.

    Args:
        module: the model (its parameters are re-bound in place; keep using the module as before).
        device: where the flat tensors live (default: the device of the first parameter, else CPU).

    Attributes: ``params``, ``grads``, ``buffers`` (1-D float32), ``names`` / ``shapes`` /
    ``offsets`` (parameter layout), ``buffer_names``, ``int_buffers`` (names of integer buffers,
    not flattened), ``numel``, ``nbytes``.
    """

    def __init__(self, module: nn.Module, device: torch.device | str | None = None):
        check_model(module)
        named = list(module.named_parameters())
        if device is None:
            device = named[0][1].device if named else torch.device("cpu")
        self.module = module
        self.device = torch.device(device)
        self.names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.shapes = [tuple(p.shape) for p in self._params]
        self.offsets, self.numel = _layout(self._params)
        self.params = flatten(self._params, dtype=torch.float32).to(self.device)
        with torch.no_grad():
            for p, view in zip(self._params, self._slices(self.params)):
                p.data = view

        float_bufs, int_bufs = [], []
        for name, buf in module.named_buffers():
            (float_bufs if buf.is_floating_point() else int_bufs).append((name, buf))
        self.int_buffers = [n for n, _ in int_bufs]
        for name, buf in int_bufs:                      # not flattened, but on the same device
            if buf.device != self.device:
                owner, attr = _owner(module, name)
                owner._buffers[attr] = buf.to(self.device)
        self.buffer_names = [n for n, _ in float_bufs]
        self._buffer_offsets, self.buffer_numel = _layout([b for _, b in float_bufs])
        self.buffers = flatten([b for _, b in float_bufs], dtype=torch.float32).to(self.device)
        # the gradient storage has a tail the size of the buffers, [grads | buffer copy], so a
        # synchronous step averages both in one message (``grads_and_buffers``) copying only the
        # buffers. (The module's buffers cannot live in that storage: autograd saves BatchNorm's
        # running statistics and checks the version counter, which views of one storage share.)
        # Its head, ``presence`` (one float per parameter), travels in front of the gradients:
        # [presence | grads | buffer copy], so SSGD's last bucket tells every rank which
        # parameters got a gradient on some rank, in the message it sends anyway.
        n = len(self._params)
        self._wire = torch.zeros(n + self.numel + self.buffer_numel, dtype=torch.float32,
                                 device=self.device)
        self.presence = self._wire[:n]
        self.presence_and_grads = self._wire[:n + self.numel]
        self.grads_and_buffers = self._wire[n:]
        self.grads = self.grads_and_buffers[:self.numel]
        self.buffer_wire = self.grads_and_buffers[self.numel:]
        # each parameter's gradient view, made once (the storage is fixed): re-binding every
        # step then costs an identity check per tensor, not a new view
        self._grad_views = self._slices(self.grads)
        self._buffer_slots = []
        for (name, buf), off in zip(float_bufs, self._buffer_offsets):
            owner, attr = _owner(module, name)
            owner._buffers[attr] = self.buffers[off: off + buf.numel()].view(buf.shape)
            self._buffer_slots.append((name, owner, attr, owner._buffers[attr].data_ptr()))
        for storage in (self.params, self._wire, self.buffers):   # fixed for the whole run:
            persistent.register(storage)       # persistent allreduces may bind to their spans
        # where each parameter's data must stay (``unbound``: one pointer compare per tensor)
        self._param_ptrs = [p.data_ptr() for p in self._params]
        self.rebind_grads()

    # -- layout ---------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of one flat parameter vector."""
        return self.params.numel() * self.params.element_size()

    def _slices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o: o + p.numel()].view(s)
                for o, p, s in zip(self.offsets, self._params, self.shapes)]

    def views(self, which: str = "params") -> list[tuple[str, torch.Tensor]]:
        """``(name, view)`` per parameter of ``params`` or ``grads``, or per floating buffer."""
        if which == "params":
            return list(zip(self.names, self._slices(self.params)))
        if which == "grads":
            return list(zip(self.names, self._grad_views))
        if which == "buffers":
            return [(n, self.buffers[o: o + t.numel()].view(t.shape)) for n, o, t in
                    zip(self.buffer_names, self._buffer_offsets, self._buffer_tensors())]
        raise ConfigError(f"views() takes params, grads or buffers, got {which!r}")

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The module's parameters in flat order (shared ones once): ``parameters[k]`` lives at
        ``offsets[k]``."""
        return list(self._params)

    def per_element(self, values, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A flat tensor (``numel`` long, on ``device``) holding ``values[k]`` at every element of
        parameter ``k``: e.g. a per-parameter learning rate or trainable flag as a per-element
        vector over θ."""
        values = list(values)
        if len(values) != len(self._params):
            raise ConfigError(f"per_element needs one value per parameter ({len(self._params)}), "
                              f"got {len(values)}")
        sizes = torch.tensor([p.numel() for p in self._params])
        return torch.repeat_interleave(torch.as_tensor(values, dtype=dtype), sizes).to(self.device)

    def _buffer_tensors(self) -> list[torch.Tensor]:
        return [dict(self.module.named_buffers())[n] for n in self.buffer_names]

    # -- state ----------------------------------------------------------------------------------
    def load_flat(self, tensor: torch.Tensor) -> None:
        """Copy a flat parameter vector into ``params`` (and so into the module)."""
        if tensor.dim() != 1 or tensor.numel() != self.numel:
            raise ConfigError(f"flat parameter vector has {tensor.numel()} elements "
                              f"(shape {tuple(tensor.shape)}), the model has {self.numel}")
        self.params.copy_(tensor)

    def zero_grad(self) -> None:
        """Zero all gradients, keeping them views of ``grads``."""
        self.rebind_grads()
        self.grads.zero_()

    def rebind_grads(self) -> None:
        """Make every ``p.grad`` a view of ``grads`` again, keeping any gradient already there."""
        for p, view in zip(self._params, self._grad_views):
            g = p.grad
            if g is view:
                continue
            if g is not None and g.data_ptr() != view.data_ptr():
                view.copy_(g)
            p.grad = view

    def collect_grads(self) -> int:
        """Make ``grads`` hold this backward's gradients, whatever zeroed them.

        ``zero_grad(set_to_none=True)`` (torch's default, on the module or on any optimizer) drops
        the views: the next backward then writes fresh ``p.grad`` tensors. Each such gradient is
        copied into its slot and ``p.grad`` becomes the view again; a parameter whose ``p.grad`` is
        ``None`` (no gradient this step) gets a zero slot. Returns how many parameters needed it
        (0 when every ``p.grad`` is still a view: then this costs one pointer check per tensor).
        """
        repaired = 0
        for p, view in zip(self._params, self._grad_views):
            g = p.grad
            if g is view or (g is not None and g.data_ptr() == view.data_ptr()):
                continue
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
            p.grad = view
            repaired += 1
        return repaired

    def unbound(self) -> str | None:
        """The name of the first parameter or floating buffer whose data is no longer its view of
        the flat tensors (``module.to(...)``/``.cuda()``/``.half()``/``.double()``/channels_last
        after the FlatModel was built re-binds ``p.data`` elsewhere), else None. One pointer
        compare per tensor: cheap enough for every step."""
        for name, p, ptr in zip(self.names, self._params, self._param_ptrs):
            if p.data_ptr() != ptr and p.numel():
                return name
        for name, owner, attr, ptr in self._buffer_slots:
            buf = owner._buffers.get(attr)
            if buf is None or (buf.data_ptr() != ptr and buf.numel()):
                return name
        return None

    def check(self) -> list[str]:
        """Names of parameters, grads or buffers that are no longer views of the flat tensors."""
        bad = []
        for name, p, pv, gv in zip(self.names, self._params, self._slices(self.params),
                                   self._grad_views):
            if p.data_ptr() != pv.data_ptr():
                bad.append(name)
            elif p.grad is None or p.grad.data_ptr() != gv.data_ptr():
                bad.append(f"{name}.grad")
        for (name, view), buf in zip(self.views("buffers"), self._buffer_tensors()):
            if buf.data_ptr() != view.data_ptr():
                bad.append(name)
        return bad


def _owner(module: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, attr = dotted.split(".")
    for part in path:
        module = getattr(module, part)
    return module, attr
