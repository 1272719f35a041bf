"""Storage URIs: a local path, ``file:///abs/path`` or ``s3://bucket/prefix``, each in one canonical form so that a
resume URI can be compared with a root.

URIs with ``.``, ``..`` or empty segments are refused: S3 stores them as literal key names (``s3://b/../x`` is not
``s3://x``), so a URI that looks like another location would silently be a different one.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlparse

from sage_grpo.core.errors import UserError
from sage_grpo.core.secrets import mask_uri

# S3's rules for new bucket names; also keeps userinfo ("key:secret@bucket") out of a bucket name.
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def canonical_location(location: str) -> str:
    """The form a backend's ``uri`` takes: ``s3://bucket[/prefix]`` without a trailing slash, or an absolute path."""
    if location.startswith("s3://"):
        bucket, prefix = split_s3(location)
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    return str(local_path(location))


def split_s3(location: str) -> tuple[str, str]:
    """The bucket and the key prefix (no trailing slash) of an ``s3://`` URI; UserError when either is invalid."""
    bucket, _, prefix = location[len("s3://") :].partition("/")
    if not bucket:
        raise UserError(f"{mask_uri(location)!r} names no bucket")
    if not _BUCKET_NAME.fullmatch(bucket):
        raise UserError(f"{mask_uri(location)!r} does not name a valid S3 bucket")
    _check_segments(location, prefix)
    return bucket, prefix.rstrip("/")


def local_path(location: str) -> Path:
    parsed = urlparse(location)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise UserError(f"{mask_uri(location)!r}: file:// URIs must name a local path (file:///abs/path)")
        _check_segments(location, unquote(parsed.path).lstrip("/"))
        return Path(unquote(parsed.path)).resolve()
    if parsed.scheme:
        raise UserError(f"{mask_uri(location)!r}: storage roots are local paths, file:// or s3:// URIs")
    # A plain path means what the operating system says it means: resolve() normalises "." and "..".
    return Path(location).expanduser().resolve()


def same_location(location: str, uri: str) -> bool:
    """Whether ``location`` names the root whose canonical URI is ``uri`` (False for any invalid location)."""
    try:
        return canonical_location(location) == uri
    except UserError:
        return False


def _check_segments(location: str, path: str) -> None:
    """Refuse ".", ".." and empty segments. One trailing slash is fine."""
    segments = path.removesuffix("/").split("/") if path.removesuffix("/") else []
    if any(segment in ("", ".", "..") for segment in segments):
        raise UserError(f"{mask_uri(location)!r}: '.', '..' and empty path segments are not allowed in a storage URI")
