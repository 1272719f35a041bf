"""Components chosen by name: a built-in from a registry, or a user's class or factory by dotted path
(``"my_pkg.rewards:SafetyReward"``), so a user's component needs no change to our code."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from core.errors import UserError


def resolve(name: str, registry: dict[str, str], kind: str) -> Callable:
    """The object ``name`` refers to: ``registry[name]`` or ``name`` itself, as ``"package.module:attribute.path"``."""
    target = registry.get(name, name)
    module_name, sep, attribute_path = target.partition(":")
    if not sep or not module_name or not attribute_path:
        raise UserError(
            f"unknown {kind} {name!r}: expected one of {', '.join(sorted(registry))} or 'package.module:Name'"
        )
    try:
        found = importlib.import_module(module_name)
        for attribute in attribute_path.split("."):
            found = getattr(found, attribute)
    except (ImportError, AttributeError) as error:
        raise UserError(f"cannot load {kind} {name!r}: {error}") from None
    return found


def check_arguments(factory: Callable, kwargs: dict[str, Any], what: str) -> None:
    """Raise ValueError (pydantic reports it under the key being validated) when ``factory`` cannot take ``kwargs``:
    a typo in a config's kwargs is caught when the config is read, not after minutes of model loading."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # nothing to check a C callable against
        return
    try:
        signature.bind(**kwargs)
    except TypeError as error:
        names = [
            name
            for name, parameter in signature.parameters.items()
            if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
        ]
        raise ValueError(f"{error} ({what} takes {', '.join(names) or 'no arguments'})") from None


def check_resolvable(name: str, registry: dict[str, str], kind: str) -> str:
    """``name`` if it resolves, else a ValueError with the one-line reason (pydantic adds the key's location)."""
    try:
        resolve(name, registry, kind)
    except UserError as error:
        raise ValueError(str(error)) from None
    return name


def check_signature_names(factory: Callable) -> set[str]:
    """The named parameters ``factory`` takes (empty when it has no inspectable signature)."""
    try:
        return set(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return set()
