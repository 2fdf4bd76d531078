"""Start-up of every Python process the test suite runs (scripts/test.sh puts this directory on
``PYTHONPATH``): ``torch._dynamo`` imported only when something besides its two eager no-ops is
asked of it, ``torch._meta_registrations`` only when asked for.

Why: in eager mode ``torch.optim`` reaches ``torch._dynamo`` for two calls -- the
``torch._disable_dynamo`` wrappers of ``Optimizer.add_param_group``/``state_dict``/``zero_grad``/...
ask ``torch._dynamo.disable(fn)`` once per method, and every ``step`` of a torch optimizer calls
``torch._dynamo.graph_break()`` -- and importing it costs ~1.7 CPU-s (sympy, the FX tracer,
inductor's config) in each of the processes the suite starts that build or step a torch optimizer
(SSGD, DASO, your own loop, Horovod, DDP), well over a thousand on a 2-core CI machine.

Outside ``torch.compile`` both calls are no-ops: ``disable(fn)`` runs ``fn`` with the frame
evaluator off, and it is off; ``graph_break()`` does nothing. So ``import torch._dynamo`` gives a
module whose ``disable`` returns ``fn`` itself and whose ``graph_break`` returns None; any other name
asked of it (DDP's ``torch._dynamo.utils``, a submodule's import, ``__path__``) imports the real
``torch._dynamo`` there and then and answers from it, and from then on ``torch._dynamo`` is the real
module. (The ``disable`` answers given before stay cached on torch's methods: a process that
``torch.compile``\\ s an optimizer's methods would trace into them. No test compiles anything.)
Likewise ``torch._meta_registrations``, which ``import torch`` runs last (with the
``torch._decomp`` and ``torch._refs`` it imports, ~0.45 CPU-s; ``torch._prims`` is still imported,
as its ``rng_prims`` sets ``torch.Generator`` up): it registers Python kernels
for the ``Meta`` dispatch key only -- shapes without data, for ``device="meta"`` tensors,
``torch.compile``'s and ``torch.export``'s fake tensors -- never a kernel that computes on the CPU
or a GPU. The test run's is an empty module that imports the real one when a name is asked of it
or when the real ``torch._dynamo`` is imported; an op on a ``meta`` tensor without a C++ meta
kernel fails loudly before that ("no fake impl or Meta kernel"). No test uses the ``meta`` device.

``HPCASYNC_TEST_REAL_TORCH=1`` turns both off. Nothing outside the tests uses this; ``hpcasync``
itself never imports ``torch._dynamo`` (hpcasync/optim.py).
"""
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types

NAME = "torch._dynamo"
META = "torch._meta_registrations"


def _disable(fn=None, recursive=True, *, wrapping=True, reason=None):
    """``torch._dynamo.disable`` outside ``torch.compile``: ``fn`` itself."""
    return fn if fn is not None else (lambda f: f)


def _graph_break(msg=""):
    """``torch._dynamo.graph_break`` outside ``torch.compile``: nothing."""


def _real(name=NAME):
    """The real ``torch._dynamo`` (or ``torch._meta_registrations``), imported now if it is not
    yet; the real ``torch._dynamo`` brings the real meta kernels first (its fake tensors)."""
    module = sys.modules.get(name)
    if module is None or isinstance(module, (_Eager, _Deferred)):
        if name == NAME:
            _real(META)
        _FINDER.real.add(name)
        sys.modules.pop(name, None)
        torch = sys.modules["torch"]
        attr = name.rpartition(".")[2]
        if isinstance(vars(torch).get(attr), (_Eager, _Deferred)):
            delattr(torch, attr)      # the real package's own import reaches it through torch
        module = importlib.import_module(name)
    return module


class _Eager(types.ModuleType):
    _ready = False            # set by exec_module: the import system probes __path__ before

    def __getattr__(self, name):
        if not self._ready or (name.startswith("__") and name != "__path__"):
            raise AttributeError(name)
        return getattr(_real(), name)


class _Deferred(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_real(META), name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self.real = set()     # the modules whose real import was made: served by it

    def find_spec(self, fullname, path=None, target=None):
        if fullname in (NAME, META) and fullname not in self.real:
            return importlib.machinery.ModuleSpec(fullname, self)
        if fullname.startswith(NAME + ".") and fullname in sys.modules:
            # imported by the real package's own import, inside the __path__ access above:
            # hand that module back instead of executing it a second time
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        if spec.name == META:
            return _Deferred(META, "torch._meta_registrations, imported when asked for")
        if spec.name != NAME:
            return sys.modules[spec.name]
        module = _Eager(NAME, "torch._dynamo's eager no-ops for the test run")
        module.disable, module.graph_break = _disable, _graph_break
        return module

    def exec_module(self, module):
        if isinstance(module, _Eager):
            module._ready = True
        elif isinstance(module, _Deferred):
            importlib.import_module("torch._prims")     # (its rng_prims sets torch.Generator up)


_FINDER = _Finder()
if os.environ.get("HPCASYNC_TEST_REAL_TORCH", "0") in ("", "0"):
    sys.meta_path.insert(0, _FINDER)
