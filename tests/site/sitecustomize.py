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

Each of them becomes the real module, imported there and then, at the first name asked of it (a
submodule's import included); the real ``torch._dynamo`` brings the real other two first.
``HPCASYNC_TEST_REAL_TORCH=1`` turns all of it off. Nothing outside the tests uses this;
``hpcasync`` itself never imports ``torch._dynamo`` (hpcasync/optim.py).
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
DEFERRED = (NAME, META, EXPORT)


def _disable(fn=None, recursive=True, *, wrapping=True, reason=None):
    """``torch._dynamo.disable`` outside ``torch.compile``: ``fn`` itself."""
    return fn if fn is not None else (lambda f: f)


def _graph_break(msg=""):
    """``torch._dynamo.graph_break`` outside ``torch.compile``: nothing."""


def _real(name):
    """The real module ``name`` (one of :data:`DEFERRED`), imported now if it is not yet; the
    real ``torch._dynamo`` brings the real meta kernels and ``torch.export`` first."""
    module = sys.modules.get(name)
    if module is None or isinstance(module, _Deferred):
        if name == NAME:
            _real(META)
            _real(EXPORT)
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
        return getattr(_real(self.__name__), name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self.real = set()     # the modules whose real import was made: served by it

    def find_spec(self, fullname, path=None, target=None):
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
