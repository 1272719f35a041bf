"""Checkpoint storage: one interface for local paths, ``file://`` and ``s3://`` roots.

Layout under a root::

    <root>/owner.json               the run that owns this root (claimed on its first commit)
    <root>/step-N/<files>           everything the pipeline staged for step N
    <root>/step-N/manifest.json     written last: path, size and sha256 of every file, world size, config hash, run
    <root>/latest                   "N\\n", moved only after step N's manifest exists
    <root>/set-aside-step-N-<time>  a step that failed verification or another run wrote, moved aside, never deleted

A step counts as committed only when its manifest exists, so a crash at any point of a commit leaves either the
previous state or a complete checkpoint, never a committed-but-broken one. This is the fix for DeepSpeed writing its
own ``latest`` before every rank has finished. Two ways to commit:

- one folder all ranks wrote (a node-local disk for one node, shared storage for several):
  :meth:`CheckpointStore.commit` once, after a barrier;
- no shared filesystem (several nodes): the committer calls :meth:`~CheckpointStore.begin_step`, every rank
  :meth:`~CheckpointStore.upload_rank_files` for its own files (hashed locally, so nothing is read back), and after
  a gather of what each rank reported the committer calls :meth:`~CheckpointStore.commit_manifest`, which checks that
  every rank reported and every file is in the store with its size before it writes the manifest.

Ownership: a root belongs to one run. The first commit claims it (``owner.json``, created atomically: a link on local
disks, a conditional ``If-None-Match: *`` put on S3); another run committing there is refused with one line, unless it
explicitly takes the root over (a fresh start). Pruning only ever deletes steps the pruning run wrote, never one that
failed verification, and a commit over such a step moves the old one aside first.

Outages: botocore retries each request; a commit additionally retries as a whole, with backoff, for
``outage_retry_s``, then raises :class:`core.errors.StoreUnavailable` (exit 75: restart and resume). The caller keeps
its local staging. Reads (resolve, verify, download) raise StoreUnavailable at once after botocore's retries: an
unreachable store is never mistaken for a broken checkpoint.

Security: credentials come only from boto3's standard chain (environment, shared config and profiles, web identity,
instance metadata); they are not part of :class:`CheckpointConfig` and are never logged. Every error message and
log line from this module passes through :func:`core.secrets.mask_uri`, so an endpoint URL carrying ``user:pass@``
(botocore puts the URL in its connection errors) is masked. Storage URIs with ``.``, ``..`` or empty segments are
refused (S3 would store them as literal key names). Manifest paths are untrusted input: any that could leave the
checkpoint (``..``, absolute paths) are rejected, and :func:`load_torch` never unpickles arbitrary objects (DeepSpeed's
own files load through :mod:`core.safe_load`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar
from urllib.parse import unquote, urlparse

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sage_grpo.core.errors import StoreUnavailable, UserError
from sage_grpo.core.files import (
    CHUNK_BYTES,
    atomic_write_bytes,
    file_sha256,
    fsync_dir,
    fsync_tree,
    move_into_place,
    sha256_and_size,
)
from sage_grpo.core.lazy import lazy_module
from sage_grpo.core.s3 import S3Config
from sage_grpo.core.safe_load import refusal_reason
from sage_grpo.core.secrets import mask_uri

if TYPE_CHECKING:
    from boto3.s3.transfer import TransferConfig

torch = lazy_module("torch", globals())
# Needed by S3 stores only: a local store, and reading a config, do without boto3's import.
s3_transfer = lazy_module("boto3.s3.transfer", globals())
botocore_errors = lazy_module("botocore.exceptions", globals())
s3transfer_errors = lazy_module("s3transfer.exceptions", globals())

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
OWNER_NAME = "owner.json"
SET_ASIDE = "set-aside-"
MiB = 1024 * 1024
# Only canonical names: "step-007" would name step 7 but live at a different path than step_dir(7).
_STEP_NAME = re.compile(r"step-(0|[1-9][0-9]*)")
# S3's rules for new bucket names; also keeps userinfo ("key:secret@bucket") out of a bucket name.
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# Answers that mean "not now" rather than "no": retrying (or restarting the run later) can succeed.
_OUTAGE_CODES = {
    "NoSuchBucket",
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
}
_RETRY_FIRST_DELAY_S = 1.0
_RETRY_MAX_DELAY_S = 30.0


def _remote_errors() -> tuple[type[Exception], ...]:
    """What a remote store can raise; each is translated to StoreUnavailable or StorageError before it leaves the
    store."""
    return botocore_errors.BotoCoreError, botocore_errors.ClientError, s3transfer_errors.RetriesExceededError


T = TypeVar("T")


class CheckpointError(UserError):
    """A checkpoint is missing, not committed, fails verification, or names paths outside itself."""


class StorageError(UserError):
    """The store refused a request for a reason retrying cannot cure (access denied, no credentials)."""


class RootClaimedError(UserError):
    """The checkpoint root belongs to another run."""


def step_dir(step: int) -> str:
    return f"step-{step}"


def checked_relpath(path: str) -> str:
    """``path`` if it is a plain relative POSIX path that stays inside its checkpoint, else CheckpointError."""
    parts = path.split("/")
    escapes = path.startswith("/") or any(part in ("", ".", "..") for part in parts)
    # Backslashes and NULs are path separators or terminators somewhere; neither belongs in a checkpoint name.
    if escapes or "\\" in path or "\0" in path:
        raise CheckpointError(f"checkpoint file path {path!r} is not a plain relative path inside the checkpoint")
    return path


class FileEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("path")
    @classmethod
    def _stays_inside_checkpoint(cls, path: str) -> str:
        try:
            return checked_relpath(path)
        except CheckpointError as error:
            raise ValueError(str(error)) from None  # pydantic reports ValueErrors with the manifest's location


class Manifest(BaseModel):
    """What a committed step holds; ``extra`` carries pipeline facts such as eval metrics used by :meth:`prune`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal[1] = 1
    step: int = Field(ge=0)
    world_size: int = Field(ge=1)
    config_hash: str
    created: datetime
    files: tuple[FileEntry, ...]
    extra: dict[str, Any] = {}
    run_id: str | None = None  # the run that wrote the step; None in manifests from before roots were owned

    @classmethod
    def parse(cls, data: bytes, where: str) -> Manifest:
        try:
            return cls.model_validate_json(data)
        except ValidationError as error:
            raise CheckpointError(f"{where}: invalid manifest ({error.errors()[0]['msg']})") from None


