"""Secrets: which config keys hold them, how to keep them out of text, and how to read one.

Shared by everything that prints, logs or saves configs and URLs (tracking params, the saved config, the run
summary, storage errors) so that one list of patterns decides what is a secret.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from core.errors import UserError

MASK = "***"

# A config key (dotted path) that names a secret. ``sig`` only as a whole word: "signal", "sigma" are not secrets.
SECRET_KEY = re.compile(
    r"secret|passw|passwd|pwd|token|key|credential|auth|cookie|session|signature|(?<![a-z])sig(?![a-z])",
    re.IGNORECASE,
)
_URI_USERINFO = re.compile(r"(?<=://)[^/@\s]+(?=@)")  # the `user:pass` (or bare token) in scheme://user:pass@host
# A query parameter of a signed or token-carrying URL: X-Amz-Signature, X-Amz-Credential, X-Amz-Security-Token,
# X-Goog-Signature, Azure's sig, ?token=, ?api_key=, ...
_SECRET_QUERY = re.compile(
    r"(?<=[?&;])([^=&#\s]*(?:sig|token|credential|secret|passw|key|auth)[^=&#\s]*=)[^&#\s]*", re.IGNORECASE
)
_BEARER = re.compile(r"(\b(?:bearer|basic) )[^\s\"',]+", re.IGNORECASE)


def is_secret_key(key: str) -> bool:
    return bool(SECRET_KEY.search(key))


def mask_uri(text: str) -> str:
    """``text`` with the credentials in any URL it holds replaced by ``***``: ``user:pass@``, signed-URL query
    values, and ``Bearer``/``Basic`` credentials. The rest (host, path, other parameters) stays readable."""
    text = _URI_USERINFO.sub(MASK, text)
    text = _SECRET_QUERY.sub(lambda match: match.group(1) + MASK, text)
    return _BEARER.sub(lambda match: match.group(1) + MASK, text)


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
    return value
