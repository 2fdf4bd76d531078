"""Start-up of every Python process the test suite runs (scripts/test.sh puts this directory on
``PYTHONPATH``): parts of ``import torch`` that no test process computes with are imported only
when something is asked of them.

Which, and why each is safe:

- ``torch._dynamo`` (~1.7 CPU-s: sympy, the FX tracer, inductor's config). In eager mode
  ``torch.optim`` reaches it for two calls -- the ``torch._disable_dynamo`` wrappers of
  ``Optimizer.add_param_group``/``state_dict``/``zero_grad``/... ask ``torch._dynamo.disable(fn)``
  once per method, and every ``step`` of a torch optimizer calls ``torch._dynamo.graph_break()``.
  Outside ``torch.compile`` both are no-ops: ``disable(fn)`` runs ``fn`` with the frame evaluator
  off, and it is off; ``graph_break()`` does nothing. So ``import torch._dynamo`` gives a module
  whose ``disable`` returns ``fn`` itself and whose ``graph_break`` returns None. (The ``disable``
  answers given before stay cached on torch's methods: a process that ``torch.compile``\\ s an
  optimizer's methods would trace into them. No test compiles anything.)
- ``torch._meta_registrations``, which ``import torch`` runs last, with ``torch._decomp``,
  ``torch._refs`` and ``torch._prims``: Python kernels for the ``Meta`` dispatch key only --
  shapes without data, for ``device="meta"`` tensors and the fake tensors of ``torch.compile``
  and ``torch.export`` -- never a kernel that computes on the CPU or a GPU. An op on a ``meta``
  tensor without a C++ meta kernel fails loudly before the real import ("no fake impl or Meta
  kernel"); no test uses the ``meta`` device. One thing of ``torch._prims`` is not about meta
  kernels: its ``rng_prims`` sets ``torch.Generator``'s metaclass (``torch.Generator()`` fails
  without it), and that one call is made here.
- ``torch.export`` (its ``torch._export`` and their tracing helpers): bound as ``torch.export``
  by ``import torch``, used by ``torch.export.export``/``torch.compile`` only.
- ``torch._higher_order_ops``, ``torch.func`` and ``torch.compiler`` (~0.35 CPU-s with the FX
  proxy tensors, fake tensors and functorch transforms they import): ``import torch`` binds
  ``torch.cond``, ``torch.while_loop`` and ``torch.vmap`` from the first two (here: functions
  that call the real ones, imported at the first call), and torch's eager code asks the third
  only ``is_compiling()``/``is_dynamo_compiling()``/``is_exporting()``, False outside
  ``torch.compile`` (here: False without the import). ``torch.compiler`` imports a submodule of
  the first at ``import torch``, so it is deferred with them. While ``import torch`` runs, the
  two packages answer no ``__path__``: its ``from torch.func import vmap`` would otherwise probe
  it, which imports the real package there and then. A real import makes ``torch.func``'s first
  (torch's order: it imports ``torch.fx.passes``, which ``proxy_tensor`` needs before it), and a
  ``proxy_tensor`` imported before ``torch.fx.passes`` (DTensor's, under ``torch.testing``) gets
  ``torch.fx.passes`` imported first. (As with ``disable``: a function bound from these
  stand-ins before the real import keeps answering False under ``torch.compile``; no test
  compiles anything but a lambda.)

Each of them becomes the real module, imported there and then, at the first name asked of it (a
submodule's import included); the real ``torch._dynamo`` brings the real meta kernels and
``torch.export`` first. One function is replaced, not deferred: ``torch._library.utils.
get_source`` (:func:`_get_source`, the same string). ``HPCASYNC_TEST_REAL_TORCH=1`` turns all of
it off. Nothing outside the tests uses this; ``hpcasync`` itself never imports
``torch._dynamo`` (hpcasync/optim.py).
"""
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types

NAME = "torch._dynamo"
META = "torch._meta_registrations"
EXPORT = "torch.export"
HOPS = "torch._higher_order_ops"
FUNC = "torch.func"
COMPILER = "torch.compiler"
DEFERRED = (NAME, META, EXPORT, HOPS, FUNC, COMPILER)
#: what ``import torch`` binds from the deferred packages: stand-ins that import at the first call
CALLS = {HOPS: ("cond", "while_loop"), FUNC: ("vmap",)}
#: the module whose ``get_source`` is :func:`_get_source`
PATCHED = "torch._library.utils"
#: ``import torch``'s real ``torch.func`` imports ``torch.fx.passes``, which imports
#: ``proxy_tensor``; a module that imports ``proxy_tensor`` first (DTensor's, which
#: ``torch.testing`` imports) meets a circular import (``proxy_tensor`` -> ``torch.fx.passes``
#: -> ``proxy_tensor``), so ``torch.fx.passes`` is imported before it, as torch's order does
FX_PASSES, PROXY = "torch.fx.passes", "torch.fx.experimental.proxy_tensor"
#: the real imports made first, in torch's own order (``torch.func`` imports ``torch.fx.passes``,
#: which ``torch._higher_order_ops``'s ``proxy_tensor`` needs imported before it: else a circular
#: import)
BEFORE = {HOPS: (FUNC,), COMPILER: (HOPS,)}
#: torch.compiler's questions in eager code, all False outside torch.compile
NOT_COMPILING = ("is_compiling", "is_dynamo_compiling", "is_exporting")


