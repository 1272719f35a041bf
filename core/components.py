"""Components chosen by name: a built-in from a registry, or a user's class or factory by dotted path
(``"my_pkg.rewards:SafetyReward"``), so a user's component needs no change to our code."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from sage_grpo.core.errors import UserError


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


def check_arguments(
    factory: Callable, kwargs: dict[str, Any], what: str, *, supplied: dict[str, Any] | None = None
) -> None:
    """Raise ValueError (pydantic reports it under the key being validated) when ``factory`` cannot take ``kwargs``
    (with ``supplied``, the arguments the caller adds itself): a typo in a config's kwargs, or a value that cannot be
    of its parameter's annotated type, is caught when the config is read, not after minutes of model loading."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # nothing to check a C callable against
        return
    try:
        signature.bind(**(supplied or {}), **kwargs)
    except TypeError as error:
        names = [
            name
            for name, parameter in signature.parameters.items()
            if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
        ]
        raise ValueError(f"{error} ({what} takes {', '.join(names) or 'no arguments'})") from None
    problem = _type_problem(factory, kwargs)
    if problem:
        raise ValueError(f"{problem} ({what})")


def _type_problem(factory: Callable, kwargs: dict[str, Any]) -> str | None:
    """Why a value of ``kwargs`` cannot be its parameter's annotated type, by pydantic's lax rules (1 is a float,
    "0.5" is too; "abc" and [1] are not); None when each can, or cannot be checked. Only the user's values: what the
    caller supplies (a dtype name it converts) is its own affair."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # nothing to check a C callable against
        return None
    for name, value in kwargs.items():
        parameter = parameters.get(name)
        if parameter is None or parameter.annotation is parameter.empty:
            continue
        try:
            annotation = _evaluated(parameter.annotation, factory)
            adapter = TypeAdapter(annotation, config=ConfigDict(arbitrary_types_allowed=True))
        except Exception:  # a name imported for type checking only, or a type pydantic cannot check against
            continue
        try:
            adapter.validate_python(value)
        except ValidationError as error:
            message = error.errors()[0]["msg"]
            return f"{name}: {message}, got a {type(value).__name__}"
    return None


def _evaluated(annotation: Any, factory: Callable) -> Any:
    """A postponed (string) annotation evaluated where it was written, as ``inspect.signature(eval_str=True)`` does,
    but alone: evaluating all of a signature's annotations would import what the others name (``torch.dtype``, where
    torch is imported on first use: ``core.lazy``)."""
    if not isinstance(annotation, str):
        return annotation
    function = factory.__init__ if inspect.isclass(factory) else factory
    return eval(annotation, getattr(inspect.unwrap(function), "__globals__", {}))


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
