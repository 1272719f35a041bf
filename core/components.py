"""Components chosen by name: a built-in from a registry, or a user's class or factory by dotted path
(``"my_pkg.rewards:SafetyReward"``), so a user's component needs no change to our code."""

from __future__ import annotations

import importlib
from typing import Callable

from core.errors import UserError


def resolve(name: str, registry: dict[str, str], kind: str) -> Callable:
    """The object ``name`` refers to: ``registry[name]`` or ``name`` itself, as ``"package.module:attribute.path"``."""
    target = registry.get(name, name)
    module_name, sep, attribute_path = target.partition(":")
    if not sep or not module_name or not attribute_path:
        raise UserError(f"unknown {kind} {name!r}: expected one of {', '.join(sorted(registry))} "
                        "or 'package.module:Name'")
    try:
        found = importlib.import_module(module_name)
        for attribute in attribute_path.split("."):
            found = getattr(found, attribute)
    except (ImportError, AttributeError) as error:
        raise UserError(f"cannot load {kind} {name!r}: {error}") from None
    return found
