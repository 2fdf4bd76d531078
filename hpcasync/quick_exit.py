"""A process's exit without the collector's walks over torch's objects.

After ``import torch`` and ``torch._dynamo`` (which every ``torch.optim`` step imports), Python's
own teardown spends about 0.9 s of CPU per process (measured here: 3.51 s for ``import torch,
torch._dynamo`` with the normal exit, 2.61 s with this hook; one core of a 2-core VM), nearly all
in the cyclic garbage collections that finalization runs over the 280,000 objects those modules
made: on every rank of every job, after the last line, for nothing. ``hpcasync.cli`` already ends
with ``os._exit`` (:func:`hpcasync.cli.run_and_exit`); your own script, which ends as Python ends
it, gets this instead, from ``import hpcasync``:

* an ``atexit`` handler registered at that import, so it runs after every handler registered
  later (hpcasync's own finishing hooks, yours) and before those registered earlier (``logging``'s
  shutdown);
* it collects the garbage there is (``gc.collect()``: unreachable cycles are finalized as they
  would have been), flushes every open file object still alive, then ``gc.freeze()``: the
  objects alive now move to the collector's permanent generation, which finalization's
  collections skip. Modules are still torn down and objects still deallocated by reference count
  (their ``__del__`` runs); what no longer runs is ``__del__`` of objects that only become
  unreachable cycles during the teardown itself, which Python does not promise to run at exit
  ("It is not guaranteed that ``__del__()`` methods are called for objects that still exist when
  the interpreter exits", the data model's reference).

``HPCASYNC_FULL_EXIT=1`` leaves Python's exit as it is.
"""
from __future__ import annotations

import atexit
import gc
import io

_FILES = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)
_installed = False


def freeze() -> None:
    """The hook: collect, flush the open files, freeze."""
    gc.collect()
    for obj in gc.get_objects():
        # type() and a tuple, not isinstance against io.IOBase: an ABC check would call
        # __class__ on every object (a deprecated torch alias warns when asked)
        if type(obj) in _FILES:
            try:
                if not obj.closed:
                    obj.flush()
            except (OSError, ValueError):   # a detached or broken stream: nothing to keep
                pass
    gc.freeze()


def _full_exit() -> bool:
    """``HPCASYNC_FULL_EXIT`` on (a value that is no switch: off here, and one line from
    ``hpcasync.init``, which checks every variable; an import does not raise)."""
    from . import environ
    from .errors import ConfigError

    try:
        return environ.switch("HPCASYNC_FULL_EXIT", False)
    except ConfigError:
        return False


def install() -> None:
    """Register the hook once (``import hpcasync`` calls this)."""
    global _installed
    if _installed or _full_exit():
        return
    _installed = True
    atexit.register(freeze)