class CheckpointConfig(BaseModel):
    """The ``checkpoint`` section: where checkpoints live, what pruning keeps, and how transfers are split.

    How S3 is reached (endpoint, region, retries, timeouts) is the run's ``s3`` section (``core.s3.S3Config``); large
    files go through boto3's transfer manager as multipart uploads and ranged downloads.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # A local path, file:///abs/path or s3://bucket/prefix; None: <output_dir>/checkpoints.
    uri: str | None = None
    every: int = Field(0, ge=0)  # iterations between checkpoints; 0: only at the end and on preemption
    keep_last: int = Field(3, ge=2)  # the one check of it: see CheckpointStore.prune for why never fewer than two
    best_metric: str | None = None  # also keep the best step by this key of the manifest's extra
    higher_is_better: bool = True
    multipart_threshold_bytes: int = Field(64 * MiB, gt=0)
    multipart_chunksize_bytes: int = Field(64 * MiB, gt=0)
    max_concurrency: int = Field(8, ge=1)
    # How long a commit keeps retrying through an outage (after botocore's own retries) before StoreUnavailable.
    outage_retry_s: float = Field(300.0, ge=0)

    @field_validator("uri")
    @classmethod
    def _supported_location(cls, uri: str | None) -> str | None:
        if uri is not None:
            try:
                _canonical_location(uri)
            except UserError as error:
                raise ValueError(str(error)) from None  # pydantic reports ValueErrors with the key's name
        return uri

    def build(self, output_dir: str | Path | None = None, s3: S3Config | None = None) -> CheckpointStore:
        """The store at ``uri``, or at ``<output_dir>/checkpoints`` when ``uri`` is not set; an S3 store is reached
        with ``s3`` (the run's ``s3`` section; default: boto3's own configuration)."""
        if self.uri is None and output_dir is None:
            raise UserError("checkpoint.uri is not set and no output directory was given")
        uri = self.uri if self.uri is not None else str(Path(output_dir) / "checkpoints")
        if uri.startswith("s3://"):
            bucket, _, prefix = _canonical_location(uri)[len("s3://") :].partition("/")
            # The transfer manager runs max_concurrency requests at once; fewer pooled connections would serialise them.
            client = (s3 or S3Config()).client(max_pool_connections=max(10, self.max_concurrency))
            backend = S3Backend(client, bucket, prefix, self._transfer_config())
        else:
            backend = LocalBackend(_local_path(uri))
        return CheckpointStore(backend, outage_retry_s=self.outage_retry_s)

    def _transfer_config(self) -> TransferConfig:
        return s3_transfer.TransferConfig(
            multipart_threshold=self.multipart_threshold_bytes,
            multipart_chunksize=self.multipart_chunksize_bytes,
            max_concurrency=self.max_concurrency,
        )


def _local_path(location: str) -> Path:
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


def _canonical_location(location: str) -> str:
    """The form a backend's ``uri`` takes, so that a resume URI can be compared with a root."""
    if location.startswith("s3://"):
        bucket, _, prefix = location[len("s3://") :].partition("/")
        if not bucket:
            raise UserError(f"{mask_uri(location)!r} names no bucket")
        if not _BUCKET_NAME.fullmatch(bucket):
            raise UserError(f"{mask_uri(location)!r} does not name a valid S3 bucket")
        _check_segments(location, prefix)
        return f"s3://{bucket}/{prefix.rstrip('/')}" if prefix.rstrip("/") else f"s3://{bucket}"
    return str(_local_path(location))


def _check_segments(location: str, path: str) -> None:
    """Refuse ".", ".." and empty segments: S3 stores them as literal key names (``s3://b/../x`` is not ``s3://x``),
    so a URI that looks like another location would silently be a different one. One trailing slash is fine."""
    segments = path.removesuffix("/").split("/") if path.removesuffix("/") else []
    if any(segment in ("", ".", "..") for segment in segments):
        raise UserError(f"{mask_uri(location)!r}: '.', '..' and empty path segments are not allowed in a storage URI")


