"""Heavy libraries imported where they are first used, not where they are named.

Loading and validating a run config (``sagegrpo config``, and every command's refusals) imports nearly every module,
because each component owns its config section next to its code; importing torch there would cost seconds before a
one-line error. A module that uses torch throughout names it ``torch = lazy_module("torch", globals())`` instead of
``import torch``: the real import happens at the first attribute looked up, inside a function that runs (the pattern
of TensorFlow's ``LazyLoader``; diffusers and transformers defer their own submodules alike). What runs at import time
(decorators, default values, base classes) must not touch it: ``no_grad`` below is ``@torch.no_grad()`` for such a
decorator.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from typing import Any


class _LazyModule(types.ModuleType):
    """Stands for the module ``__name__`` in one module's globals until an attribute is first looked up: that imports
    the real module and puts it in the proxy's place, so later lookups cost what ``import torch`` would. A reference
    taken before then keeps working: it forwards every lookup."""

    def __init__(self, name: str, module_globals: dict[str, Any]):
        super().__init__(name)
        self._module_globals = module_globals

    def __getattr__(self, attribute: str) -> Any:  # called only for names the proxy itself does not hold
        module = importlib.import_module(self.__name__)
        for key, value in list(self._module_globals.items()):
            if value is self:
                self._module_globals[key] = module
        return getattr(module, attribute)

    def __dir__(self) -> list[str]:
        return dir(importlib.import_module(self.__name__))


def lazy_module(name: str, module_globals: dict[str, Any]) -> types.ModuleType:
    """The module ``name`` (``"torch"``, ``"torch.nn.functional"``), imported when an attribute is first looked up;
    ``module_globals``: the ``globals()`` of the module that names it, where the real module then replaces it."""
    return _LazyModule(name, module_globals)


def no_grad(function: Callable) -> Callable:
    """``@torch.no_grad()`` that imports torch when ``function`` is called, not when it is defined."""

    @functools.wraps(function)
    def without_gradients(*args, **kwargs):
        import torch

        with torch.no_grad():
            return function(*args, **kwargs)

    return without_gradients
