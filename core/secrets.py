"""Secrets: which config keys hold them, how to keep them out of text, and how to read one.

One rule for every place a value leaves the process (MLflow params, the saved config, export records, the run
summary, one-line errors, logs and tracebacks):

- a value under a key named like a credential (:data:`SECRET_KEY`) is shown as ``***`` wherever the structure is
  known (:func:`mask_tree`, :func:`mask_value`);
- in any text (:func:`mask_uri`): the user-info of a URI of any scheme (``scheme://user:pass@host``, also once path
  handling has collapsed ``//`` to ``/``, and up to the last ``@`` of the authority, since passwords hold ``@``),
  signed-URL query values, ``Bearer``/``Basic`` credentials, and every secret the process has read (from a config
  through :func:`remember`, or from :func:`read_secret`), wherever it ends up in a message.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import traceback
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from sage_grpo.core.errors import UserError

MASK = "***"

# A config key (dotted path) that names a secret. ``sig`` only as a whole word: "signal", "sigma" are not secrets.
SECRET_KEY = re.compile(
    r"secret|passw|pwd|token|key|credential|auth|bearer|cookie|session|signature|private|jwt|(?<![a-z])sig(?![a-z])",
    re.IGNORECASE,
)
# The scheme with its slashes (one is enough: Path("http://u:p@h/x") prints as http:/u:p@h/x), then the user-info
# up to the last "@", since passwords hold "@". A "user:password" may hold "/" too (AWS secret keys do), so after a
# colon the match runs to the last "@" of the word; a port and path before an "@" are masked with it, harmlessly.
_URI_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.\-]*:/+)(?:[^\s/?#\"'<>:]*:[^\s\"'<>]*|[^\s/?#\"'<>]*)@", re.IGNORECASE)
# A query parameter of a signed or token-carrying URL: X-Amz-Signature, X-Amz-Credential, X-Amz-Security-Token,
# X-Goog-Signature, Azure's sig, ?token=, ?api_key=, ...
_SECRET_QUERY = re.compile(
    r"(?<=[?&;])([^=&#\s]*(?:sig|token|credential|secret|passw|key|auth)[^=&#\s]*=)[^&#\s]*", re.IGNORECASE
)
_BEARER = re.compile(r"(\b(?:bearer|basic) )[^\s\"',]+", re.IGNORECASE)
# Secrets read so far are masked wherever they appear as text. Shorter ones are left to the rules above: masking
# every "1234" in every log line would hide more than it protects.
MIN_REMEMBERED_LENGTH = 6
_remembered: set[str] = set()


def is_secret_key(key: str) -> bool:
    return bool(SECRET_KEY.search(key))


def mask_uri(text: str) -> str:
    """``text`` with every credential it holds replaced by ``***``: URI user-info, signed-URL query values,
    ``Bearer``/``Basic`` credentials and any secret read so far. The rest (host, path, other parameters) stays
    readable."""
    text = _URI_USERINFO.sub(lambda match: match.group(1) + MASK + "@", text)
    text = _SECRET_QUERY.sub(lambda match: match.group(1) + MASK, text)
    text = _BEARER.sub(lambda match: match.group(1) + MASK, text)
    for secret in sorted(_remembered, key=len, reverse=True):  # a longer secret may contain a shorter one
        text = text.replace(secret, MASK)
    return text


def mask_value(key: str, text: str) -> str:
    """``text``, the value of the dotted config key ``key``, as it may be shown."""
    if is_secret_key(key) and text not in ("", "null"):
        return MASK  # an unset secret stays visible as unset
    return mask_uri(text)


def mask_tree(node: Any, prefix: str = "") -> Any:
    """A config (nested mappings and lists, as loaded from YAML or dumped as JSON) with :func:`mask_value` applied to
    every leaf; ``prefix`` is the dotted key of ``node`` itself."""
    if isinstance(node, Mapping):
        return {key: mask_tree(child, f"{prefix}{key}.") for key, child in node.items()}
    if isinstance(node, (list, tuple)):
        return [mask_tree(child, f"{prefix}{i}.") for i, child in enumerate(node)]
    if node is None or isinstance(node, (bool, int, float)):
        return MASK if is_secret_key(prefix.rstrip(".")) and node is not None else node
    return mask_value(prefix.rstrip("."), str(node))


def masked_config(config: BaseModel | Mapping[str, Any]) -> dict[str, Any]:
    """The resolved config, nested as in YAML, masked as :func:`mask_tree` does (and so as the MLflow params): safe
    to save as an artifact or print."""
    data = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
    return mask_tree(data)


def remember(node: Any, prefix: str = "") -> None:
    """Note every secret in a config (values under secret keys, and the user-info of URIs in any value), so that
    :func:`mask_uri` masks it in any text: a message that quotes it, a path built from it, a library's traceback."""
    if isinstance(node, Mapping):
        for key, child in node.items():
            remember(child, f"{prefix}{key}.")
    elif isinstance(node, (list, tuple)):
        for i, child in enumerate(node):
            remember(child, f"{prefix}{i}.")
    elif node is not None:
        text = str(node)
        if is_secret_key(prefix.rstrip(".")):
            _remember_text(text)
        for match in _URI_USERINFO.finditer(text):
            userinfo = match.group(0)[len(match.group(1)) : -1]
            _remember_text(userinfo)
            _remember_text(userinfo.partition(":")[2])


