"""YAML + ``key.sub=value`` overrides into a pydantic model, with one-line errors that name the key."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from core.errors import UserError

Model = TypeVar("Model", bound=BaseModel)


def parse_override(text: str) -> tuple[list[str], object]:
    """``a.b=1`` -> (["a", "b"], 1). The value is parsed as YAML, so numbers, booleans and lists keep their type."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(f"override {text!r} is not of the form key.sub=value")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UserError(f"override {text!r}: {part} is not a section")
            node = child
        node[path[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"config file {path} is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping at the top level")
    return data


def one_line(error: ValidationError) -> str:
    """The first problem pydantic found, as ``key.sub: message``."""
    first = error.errors()[0]
    key = ".".join(str(part) for part in first["loc"]) or "config"
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    extra = f" (and {len(error.errors()) - 1} more)" if len(error.errors()) > 1 else ""
    return f"{key}: {message}{extra}"


def validate(model: type[Model], data: dict, source: str = "config") -> Model:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise UserError(f"{source}: {one_line(error)}") from None


def load(model: type[Model], path: str | Path, overrides: list[str] = ()) -> Model:
    return validate(model, apply_overrides(read_yaml(path), list(overrides)), source=str(path))
