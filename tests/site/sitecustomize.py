"""Start-up of every Python process the test suite runs (scripts/test.sh puts this directory on
``PYTHONPATH``): ``torch._dynamo`` imported only when something besides its two eager no-ops is
asked of it.

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
``HPCASYNC_TEST_REAL_DYNAMO=1`` turns this off. Nothing outside the tests uses it; ``hpcasync``
itself never imports ``torch._dynamo`` (hpcasync/optim.py).
"""
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types

NAME = "torch._dynamo"


def _disable(fn=None, recursive=True, *, wrapping=True, reason=None):
    """``torch._dynamo.disable`` outside ``torch.compile``: ``fn`` itself."""
    return fn if fn is not None else (lambda f: f)


def _graph_break(msg=""):
    """``torch._dynamo.graph_break`` outside ``torch.compile``: nothing."""


def _real():
    """The real ``torch._dynamo``, imported now if it is not yet."""
    module = sys.modules.get(NAME)
    if module is None or isinstance(module, _Eager):
        _FINDER.real = True
        sys.modules.pop(NAME, None)
        torch = sys.modules["torch"]
        if isinstance(vars(torch).get("_dynamo"), _Eager):
            del torch._dynamo         # the real package's own import reaches it through torch
        module = importlib.import_module(NAME)
    return module


class _Eager(types.ModuleType):
    _ready = False            # set by exec_module: the import system probes __path__ before

    def __getattr__(self, name):
        if not self._ready or (name.startswith("__") and name != "__path__"):
            raise AttributeError(name)
        return getattr(_real(), name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    real = False              # the real torch._dynamo was imported: serve it

    def find_spec(self, fullname, path=None, target=None):
        if fullname == NAME and not self.real:
            return importlib.machinery.ModuleSpec(NAME, self)
        if fullname.startswith(NAME + ".") and fullname in sys.modules:
            # imported by the real package's own import, inside the __path__ access above:
            # hand that module back instead of executing it a second time
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        if spec.name != NAME:
            return sys.modules[spec.name]
        module = _Eager(NAME, "torch._dynamo's eager no-ops for the test run")
        module.disable, module.graph_break = _disable, _graph_break
        return module

    def exec_module(self, module):
        if isinstance(module, _Eager):
            module._ready = True


_FINDER = _Finder()
if os.environ.get("HPCASYNC_TEST_REAL_DYNAMO", "0") in ("", "0"):
    sys.meta_path.insert(0, _FINDER)
