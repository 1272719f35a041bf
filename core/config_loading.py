"""YAML + ``key.sub=value`` overrides into a pydantic model, with one-line errors that name the key.

YAML anchors and aliases are allowed (they keep a config short), but not without bound: an alias names a node
without copying it, so a 1 KB file of nested aliases (an "alias bomb") loads as a small object that expands to
gigabytes when the config is saved or logged. Everything read here is refused past ``MAX_EXPANDED_SIZE``.
"""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from sage_grpo.core import secrets
from sage_grpo.core.errors import UserError

Model = TypeVar("Model", bound=BaseModel)

# Nodes plus scalar characters once every alias is expanded. Real configs are a few thousand; 10 MB of text is far
# past any of them and far below what hurts.
MAX_EXPANDED_SIZE = 10_000_000


def safe_load(text: str, source: str) -> object:
    """``yaml.safe_load`` refusing documents whose aliases expand past ``MAX_EXPANDED_SIZE`` (or refer to
    themselves), and nesting too deep to load, each as a one-line UserError."""
    try:
        data = yaml.safe_load(text)
        size = _expanded_size(data, memo={}, open_nodes=set())
    except RecursionError:
        raise UserError(f"{source}: YAML nested too deeply") from None
    except _SelfReference:
        raise UserError(f"{source}: a YAML alias refers to a node that contains it") from None
    if size > MAX_EXPANDED_SIZE:
        raise UserError(
            f"{source}: YAML aliases expand to more than {MAX_EXPANDED_SIZE:,} nodes and characters "
            "(an alias bomb?); write the values out"
        )
    return data


class _SelfReference(Exception):
    pass


def _expanded_size(node: object, memo: dict[int, int], open_nodes: set[int]) -> int:
    # Memoised by identity: an aliased node is measured once however many aliases point at it, so measuring a bomb
    # costs as little as loading it.
    if isinstance(node, dict):
        children = [*node.keys(), *node.values()]
    elif isinstance(node, list):
        children = node
    else:
        return max(1, len(node)) if isinstance(node, str) else 1
    key = id(node)
    if key in memo:
        return memo[key]
    if key in open_nodes:
        raise _SelfReference
    open_nodes.add(key)
    memo[key] = 1 + sum(_expanded_size(child, memo, open_nodes) for child in children)
    open_nodes.discard(key)
    return memo[key]


# What YAML (and a terminal) takes for a line break: str.splitlines' set.
_LINE_BREAKS = frozenset("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")


def parse_override(text: str) -> tuple[list[str], object]:
    """``a.b=1`` -> (["a", "b"], 1). The value is parsed as YAML, so numbers, booleans and lists keep their type.
    A value YAML would cut at a comment (``run.name=exp #3``) is taken literally, as the whole text after ``=``; one
    holding a line break is refused (YAML would fold it, or read further keys from it)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(f"override {text!r} is not of the form key.sub=value")
    if _LINE_BREAKS.intersection(raw):
        raise UserError(f"override {key}: the value holds a line break; give it on one line")
    try:
        value = safe_load(raw, f"override {key}") if raw else ""
        if _has_comment(raw):
            value = raw
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _has_comment(text: str) -> bool:
    """Whether a ``#`` in ``text`` starts a YAML comment (one outside every scalar), which loading would drop."""
    if "#" not in text:
        return False
    spans, seen, pending = [], set(), [yaml.compose(text, Loader=yaml.SafeLoader)]
    while pending:  # iterative and by identity: aliases share nodes, and nesting was bounded by safe_load
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            spans.append((node.start_mark.index, node.end_mark.index))
        elif isinstance(node, yaml.SequenceNode):
            pending.extend(node.value)
        else:
            pending.extend(part for pair in node.value for part in pair)
    hashes = (index for index, character in enumerate(text) if character == "#")
    return any(not any(start <= index < end for start, end in spans) for index in hashes)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set each ``key.sub=value``; a number in the path indexes a list (``rewards.0.weights.VQ=2``)."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for depth, part in enumerate(path[:-1]):
            node = _child(node, part, text, next_is_index=path[depth + 1].isdigit())
        _set(node, path[-1], value, text)
    return data


def _child(node, part: str, text: str, *, next_is_index: bool):
    if isinstance(node, list):
        return _list_item(node, part, text)
    child = node.setdefault(part, [] if next_is_index else {})
    if not isinstance(child, (dict, list)):
        raise UserError(f"override {text!r}: {part} is not a section")
    return child


def _set(node, part: str, value, text: str) -> None:
    if isinstance(node, list):
        index = _index(node, part, text, allow_append=True)
        if index == len(node):
            node.append(value)
        else:
            node[index] = value
    else:
        node[part] = value


def _list_item(node: list, part: str, text: str):
    return node[_index(node, part, text)]


def _index(node: list, part: str, text: str, *, allow_append: bool = False) -> int:
    limit = len(node) + (1 if allow_append else 0)
    if not part.isdigit() or int(part) >= limit:
        raise UserError(f"override {text!r}: {part!r} is not an index of a list of {len(node)} item(s)")
    return int(part)


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {path} does not exist")
    try:
        data = safe_load(_decoded(path), str(path)) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"config file {path} is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping at the top level")
    return data


# YAML's own encodings, told by their byte-order mark (Windows editors and PowerShell write UTF-16 with one); UTF-32's
# marks first, since UTF-16 LE's is a prefix of UTF-32 LE's.
_BYTE_ORDER_MARKS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


def _decoded(path: Path) -> str:
    """The text of a config file: UTF-8, or UTF-16/32 with a byte-order mark; anything else is a one-line
    UserError, as is a file that cannot be read."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise UserError(f"config file {path} cannot be read ({error.strerror})") from None
    codec = next((codec for mark, codec in _BYTE_ORDER_MARKS if data.startswith(mark)), "utf-8")
    encoding = codec.upper().removesuffix("-SIG")
    try:
        text = data.decode(codec)
    except UnicodeDecodeError as error:
        raise UserError(f"config file {path} is not {encoding} text (byte {error.start})") from None
    if "\0" in text:  # valid UTF-8, but no YAML: wide text without its byte-order mark
        raise UserError(f"config file {path} holds NUL bytes: UTF-16 or UTF-32 without a byte-order mark?")
    return text


def one_line(error: ValidationError) -> str:
    """The first problem pydantic found, as ``key.sub: message``."""
    first = error.errors()[0]
    # A union's member type (e.g. "dict[str,float]") is pydantic's bookkeeping, not a key the user wrote.
    key = ".".join(str(part) for part in first["loc"] if "[" not in str(part)) or "config"
    message = first["msg"].removeprefix("Value error, ")  # our validators' messages are complete sentences
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    extra = f" (and {len(error.errors()) - 1} more)" if len(error.errors()) > 1 else ""
    return f"{key}: {message}{extra}"


def validate(model: type[Model], data: dict, source: str = "config") -> Model:
    secrets.remember(data)  # before validating: a refused config's message may quote a secret too
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise UserError(f"{source}: {one_line(error)}") from None


def load(model: type[Model], path: str | Path, overrides: list[str] = ()) -> Model:
    return validate(model, apply_overrides(read_yaml(path), list(overrides)), source=str(path))