def _remember_text(text: str) -> None:
    if len(text) >= MIN_REMEMBERED_LENGTH:
        _remembered.add(text)


def mask_process_output() -> None:
    """Mask every log record (from any logger, its traceback included), Python warning, and the traceback of an
    exception no code caught (in any thread) from now on: they quote library messages, URLs and arguments this code
    never sees."""
    if getattr(logging.getLogRecordFactory(), "masks_secrets", False):
        return
    make_record = logging.getLogRecordFactory()

    def masked_record(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            record.msg, record.args = mask_uri(record.getMessage()), None
        except Exception:  # a malformed call: logging reports it when it formats the record, as without us
            return record
        if record.exc_info:
            record.exc_text = mask_uri(logging.Formatter().formatException(record.exc_info))
        return record

    masked_record.masks_secrets = True
    logging.setLogRecordFactory(masked_record)
    sys.excepthook = _masked_excepthook
    threading.excepthook = _masked_thread_excepthook
    format_warning = warnings.formatwarning
    warnings.formatwarning = lambda *args, **kwargs: mask_uri(format_warning(*args, **kwargs))


def _masked_excepthook(kind, error, trace) -> None:
    sys.stderr.write(mask_uri("".join(traceback.format_exception(kind, error, trace))))


def _masked_thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # as threading's own hook: a thread's sys.exit() is no error
        return
    sys.stderr.write(f"Exception in thread {args.thread.name if args.thread else threading.get_ident()}:\n")
    _masked_excepthook(args.exc_type, args.exc_value, args.exc_traceback)


def read_secret(env: str | None = None, file: str | Path | None = None, *, what: str = "secret") -> str | None:
    """The secret held by environment variable ``env`` or in ``file`` (trailing newline dropped); None when neither
    is named. Named but missing or empty is a UserError: a service that was asked to require a token must not
    silently run without one. The message names where it looked, never the value."""
    if env and file:
        raise UserError(f"{what}: name an environment variable or a file, not both")
    if env:
        value = os.environ.get(env, "")
        where = f"environment variable {env}"
    elif file:
        try:
            value = Path(file).read_text().strip()
        except OSError as error:
            raise UserError(f"{what}: cannot read {file}: {error.strerror}") from None
        where = f"file {file}"
    else:
        return None
    if not value:
        raise UserError(f"{what}: {where} is empty or unset")
    _remember_text(value)
    return value