def _disable(fn=None, recursive=True, *, wrapping=True, reason=None):
    """``torch._dynamo.disable`` outside ``torch.compile``: ``fn`` itself."""
    return fn if fn is not None else (lambda f: f)


def _graph_break(msg=""):
    """``torch._dynamo.graph_break`` outside ``torch.compile``: nothing."""


def _not_compiling():
    """``torch.compiler.is_compiling()`` (and its two kin) outside ``torch.compile``: False."""
    return False


def _call(module, name):
    """``module.name`` (a function), the real module imported at the first call."""
    def call(*args, **kwargs):
        return getattr(_real(module), name)(*args, **kwargs)
    call.__name__ = call.__qualname__ = name
    return call


def _torch_initializing() -> bool:
    """``import torch`` is still running (the import system's mark on its spec)."""
    spec = getattr(sys.modules.get("torch"), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _real(name):
    """The real module ``name`` (one of :data:`DEFERRED`), imported now if it is not yet; the
    real ``torch._dynamo`` brings the real meta kernels and ``torch.export`` first, the others
    what :data:`BEFORE` names."""
    module = sys.modules.get(name)
    if module is None or isinstance(module, _Deferred):
        if name == NAME:
            _real(META)
            _real(EXPORT)
        for first in BEFORE.get(name, ()):
            _real(first)
        _FINDER.real.add(name)
        sys.modules.pop(name, None)
        torch = sys.modules["torch"]
        attr = name.rpartition(".")[2]
        if isinstance(vars(torch).get(attr), _Deferred):
            delattr(torch, attr)      # the real package's own import reaches it through torch
        module = importlib.import_module(name)
    return module


class _Deferred(types.ModuleType):
    """A deferred module: any name asked of it (``__path__`` too: a submodule's import) is the
    real module's, imported then; other dunders are its own (the import system's probes)."""
    _ready = False            # set by exec_module: the import system probes __path__ before

    def __getattr__(self, name):
        if not self._ready or (name.startswith("__") and name != "__path__"):
            raise AttributeError(name)
        if name == "__path__" and self.__name__ in CALLS and _torch_initializing():
            raise AttributeError(name)      # torch's own `from X import f`: f is a stand-in
        return getattr(_real(self.__name__), name)


def _get_source(stacklevel: int) -> str:
    """``torch._library.utils.get_source``: its caller's ``"file:line"`` from the frame itself.
    torch's reads it with ``inspect.getframeinfo``, which also reads the caller's source line,
    and its first call maps every loaded module to its file (``inspect.getmodule``): ~0.17 CPU-s
    in ``import torch``, for the same two fields."""
    frame = sys._getframe(stacklevel)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class _Patched(importlib.abc.Loader):
    """The loader of :data:`PATCHED`: the module as torch's, then :func:`_get_source` in it."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        module.get_source = _get_source


class _AfterPasses(importlib.abc.Loader):
    """The loader of ``proxy_tensor`` imported before ``torch.fx.passes`` (:data:`FX_PASSES`):
    it imports ``torch.fx.passes`` first, whose import imports ``proxy_tensor`` itself (torch's
    order), and gives that module, its spec its own."""

    def create_module(self, spec):
        importlib.import_module(FX_PASSES)
        module = sys.modules[spec.name]
        self.spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self.real = set()     # the modules whose real import was made: served by it

    def find_spec(self, fullname, path=None, target=None):
        if fullname == PATCHED:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _Patched(spec.loader)
            return spec
        if fullname == PROXY and FX_PASSES not in sys.modules:
            return importlib.machinery.ModuleSpec(fullname, _AfterPasses())
        if fullname in DEFERRED and fullname not in self.real:
            return importlib.machinery.ModuleSpec(fullname, self)
        if fullname.rpartition(".")[0] in DEFERRED and fullname in sys.modules:
            # imported by the real package's own import, inside the __path__ access above:
            # hand that module back instead of executing it a second time
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        if spec.name not in DEFERRED:
            return sys.modules[spec.name]
        module = _Deferred(spec.name, f"{spec.name}, imported when a name is asked of it")
        if spec.name == NAME:
            module.disable, module.graph_break = _disable, _graph_break
        for name in CALLS.get(spec.name, ()):
            setattr(module, name, _call(spec.name, name))
        if spec.name == COMPILER:
            for name in NOT_COMPILING:
                setattr(module, name, _not_compiling)
        return module

    def exec_module(self, module):
        if isinstance(module, _Deferred):
            module._ready = True
            if module.__name__ == META:     # torch._prims.rng_prims's one call outside meta
                import torch
                from torch._opaque_base import OpaqueBaseMeta
                torch._C._set_generator_metaclass(OpaqueBaseMeta)


_FINDER = _Finder()
if os.environ.get("HPCASYNC_TEST_REAL_TORCH", "0") in ("", "0"):
    sys.meta_path.insert(0, _FINDER)