class StorageBackend(Protocol):
    """Byte storage under one root, addressed by relative keys that the store has already checked."""

    uri: str

    def read_bytes(self, key: str) -> bytes | None: ...
    def write_bytes(self, key: str, data: bytes) -> None: ...
    def upload_files(self, files: Sequence[tuple[Path, str]]) -> None: ...
    def download_files(self, files: Sequence[tuple[str, Path]]) -> None: ...
    def sizes(self, prefix: str) -> dict[str, int]: ...
    def sha256(self, keys: Sequence[str]) -> dict[str, str]: ...
    def child_dirs(self) -> list[str]: ...
    def delete_key(self, key: str) -> None: ...
    def delete_tree(self, prefix: str) -> None: ...
    def move_tree(self, prefix: str, target: str) -> None: ...
    # Writes ``key`` only if it does not exist, atomically; False when it already did.
    def create_exclusive(self, key: str, data: bytes) -> bool: ...
    # The key prefix step N's files and manifest are assembled under, by every rank; seal_step makes it step-N.
    def incoming(self, step: int) -> str: ...
    def open_step(self, step: int) -> None: ...
    def seal_step(self, step: int) -> None: ...
    def abandon_step(self, step: int) -> None: ...


class LocalBackend:
    """A directory tree. Every write is durable and atomic: temp file + fsync + os.replace, and a step's directory
    is assembled aside and renamed into place with its manifest already inside."""

    def __init__(self, root: Path):
        self.root = root
        self.uri = str(root)

    def read_bytes(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None

    def write_bytes(self, key: str, data: bytes) -> None:
        atomic_write_bytes(self.root / key, data)

    def upload_files(self, files: Sequence[tuple[Path, str]]) -> None:
        for source, key in files:
            (self.root / key).parent.mkdir(parents=True, exist_ok=True)
            _durable_copy(source, self.root / key)

    def download_files(self, files: Sequence[tuple[str, Path]]) -> None:
        for key, target in files:
            shutil.copyfile(self.root / key, target)

    def sizes(self, prefix: str) -> dict[str, int]:
        """Sizes of the regular files under ``prefix``. A link or any other kind of file there is a CheckpointError:
        reading through it would load what it points to (another step's state, a file outside the store)."""
        base = self.root / prefix
        if not base.is_dir():
            return {}
        sizes = {}
        for path in [base, *base.rglob("*")]:
            mode = path.lstat().st_mode
            if stat.S_ISREG(mode):
                sizes[path.relative_to(base).as_posix()] = path.stat().st_size
            elif not stat.S_ISDIR(mode):  # lstat: a link is neither
                raise CheckpointError(f"{path} is a link or a special file, which a checkpoint may not contain")
        return sizes

    def sha256(self, keys: Sequence[str]) -> dict[str, str]:
        return {key: file_sha256(self.root / key) for key in keys}

    def child_dirs(self) -> list[str]:
        return [path.name for path in self.root.iterdir() if path.is_dir()] if self.root.is_dir() else []

    def delete_key(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)

    def delete_tree(self, prefix: str) -> None:
        shutil.rmtree(self.root / prefix)

    def move_tree(self, prefix: str, target: str) -> None:
        os.replace(self.root / prefix, self.root / target)
        fsync_dir(self.root)

    def create_exclusive(self, key: str, data: bytes) -> bool:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            atomic_write_bytes(temporary, data)
            os.link(temporary, path)  # fails if path exists: no window in which a second writer could win too
        except FileExistsError:
            return False
        finally:
            temporary.unlink(missing_ok=True)
        fsync_dir(path.parent)
        return True

    def incoming(self, step: int) -> str:
        # Assembled aside and renamed into place with its manifest already inside. The name is the same for every
        # rank (they share the filesystem when they upload here); open_step clears what a crashed attempt left.
        return f".incoming-{step_dir(step)}"

    def open_step(self, step: int) -> None:
        shutil.rmtree(self.root / self.incoming(step), ignore_errors=True)
        (self.root / self.incoming(step)).mkdir(parents=True)

    def seal_step(self, step: int) -> None:
        fsync_tree(self.root / self.incoming(step))
        move_into_place(self.root / self.incoming(step), self.root / step_dir(step))

    def abandon_step(self, step: int) -> None:
        shutil.rmtree(self.root / self.incoming(step), ignore_errors=True)


class S3Backend:
    """Objects under ``s3://bucket/prefix``. Transfers go through boto3's transfer manager (multipart, concurrent,
    retried by botocore); this class has no retry loop of its own."""

    def __init__(self, client, bucket: str, prefix: str, transfer_config: TransferConfig):
        self._client = client
        self._bucket = bucket
        self._prefix = prefix
        self._transfer_config = transfer_config
        self.uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix else key

    def read_bytes(self, key: str) -> bytes | None:
        try:
            return self._client.get_object(Bucket=self._bucket, Key=self._key(key))["Body"].read()
        except botocore_errors.ClientError as error:
            if error.response["Error"]["Code"] in ("NoSuchKey", "404", "NotFound"):
                return None
            raise

    def write_bytes(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self._bucket, Key=self._key(key), Body=data)

    def upload_files(self, files: Sequence[tuple[Path, str]]) -> None:
        with s3_transfer.create_transfer_manager(self._client, self._transfer_config) as manager:
            futures = [manager.upload(str(source), self._bucket, self._key(key)) for source, key in files]
            for future in futures:
                future.result()

    def download_files(self, files: Sequence[tuple[str, Path]]) -> None:
        with s3_transfer.create_transfer_manager(self._client, self._transfer_config) as manager:
            futures = [manager.download(self._bucket, self._key(key), str(target)) for key, target in files]
            for future in futures:
                future.result()

    def sizes(self, prefix: str) -> dict[str, int]:
        base = self._key(prefix) + "/"
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=base)
        return {item["Key"][len(base) :]: item["Size"] for page in pages for item in page.get("Contents", [])}

    def sha256(self, keys: Sequence[str]) -> dict[str, str]:
        # Streaming into a hash (no local copy) through the transfer manager, which retries interrupted streams
        # and, given a sink without seek(), reassembles ranged parts in order.
        sinks = {key: _HashingSink() for key in keys}
        with s3_transfer.create_transfer_manager(self._client, self._transfer_config) as manager:
            futures = [manager.download(self._bucket, self._key(key), sink) for key, sink in sinks.items()]
            for future in futures:
                future.result()
        return {key: sink.hexdigest() for key, sink in sinks.items()}

    def child_dirs(self) -> list[str]:
        base = self._key("")
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=base, Delimiter="/")
        return [item["Prefix"][len(base) :].rstrip("/") for page in pages for item in page.get("CommonPrefixes", [])]

    def delete_key(self, key: str) -> None:
        self._client.delete_object(Bucket=self._bucket, Key=self._key(key))

    def delete_tree(self, prefix: str) -> None:
        keys = [self._key(f"{prefix}/{key}") for key in self.sizes(prefix)]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": key} for key in keys[start : start + 1000]]
            response = self._client.delete_objects(Bucket=self._bucket, Delete={"Objects": batch, "Quiet": True})
            if response.get("Errors"):
                raise OSError(f"could not delete {len(response['Errors'])} objects under {self.uri}/{prefix}")

    def move_tree(self, prefix: str, target: str) -> None:
        # S3 has no rename: server-side copies (multipart for large objects, no bytes through this process), then
        # the source goes, its manifest first so that it is never a committed step with missing files.
        keys = list(self.sizes(prefix))
        with s3_transfer.create_transfer_manager(self._client, self._transfer_config) as manager:
            futures = [
                manager.copy(
                    {"Bucket": self._bucket, "Key": self._key(f"{prefix}/{key}")},
                    self._bucket,
                    self._key(f"{target}/{key}"),
                )
                for key in keys
            ]
            for future in futures:
                future.result()
        self.delete_key(f"{prefix}/{MANIFEST_NAME}")
        self.delete_tree(prefix)

    def create_exclusive(self, key: str, data: bytes) -> bool:
        try:
            self._client.put_object(Bucket=self._bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
        except botocore_errors.ClientError as error:
            # 412: the object exists; 409: a concurrent conditional write to the same key won.
            if error.response["Error"]["Code"] in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise
        return True

    def incoming(self, step: int) -> str:
        # S3 has no rename, so files go straight to their final keys; they count only once the manifest is there.
        return step_dir(step)

    def open_step(self, step: int) -> None:
        # Removing an older manifest of this step first means a re-commit never shows that manifest beside
        # half-overwritten files. A failed commit leaves objects without a manifest, which never count; the transfer
        # manager aborts its own unfinished multipart uploads, and a bucket lifecycle rule
        # (AbortIncompleteMultipartUpload) covers a killed process.
        self.delete_key(f"{step_dir(step)}/{MANIFEST_NAME}")

    def seal_step(self, step: int) -> None:
        pass  # the manifest, written last at its final key, is the commit

    def abandon_step(self, step: int) -> None:
        pass  # objects without a manifest never count, and the next commit of this step replaces them


def _translated(what: str):
    """Methods of CheckpointStore raise StoreUnavailable or StorageError, never a raw botocore error."""

    def decorate(method):
        @functools.wraps(method)
        def translating(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except _remote_errors() as error:
                raise self._translate(error, what) from None

        return translating

    return decorate


class CheckpointStore:
    """Commit, verify, find, fetch and prune ``step-N`` checkpoints under one root. Build one with
    :meth:`CheckpointConfig.build`."""

    def __init__(self, backend: StorageBackend, *, outage_retry_s: float = 300.0):
        self.backend = backend
        self.outage_retry_s = outage_retry_s
        # Steps that failed verification in this process: never pruned, moved aside (not replaced) by a commit.
        self._failed: set[int] = set()

    @property
    def uri(self) -> str:
        return self.backend.uri

    # --- Committing ----------------------------------------------------------------------------------------------

    def commit(
        self,
        local_dir: str | Path,
        step: int,
        *,
        world_size: int,
        config_hash: str,
        extra: Mapping[str, Any] | None = None,
        run_id: str | None = None,
    ) -> Manifest:
        """Copy every file under ``local_dir`` to ``step-N``, then its manifest, then move ``latest`` to ``step``.

        Call it once, after every rank has finished writing ``local_dir``: the hashes are taken from what is there
        now. ``run_id`` claims the root for that run (RootClaimedError when another run owns it). On any error the
        step stays uncommitted and ``latest`` unchanged; an outage is retried for ``outage_retry_s`` and then raised
        as StoreUnavailable. ``local_dir`` is never modified: the caller keeps it until the commit returns.
        """
        staged = _staged_files(Path(local_dir))
        entries = [_file_entry(source, relpath) for source, relpath in staged]

        def attempt() -> Manifest:
            self._begin(step, run_id)  # outside the try: a refused claim must not clean up the owner's staging
            try:
                self._upload(step, staged)
                return self._seal(
                    step, entries, world_size=world_size, config_hash=config_hash, extra=extra, run_id=run_id
                )
            except BaseException:
                self.backend.abandon_step(step)
                raise

        return self._retrying(f"committing {step_dir(step)}", attempt)

    def begin_step(self, step: int, *, run_id: str | None = None) -> None:
        """Per-rank commits, first call (committer only, before any rank uploads): claim the root for ``run_id``,
        move aside a ``step-N`` that failed verification or another run wrote, and uncommit ``step-N``."""
        self._retrying(f"opening {step_dir(step)}", lambda: self._begin(step, run_id))

    def upload_rank_files(self, step: int, rank: int, local_dir: str | Path) -> list[FileEntry]:
        """Per-rank commits, every rank, after :meth:`begin_step`: upload the files under ``local_dir`` (paths
        relative to it, unique across ranks) into step N; return their entries for :meth:`commit_manifest`."""
        staged = _staged_files(Path(local_dir))
        entries = [_file_entry(source, relpath) for source, relpath in staged]
        self._retrying(f"uploading rank {rank}'s files of {step_dir(step)}", lambda: self._upload(step, staged))
        return entries

    def commit_manifest(
        self,
        step: int,
        rank_files: Mapping[int, Sequence[FileEntry]],
        *,
        world_size: int,
        config_hash: str,
        extra: Mapping[str, Any] | None = None,
        run_id: str | None = None,
    ) -> Manifest:
        """Per-rank commits, committer, after every rank's :meth:`upload_rank_files` returned: check that ranks
        ``0..world_size-1`` all reported, that no path was reported twice and that every file is in the store with
        its reported size; then write the manifest (sizes and sha256 as the ranks hashed them) and move ``latest``."""
        missing = sorted(set(range(world_size)) - set(rank_files))
        if missing:
            raise CheckpointError(f"{self.uri}/{step_dir(step)}: no files reported by rank(s) {missing}")
        owners: dict[str, int] = {}
        for rank, entries in sorted(rank_files.items()):
            for entry in entries:
                if entry.path in owners:
                    raise CheckpointError(
                        f"{self.uri}/{step_dir(step)}: {entry.path} reported by ranks {owners[entry.path]} and {rank}"
                    )
                owners[entry.path] = rank
        entries = sorted((entry for files in rank_files.values() for entry in files), key=lambda entry: entry.path)
        return self._retrying(
            f"committing {step_dir(step)}",
            lambda: self._seal(
                step, entries, world_size=world_size, config_hash=config_hash, extra=extra, run_id=run_id
            ),
        )

    # --- Ownership -----------------------------------------------------------------------------------------------

    @_translated("reading the owner")
    def owner(self) -> str | None:
        """The run id that owns this root, None before the first claim."""
        data = self.backend.read_bytes(OWNER_NAME)
        if data is None:
            return None
        try:
            return str(json.loads(data)["run_id"])
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(
                f"{self.uri}/{OWNER_NAME} is unreadable: refusing to guess which run owns this checkpoint root"
            ) from None

    @_translated("claiming the root")
    def claim(self, run_id: str, *, take_over: bool = False) -> None:
        """Make this root ``run_id``'s. Another run's root is refused with RootClaimedError unless ``take_over``
        (a deliberate fresh start); that run's steps stay, and this run's pruning never deletes them."""
        if not run_id:
            raise ValueError("a run id is a non-empty string")
        record = json.dumps({"run_id": run_id, "claimed": datetime.now(UTC).isoformat()}).encode()
        if take_over:
            previous = self.owner() if self.backend.read_bytes(OWNER_NAME) is not None else None
            self.backend.write_bytes(OWNER_NAME, record)
            if previous not in (None, run_id):
                logger.warning("%s taken over by run %s from run %s; its steps are kept", self.uri, run_id, previous)
            return
        created = self.backend.create_exclusive(OWNER_NAME, record)
        # Read back even after a successful create: a store that ignores conditional writes shows the last writer.
        owner = self.owner()
        if owner != run_id:
            raise RootClaimedError(
                f"checkpoint root {self.uri} belongs to run {owner}: give this run its own "
                "checkpoint.uri, or continue that run with --resume auto"
            )
        if created:
            logger.info("checkpoint root %s claimed by run %s", self.uri, run_id)

    # --- Reading -------------------------------------------------------------------------------------------------

    @_translated("reading a manifest")
    def read_manifest(self, step: int) -> Manifest:
        where = f"{self.uri}/{step_dir(step)}"
        data = self.backend.read_bytes(f"{step_dir(step)}/{MANIFEST_NAME}")
        if data is None:
            raise CheckpointError(f"{where} is not a committed checkpoint (no {MANIFEST_NAME})")
        manifest = Manifest.parse(data, where)
        if manifest.step != step:
            raise CheckpointError(f"{where}: manifest says step {manifest.step}")
        return manifest

    @_translated("verifying a checkpoint")
    def verify(self, step: int) -> Manifest:
        """The step's manifest if every file it lists exists with its recorded size and sha256; else CheckpointError."""
        try:
            manifest = self.read_manifest(step)
            prefix = step_dir(step)
            problems = _size_problems(manifest, self.backend.sizes(prefix))
            to_hash = [entry for entry in manifest.files if entry.path not in problems]
            hashes = self.backend.sha256([f"{prefix}/{entry.path}" for entry in to_hash])
            for entry in to_hash:
                if hashes[f"{prefix}/{entry.path}"] != entry.sha256:
                    problems[entry.path] = "sha256 mismatch"
            _raise_if_problems(f"{self.uri}/{prefix}", problems)
        except CheckpointError:
            self._failed.add(step)
            raise
        return manifest

    @_translated("downloading a checkpoint")
    def download(self, step: int, local_dir: str | Path) -> Manifest:
        """Fetch committed step ``step`` into ``local_dir``, checking the size and sha256 of every file fetched."""
        manifest = self.read_manifest(step)
        prefix = step_dir(step)
        where = f"{self.uri}/{prefix}"
        # Sizes first, so that a visibly broken checkpoint fails before gigabytes are transferred.
        _raise_if_problems(where, _size_problems(manifest, self.backend.sizes(prefix)))
        local_dir = Path(local_dir)
        for entry in manifest.files:
            (local_dir / entry.path).parent.mkdir(parents=True, exist_ok=True)
        self.backend.download_files([(f"{prefix}/{entry.path}", local_dir / entry.path) for entry in manifest.files])
        problems = {
            entry.path: "downloaded copy differs from the manifest"
            for entry in manifest.files
            if sha256_and_size(local_dir / entry.path) != (entry.sha256, entry.size)
        }
        _raise_if_problems(where, problems)
        return manifest

    @_translated("listing checkpoints")
    def list_steps(self) -> list[int]:
        """Committed steps (those with a manifest, not necessarily verified), oldest first."""
        names = (_STEP_NAME.fullmatch(name) for name in self.backend.child_dirs())
        steps = sorted(int(match.group(1)) for match in names if match)
        return [step for step in steps if self.backend.read_bytes(f"{step_dir(step)}/{MANIFEST_NAME}") is not None]

    @_translated("reading latest")
    def latest_step(self) -> int | None:
        """The step ``latest`` names, None when there is no ``latest`` or it holds no step number (damaged)."""
        data = self.backend.read_bytes(LATEST_NAME)
        text = (data or b"").decode(errors="replace").strip()
        return int(text) if re.fullmatch(r"[0-9]+", text) else None

    def check_committed(self, checkpoint: str | int) -> int | None:
        """CheckpointError now unless ``checkpoint`` (as for :meth:`resolve`) can load: the step it names is committed,
        or for ``"auto"`` some step is. From the manifests alone, nothing hashed or downloaded, so a command refuses in
        a second what it would otherwise refuse after building a model. Returns the named step; None for ``"auto"``,
        whose step is chosen when the steps are verified."""
        if checkpoint == "auto":
            if not self.list_steps():
                raise CheckpointError(f"no committed checkpoint in {self.uri}")
            return None
        step = self._requested_step(checkpoint)
        self.read_manifest(step)
        return step

    def resolve_without(self, step: int, *, fresh_start: bool = False) -> int | None:
        """``resolve("auto")`` once more after the reader found step ``step`` wrong (its states, or its manifest's
        content): the step is treated as failing verification (kept, never pruned, moved aside before its number is
        committed again) and the newest older verified step is returned."""
        self._failed.add(step)
        return self.resolve("auto", fresh_start=fresh_start)

    def resolve(self, resume: str | int, *, fresh_start: bool = False) -> int | None:
        """The step to resume from.

        ``"auto"``: the ``latest`` step if it verifies, else the newest older one that does (logged), else None when
        there is no checkpoint. When checkpoints exist but every one fails verification, CheckpointError, unless
        ``fresh_start`` (then None: the broken checkpoints are kept, never pruned).
        A step number, ``"step-N"`` or a URI of a step under this root: that step, or CheckpointError when it is
        not committed or fails verification; a requested checkpoint is never silently replaced.
        """
        if resume == "auto":
            return self._newest_verified(fresh_start)
        step = self._requested_step(resume)
        self.verify(step)
        return step

    # --- Retention -----------------------------------------------------------------------------------------------

    def prune(self, retention: CheckpointConfig, *, run_id: str | None = None) -> list[int]:
        """Delete committed steps except the last ``retention.keep_last`` (never fewer than two, which
        ``CheckpointConfig`` checks: the newest checkpoint can still turn out corrupt when it is read back, and one
        older one must survive it), the best by ``manifest.extra[retention.best_metric]`` and ``latest``; return the
        deleted steps. With ``run_id`` only that run's steps are considered (another run's,
        and old manifests without a run id, are never deleted). Uncommitted (in-flight) steps, steps that failed
        verification and steps with an unreadable manifest are never touched. A failed deletion or an unreachable
        store is logged, not raised: pruning is housekeeping and must not stop training."""
        try:
            manifests = self._readable_manifests(self.list_steps())
            ours = {
                step: manifest
                for step, manifest in manifests.items()
                if step not in self._failed and (run_id is None or manifest.run_id == run_id)
            }
            keep = set(sorted(ours)[-retention.keep_last :]) | {self.latest_step()}
        except (StoreUnavailable, StorageError) as error:
            logger.warning("not pruning %s: %s", self.uri, error)
            return []
        if retention.best_metric is not None:
            keep.add(_best_step(ours, retention.best_metric, retention.higher_is_better))
        return [step for step in sorted(ours) if step not in keep and self._delete_step(step)]

    # --- Internals -----------------------------------------------------------------------------------------------

    def _begin(self, step: int, run_id: str | None) -> None:
        if run_id is not None:
            self.claim(run_id)
        self._set_aside_unless_ours(step, run_id)
        self.backend.open_step(step)

    def _upload(self, step: int, staged: Sequence[tuple[Path, str]]) -> None:
        prefix = self.backend.incoming(step)
        self.backend.upload_files([(source, f"{prefix}/{relpath}") for source, relpath in staged])

    def _seal(
        self,
        step: int,
        entries: Sequence[FileEntry],
        *,
        world_size: int,
        config_hash: str,
        extra: Mapping[str, Any] | None,
        run_id: str | None,
    ) -> Manifest:
        prefix = self.backend.incoming(step)
        manifest = Manifest(
            step=step,
            world_size=world_size,
            config_hash=config_hash,
            created=datetime.now(UTC),
            files=tuple(entries),
            extra=dict(extra or {}),
            run_id=run_id,
        )
        present = self.backend.sizes(prefix)
        _raise_if_problems(f"{self.uri}/{step_dir(step)} (uploaded)", _size_problems(manifest, present))
        listed = {entry.path for entry in entries}
        for stale in sorted(set(present) - listed - {MANIFEST_NAME}):  # left by a crashed attempt
            self.backend.delete_key(f"{prefix}/{stale}")
        # Last: until the manifest exists, nothing treats this step as a checkpoint.
        self.backend.write_bytes(f"{prefix}/{MANIFEST_NAME}", manifest.model_dump_json(indent=1).encode())
        self.backend.seal_step(step)
        self._failed.discard(step)  # what failed is set aside; this step N is a new, complete one
        self.backend.write_bytes(LATEST_NAME, f"{step}\n".encode())
        total = sum(entry.size for entry in manifest.files)
        logger.info("committed %s/%s: %d files, %d bytes", self.uri, step_dir(step), len(manifest.files), total)
        return manifest

    def _set_aside_unless_ours(self, step: int, run_id: str | None) -> None:
        """A committed step N about to be replaced is moved aside if it failed verification or is not this run's:
        neither may be deleted. Leftovers of an uncommitted attempt (no manifest) are simply replaced."""
        if self.backend.read_bytes(f"{step_dir(step)}/{MANIFEST_NAME}") is None:
            return
        reason = "it failed verification" if step in self._failed else None
        if reason is None:
            try:
                owner = self.read_manifest(step).run_id
            except CheckpointError as error:
                reason = str(error)
            else:
                if run_id is not None and owner != run_id:
                    reason = f"run {owner} wrote it"
        if reason is not None:
            target = f"{SET_ASIDE}{step_dir(step)}-{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
            self.backend.move_tree(step_dir(step), target)
            logger.warning("moved %s/%s aside to %s before replacing it: %s", self.uri, step_dir(step), target, reason)

    def _newest_verified(self, fresh_start: bool) -> int | None:
        steps, pointer = self.list_steps(), self.latest_step()
        damaged = pointer not in steps and self.backend.read_bytes(LATEST_NAME) is not None
        if damaged:
            # Not a pointer this store wrote (it moves only onto a committed step, which pruning keeps): trusting it
            # would hide every step, and a fresh start would then recompute and replace the verified ones.
            pointer = None
        # Steps after the pointer are skipped: they are either a commit whose pointer write was lost in a crash or
        # the abandoned branch of a run that was restarted from an older step; resuming one could mix timelines.
        candidates = [step for step in reversed(steps) if pointer is None or step <= pointer]
        owner = self.owner()
        for step in candidates:
            if step in self._failed:
                continue  # set aside by the caller, which said why
            try:
                written_by = self.verify(step).run_id
            except CheckpointError as error:
                logger.warning("skipping checkpoint %s/%s: %s", self.uri, step_dir(step), error)
                continue
            if owner is not None and written_by not in (None, owner):
                # Left by the run this root was taken over from: resuming it would splice two runs together.
                logger.warning(
                    "skipping checkpoint %s/%s: written by run %s, not by the owner %s",
                    self.uri,
                    step_dir(step),
                    written_by,
                    owner,
                )
                continue
            if damaged:
                logger.warning(
                    "resuming from %s/%s, the newest verified checkpoint: %s/%s names no committed step, ignored",
                    self.uri,
                    step_dir(step),
                    self.uri,
                    LATEST_NAME,
                )
            elif step != pointer:
                logger.log(
                    # The step latest names was already reported when it was skipped.
                    logging.INFO if pointer in self._failed else logging.WARNING,
                    "resuming from %s/%s, the newest verified checkpoint (latest was %s)",
                    self.uri,
                    step_dir(step),
                    pointer,
                )
            else:
                logger.info("resuming from %s/%s", self.uri, step_dir(step))
            return step
        if candidates and not fresh_start:
            raise CheckpointError(
                f"no checkpoint under {self.uri} can be resumed: steps {sorted(candidates)} fail "
                "verification (they are kept); start over only deliberately: --fresh-start"
            )
        if candidates:
            logger.warning("no checkpoint under %s can be resumed; starting fresh as asked, keeping them", self.uri)
        else:
            logger.info("no checkpoint under %s; starting from scratch", self.uri)
        return None

    def _requested_step(self, resume: str | int) -> int:
        if isinstance(resume, int):
            return resume
        text = resume.strip()
        if re.fullmatch(r"[0-9]+", text):
            return int(text)
        parent, _, name = text.rstrip("/").rpartition("/")
        match = _STEP_NAME.fullmatch(name)
        if match and (not parent or _same_location(parent, self.uri)):
            return int(match.group(1))
        raise CheckpointError(
            f"resume {mask_uri(str(resume))!r} is not 'auto', a step number or a step-N checkpoint under {self.uri}"
        )

    def _readable_manifests(self, steps: Sequence[int]) -> dict[int, Manifest]:
        manifests = {}
        for step in steps:
            try:
                manifests[step] = self.read_manifest(step)
            except CheckpointError as error:
                logger.warning("leaving %s/%s alone: %s", self.uri, step_dir(step), error)
        return manifests

    def _delete_step(self, step: int) -> bool:
        try:
            # Manifest first: a half-deleted step is then an uncommitted one, never a broken committed one.
            self.backend.delete_key(f"{step_dir(step)}/{MANIFEST_NAME}")
            self.backend.delete_tree(step_dir(step))
        except (OSError, *_remote_errors()) as error:  # pruning logs these instead of stopping a training run
            logger.warning("could not delete %s/%s: %s", self.uri, step_dir(step), _one_line(error))
            return False
        logger.info("pruned %s/%s", self.uri, step_dir(step))
        return True

    def _retrying(self, what: str, action: Callable[[], T]) -> T:
        """``action()``, repeated with backoff while the store is unreachable, for at most ``outage_retry_s``."""
        delay, deadline = _RETRY_FIRST_DELAY_S, time.monotonic() + self.outage_retry_s
        while True:
            try:
                return action()
            except _remote_errors() as error:
                if not is_outage(error) or time.monotonic() + delay > deadline:
                    raise self._translate(error, what) from None
                logger.warning(
                    "%s unreachable while %s (%s); retrying in %.0f s", self.uri, what, _one_line(error), delay
                )
            except StoreUnavailable as error:  # from a translated read inside the action
                if time.monotonic() + delay > deadline:
                    raise
                logger.warning("%s; retrying in %.0f s", error, delay)
            time.sleep(delay)
            delay = min(2 * delay, _RETRY_MAX_DELAY_S)

    def _translate(self, error: BaseException, what: str) -> Exception:
        if is_outage(error):
            return StoreUnavailable(f"checkpoint store {self.uri} unavailable while {what}: {_one_line(error)}")
        return StorageError(f"checkpoint store {self.uri} refused {what}: {_one_line(error)}")


def is_outage(error: BaseException) -> bool:
    """Whether an S3 error means "not now" (unreachable, throttled, bucket missing) rather than "no"."""
    if isinstance(error, botocore_errors.ClientError):
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return error.response.get("Error", {}).get("Code") in _OUTAGE_CODES or status >= 500
    transient = (botocore_errors.ConnectionError, botocore_errors.HTTPClientError, botocore_errors.IncompleteReadError)
    return isinstance(error, (*transient, s3transfer_errors.RetriesExceededError))


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return mask_uri(lines[0][:300]) if lines else type(error).__name__


def _best_step(manifests: Mapping[int, Manifest], metric: str, higher_is_better: bool) -> int | None:
    scored = {}
    for step, manifest in manifests.items():
        value = manifest.extra.get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:  # not NaN
            scored[step] = value if higher_is_better else -value
    # Ties go to the newer step.
    return max(scored, key=lambda step: (scored[step], step), default=None)


def load_tensors(path: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file (adapter or exported weights)."""
    from safetensors.torch import load_file

    return load_file(str(path), device=device)


def load_torch(path: str | Path, map_location: str | torch.device = "cpu") -> Any:
    """A ``torch.save`` file, always with ``weights_only=True``: unpickling arbitrary objects from a checkpoint
    would run whatever code whoever could write to the bucket put there. A file that is not plain data is a one-line
    CheckpointError (torch's own message goes on to advise turning the protection off)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise CheckpointError(f"refusing to load {path}: {refusal_reason(error)}") from None


def _same_location(location: str, uri: str) -> bool:
    try:
        return _canonical_location(location) == uri
    except UserError:
        return False


def _staged_files(local_dir: Path) -> list[tuple[Path, str]]:
    if not local_dir.is_dir():
        raise ValueError(f"checkpoint staging directory {local_dir} does not exist")
    staged = sorted(
        (
            (path, checked_relpath(path.relative_to(local_dir).as_posix()))
            for path in local_dir.rglob("*")
            if path.is_file()
        ),
        key=lambda item: item[1],
    )
    if not staged:
        raise ValueError(f"{local_dir} holds no files: refusing to commit an empty checkpoint")
    if any(relpath == MANIFEST_NAME for _, relpath in staged):
        raise ValueError(f"{local_dir}/{MANIFEST_NAME}: that name is reserved for the store's manifest")
    return staged


def _file_entry(path: Path, relpath: str) -> FileEntry:
    sha256, size = sha256_and_size(path)
    return FileEntry(path=relpath, size=size, sha256=sha256)


def _size_problems(manifest: Manifest, sizes: Mapping[str, int]) -> dict[str, str]:
    problems = {}
    for entry in manifest.files:
        if entry.path not in sizes:
            problems[entry.path] = "missing"
        elif sizes[entry.path] != entry.size:
            problems[entry.path] = f"size {sizes[entry.path]}, manifest says {entry.size}"
    return problems


def _raise_if_problems(where: str, problems: Mapping[str, str]) -> None:
    if problems:
        listed = "; ".join(f"{path}: {problem}" for path, problem in sorted(problems.items())[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"{where} fails verification: {listed}{more}")


class _HashingSink:
    """A write-only file object that keeps only the sha256 of what passes through it."""

    def __init__(self):
        self._digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self._digest.update(data)
        return len(data)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def _durable_copy(source: Path, target: Path) -> None:
    with open(source, "rb") as reader, open(target, "wb") as writer:
        shutil.copyfileobj(reader, writer, CHUNK_BYTES)
        writer.flush()
        os.fsync(writer.fileno())
