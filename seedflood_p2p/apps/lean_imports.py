"""Libraries the daemons import but never use, deferred to keep each daemon's memory down.

transformers (loss/loss_for_object_detection.py: `from scipy.optimize import
linear_sum_assignment`, reached from every model class through modeling_utils) and hivemind
(averaging/load_balancing.py: `import scipy.optimize`, from `hivemind/__init__.py`) import
scipy.optimize at module level; a peer or bootstrap node never calls either function, and
loading it costs about 37 MiB of RSS per daemon (321 modules; bench/bench_daemon_rss.py).
`defer_scipy_optimize` puts a stand-in in sys.modules: those two names are functions that
import the real module on their first call, and any other name (not a dunder) imports it
at once, so every use still gets scipy's own code.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__all__ = ["defer_scipy_optimize"]

_MODULE = "scipy.optimize"
_DEFERRED = ("linear_sum_assignment", "linprog")  # the names transformers and hivemind take


def _real() -> types.ModuleType:
    if isinstance(sys.modules.get(_MODULE), _DeferredModule):
        del sys.modules[_MODULE]
    return importlib.import_module(_MODULE)


def _forward(name: str):
    def call(*args, **kwargs):
        return getattr(_real(), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


class _DeferredModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name in _DEFERRED:
            return _forward(name)
        if name.startswith("__"):  # e.g. __file__, which inspect.getmodule reads of every module
            raise AttributeError(name)
        return getattr(_real(), name)


def defer_scipy_optimize() -> None:
    """Stand in for scipy.optimize until it is used (nothing to do once it is loaded)."""
    if _MODULE in sys.modules:
        return
    try:  # imports the scipy package (about 1 MiB), not scipy.optimize
        spec = importlib.util.find_spec(_MODULE)
    except ImportError:
        return
    if spec is None:
        return
    stub = _DeferredModule(_MODULE)
    stub.__spec__ = spec
    stub.__path__ = list(spec.submodule_search_locations or ())  # its submodules still import
    sys.modules[_MODULE] = stub
