"""Checkpoint storage: one interface for local paths, ``file://`` and ``s3://`` roots.

Layout under a root::

    <root>/step-N/<files>           everything the pipeline staged for step N
    <root>/step-N/manifest.json     written last: path, size and sha256 of every file, world size, config hash
    <root>/latest                   "N\\n", moved only after step N's manifest exists

A step counts as committed only when its manifest exists, so a crash at any point of a commit leaves either the
previous state or a complete checkpoint, never a committed-but-broken one. This is the fix for DeepSpeed writing its
own ``latest`` before every rank has finished: the pipeline lets all ranks write into a local staging directory,
waits for them, and only then calls :meth:`CheckpointStore.commit` once.

Security: credentials come only from boto3's standard chain (environment, shared config and profiles, web identity,
instance metadata); they are not part of :class:`CheckpointConfig` and are never logged. Log lines name the
checkpoint root and steps only, never the endpoint URL (which may carry userinfo). Manifest paths are untrusted
input: any that could leave the checkpoint (``..``, absolute paths) are rejected, and :func:`load_torch` never
unpickles arbitrary objects.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import unquote, urlparse

import boto3
import torch
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from safetensors.torch import load_file

from core.errors import UserError

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
MiB = 1024 * 1024
_HASH_CHUNK = 8 * MiB
# Only canonical names: "step-007" would name step 7 but live at a different path than step_dir(7).
_STEP_NAME = re.compile(r"step-(0|[1-9][0-9]*)")
# What a failed delete can raise; pruning logs these instead of stopping a training run.
_STORAGE_ERRORS = (OSError, BotoCoreError, ClientError)


class CheckpointError(UserError):
    """A checkpoint is missing, not committed, fails verification, or names paths outside itself."""


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

    @classmethod
    def parse(cls, data: bytes, where: str) -> Manifest:
        try:
            return cls.model_validate_json(data)
        except ValidationError as error:
            raise CheckpointError(f"{where}: invalid manifest ({error.errors()[0]['msg']})") from None


class CheckpointConfig(BaseModel):
    """The ``checkpoint`` section: where checkpoints live, what pruning keeps, and how S3 is reached.

    Retries are botocore's own (``standard`` or ``adaptive`` mode); large files go through boto3's transfer manager
    as multipart uploads and ranged downloads. Credentials deliberately have no field (see the module docstring).
    """

    model_config = ConfigDict(extra="forbid")

    # A local path, file:///abs/path or s3://bucket/prefix; None: <output_dir>/checkpoints.
    uri: str | None = None
    every: int = Field(0, ge=0)               # iterations between checkpoints; 0: only at the end and on preemption
    keep_last: int = Field(3, ge=2)           # see CheckpointStore.prune for why never fewer than two
    best_metric: str | None = None            # also keep the best step by this key of the manifest's extra
    higher_is_better: bool = True
    endpoint_url: str | None = None           # an S3-compatible service (MinIO, Ceph) instead of AWS
    region_name: str | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"   # most MinIO setups need "path"
    retry_mode: Literal["standard", "adaptive"] = "standard"
    max_attempts: int = Field(10, ge=1)
    connect_timeout_s: float = Field(10.0, gt=0)
    read_timeout_s: float = Field(120.0, gt=0)
    multipart_threshold_bytes: int = Field(64 * MiB, gt=0)
    multipart_chunksize_bytes: int = Field(64 * MiB, gt=0)
    max_concurrency: int = Field(8, ge=1)

    @field_validator("uri")
    @classmethod
    def _supported_location(cls, uri: str | None) -> str | None:
        if uri is not None:
            try:
                _canonical_location(uri)
            except UserError as error:
                raise ValueError(str(error)) from None  # pydantic reports ValueErrors with the key's name
        return uri

    def build(self, output_dir: str | Path | None = None) -> CheckpointStore:
        """The store at ``uri``, or at ``<output_dir>/checkpoints`` when ``uri`` is not set."""
        if self.uri is None and output_dir is None:
            raise UserError("checkpoint.uri is not set and no output directory was given")
        uri = self.uri if self.uri is not None else str(Path(output_dir) / "checkpoints")
        if uri.startswith("s3://"):
            bucket, _, prefix = uri[len("s3://"):].partition("/")
            return CheckpointStore(S3Backend(self._s3_client(), bucket, prefix.strip("/"), self._transfer_config()))
        return CheckpointStore(LocalBackend(_local_path(uri)))

    def _s3_client(self):
        config = BotoConfig(
            retries={"mode": self.retry_mode, "max_attempts": self.max_attempts},
            connect_timeout=self.connect_timeout_s,
            read_timeout=self.read_timeout_s,
            # The transfer manager runs max_concurrency requests at once; fewer pooled connections would serialise them.
            max_pool_connections=max(10, self.max_concurrency),
            s3={"addressing_style": self.addressing_style},
        )
        # A session of its own: boto3's default session is shared module state and not safe to use across threads.
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region_name, config=config
        )

    def _transfer_config(self) -> TransferConfig:
        return TransferConfig(
            multipart_threshold=self.multipart_threshold_bytes,
            multipart_chunksize=self.multipart_chunksize_bytes,
            max_concurrency=self.max_concurrency,
        )


def _local_path(location: str) -> Path:
    parsed = urlparse(location)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise UserError(f"{location!r}: file:// URIs must name a local path (file:///abs/path)")
        return Path(unquote(parsed.path)).resolve()
    if parsed.scheme:
        raise UserError(f"{location!r}: storage roots are local paths, file:// or s3:// URIs")
    return Path(location).expanduser().resolve()


def _canonical_location(location: str) -> str:
    """The form a backend's ``uri`` takes, so that a resume URI can be compared with a root."""
    if location.startswith("s3://"):
        if not location[len("s3://"):].partition("/")[0]:
            raise UserError(f"{location!r} names no bucket")
        return "s3://" + location[len("s3://"):].strip("/")
    return str(_local_path(location))


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
    # Yields the key prefix that step N's files and manifest go under; a clean exit makes them step-N.
    def staged_step(self, step: int) -> AbstractContextManager[str]: ...


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
        _atomic_write(self.root / key, data)

    def upload_files(self, files: Sequence[tuple[Path, str]]) -> None:
        for source, key in files:
            (self.root / key).parent.mkdir(parents=True, exist_ok=True)
            _durable_copy(source, self.root / key)

    def download_files(self, files: Sequence[tuple[str, Path]]) -> None:
        for key, target in files:
            shutil.copyfile(self.root / key, target)

    def sizes(self, prefix: str) -> dict[str, int]:
        base = self.root / prefix
        if not base.is_dir():
            return {}
        return {path.relative_to(base).as_posix(): path.stat().st_size for path in base.rglob("*") if path.is_file()}

    def sha256(self, keys: Sequence[str]) -> dict[str, str]:
        return {key: _sha256_and_size(self.root / key)[0] for key in keys}

    def child_dirs(self) -> list[str]:
        return [path.name for path in self.root.iterdir() if path.is_dir()] if self.root.is_dir() else []

    def delete_key(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)

    def delete_tree(self, prefix: str) -> None:
        shutil.rmtree(self.root / prefix)

    @contextmanager
    def staged_step(self, step: int) -> Iterator[str]:
        staging = f".staging-{step_dir(step)}-{uuid.uuid4().hex}"
        (self.root / staging).mkdir(parents=True)
        try:
            yield staging
        except BaseException:
            shutil.rmtree(self.root / staging, ignore_errors=True)
            raise
        _fsync_dirs(self.root / staging)
        _move_into_place(self.root / staging, self.root / step_dir(step))


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
        except ClientError as error:
            if error.response["Error"]["Code"] in ("NoSuchKey", "404", "NotFound"):
                return None
            raise

    def write_bytes(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self._bucket, Key=self._key(key), Body=data)

    def upload_files(self, files: Sequence[tuple[Path, str]]) -> None:
        with create_transfer_manager(self._client, self._transfer_config) as manager:
            futures = [manager.upload(str(source), self._bucket, self._key(key)) for source, key in files]
            for future in futures:
                future.result()

    def download_files(self, files: Sequence[tuple[str, Path]]) -> None:
        with create_transfer_manager(self._client, self._transfer_config) as manager:
            futures = [manager.download(self._bucket, self._key(key), str(target)) for key, target in files]
            for future in futures:
                future.result()

    def sizes(self, prefix: str) -> dict[str, int]:
        base = self._key(prefix) + "/"
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=base)
        return {item["Key"][len(base):]: item["Size"] for page in pages for item in page.get("Contents", [])}

    def sha256(self, keys: Sequence[str]) -> dict[str, str]:
        # Streaming into a hash (no local copy) through the transfer manager, which retries interrupted streams
        # and, given a sink without seek(), reassembles ranged parts in order.
        sinks = {key: _HashingSink() for key in keys}
        with create_transfer_manager(self._client, self._transfer_config) as manager:
            futures = [manager.download(self._bucket, self._key(key), sink) for key, sink in sinks.items()]
            for future in futures:
                future.result()
        return {key: sink.hexdigest() for key, sink in sinks.items()}

    def child_dirs(self) -> list[str]:
        base = self._key("")
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=base, Delimiter="/")
        return [item["Prefix"][len(base):].rstrip("/") for page in pages for item in page.get("CommonPrefixes", [])]

    def delete_key(self, key: str) -> None:
        self._client.delete_object(Bucket=self._bucket, Key=self._key(key))

    def delete_tree(self, prefix: str) -> None:
        keys = [self._key(f"{prefix}/{key}") for key in self.sizes(prefix)]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": key} for key in keys[start:start + 1000]]
            response = self._client.delete_objects(Bucket=self._bucket, Delete={"Objects": batch, "Quiet": True})
            if response.get("Errors"):
                raise OSError(f"could not delete {len(response['Errors'])} objects under {self.uri}/{prefix}")

    @contextmanager
    def staged_step(self, step: int) -> Iterator[str]:
        # S3 has no rename, so files go straight to their final keys. Removing an older manifest of this step first
        # means a re-commit never shows that manifest beside half-overwritten files. A failed commit leaves objects
        # without a manifest, which never count; the transfer manager aborts its own unfinished multipart uploads,
        # and a bucket lifecycle rule (AbortIncompleteMultipartUpload) covers a killed process.
        self.delete_key(f"{step_dir(step)}/{MANIFEST_NAME}")
        yield step_dir(step)


class CheckpointStore:
    """Commit, verify, find, fetch and prune ``step-N`` checkpoints under one root. Build one with
    :meth:`CheckpointConfig.build`."""

    def __init__(self, backend: StorageBackend):
        self.backend = backend

    @property
    def uri(self) -> str:
        return self.backend.uri

    def commit(
        self,
        local_dir: str | Path,
        step: int,
        *,
        world_size: int,
        config_hash: str,
        extra: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """Copy every file under ``local_dir`` to ``step-N``, then its manifest, then move ``latest`` to ``step``.

        Call it once, after every rank has finished writing ``local_dir``: the hashes are taken from what is there
        now. On any error the step stays uncommitted and ``latest`` unchanged; the error propagates.
        """
        staged = _staged_files(Path(local_dir))
        manifest = Manifest(
            step=step,
            world_size=world_size,
            config_hash=config_hash,
            created=datetime.now(timezone.utc),
            files=tuple(_file_entry(source, relpath) for source, relpath in staged),
            extra=dict(extra or {}),
        )
        with self.backend.staged_step(step) as prefix:
            self.backend.upload_files([(source, f"{prefix}/{relpath}") for source, relpath in staged])
            # Last: until the manifest exists, nothing treats this step as a checkpoint.
            self.backend.write_bytes(f"{prefix}/{MANIFEST_NAME}", manifest.model_dump_json(indent=1).encode())
        self.backend.write_bytes(LATEST_NAME, f"{step}\n".encode())
        total = sum(entry.size for entry in manifest.files)
        logger.info("committed %s/%s: %d files, %d bytes", self.uri, step_dir(step), len(manifest.files), total)
        return manifest

    def read_manifest(self, step: int) -> Manifest:
        where = f"{self.uri}/{step_dir(step)}"
        data = self.backend.read_bytes(f"{step_dir(step)}/{MANIFEST_NAME}")
        if data is None:
            raise CheckpointError(f"{where} is not a committed checkpoint (no {MANIFEST_NAME})")
        manifest = Manifest.parse(data, where)
        if manifest.step != step:
            raise CheckpointError(f"{where}: manifest says step {manifest.step}")
        return manifest

    def verify(self, step: int) -> Manifest:
        """The step's manifest if every file it lists exists with its recorded size and sha256; else CheckpointError."""
        manifest = self.read_manifest(step)
        prefix = step_dir(step)
        problems = _size_problems(manifest, self.backend.sizes(prefix))
        to_hash = [entry for entry in manifest.files if entry.path not in problems]
        hashes = self.backend.sha256([f"{prefix}/{entry.path}" for entry in to_hash])
        for entry in to_hash:
            if hashes[f"{prefix}/{entry.path}"] != entry.sha256:
                problems[entry.path] = "sha256 mismatch"
        _raise_if_problems(f"{self.uri}/{prefix}", problems)
        return manifest

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
            if _sha256_and_size(local_dir / entry.path) != (entry.sha256, entry.size)
        }
        _raise_if_problems(where, problems)
        return manifest

    def list_steps(self) -> list[int]:
        """Committed steps (those with a manifest, not necessarily verified), oldest first."""
        names = (_STEP_NAME.fullmatch(name) for name in self.backend.child_dirs())
        steps = sorted(int(match.group(1)) for match in names if match)
        return [step for step in steps if self.backend.read_bytes(f"{step_dir(step)}/{MANIFEST_NAME}") is not None]

    def latest_step(self) -> int | None:
        data = self.backend.read_bytes(LATEST_NAME)
        if data is None:
            return None
        try:
            return int(data.decode().strip())
        except (UnicodeDecodeError, ValueError):
            logger.warning("ignoring unreadable %s/%s", self.uri, LATEST_NAME)
            return None

    def resolve(self, resume: str | int) -> int | None:
        """The step to resume from.

        ``"auto"``: the ``latest`` step if it verifies, else the newest older one that does (logged), else None.
        A step number, ``"step-N"`` or a URI of a step under this root: that step, or CheckpointError when it is
        not committed or fails verification; a requested checkpoint is never silently replaced.
        """
        if resume == "auto":
            return self._newest_verified()
        step = self._requested_step(resume)
        self.verify(step)
        return step

    def prune(self, *, keep_last: int, best_metric: str | None = None, higher_is_better: bool = True) -> list[int]:
        """Delete committed steps except the last ``keep_last``, the best by ``manifest.extra[best_metric]`` and
        ``latest``; return the deleted steps. Uncommitted (in-flight) steps are never touched, and a failed
        deletion is logged, not raised: pruning is housekeeping and must not stop training."""
        # The newest checkpoint can still turn out corrupt when it is read back; one older one must survive it.
        if keep_last < 2:
            raise UserError(f"keep_last must be >= 2, got {keep_last}")
        committed = self.list_steps()
        keep = set(committed[-keep_last:]) | {self.latest_step()}
        if best_metric is not None:
            keep.add(self._best_step(committed, best_metric, higher_is_better))
        return [step for step in committed if step not in keep and self._delete_step(step)]

    def _newest_verified(self) -> int | None:
        pointer = self.latest_step()
        # Steps after the pointer are skipped: they are either a commit whose pointer write was lost in a crash or
        # the abandoned branch of a run that was restarted from an older step; resuming one could mix timelines.
        candidates = [step for step in reversed(self.list_steps()) if pointer is None or step <= pointer]
        for step in candidates:
            try:
                self.verify(step)
            except CheckpointError as error:
                logger.warning("skipping checkpoint %s/%s: %s", self.uri, step_dir(step), error)
                continue
            if step != pointer:
                logger.warning("resuming from %s/%s, the newest verified checkpoint (latest was %s)",
                               self.uri, step_dir(step), pointer)
            else:
                logger.info("resuming from %s/%s", self.uri, step_dir(step))
            return step
        logger.info("no verified checkpoint under %s; starting from scratch", self.uri)
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
        raise CheckpointError(f"resume {resume!r} is not 'auto', a step number or a step-N checkpoint under {self.uri}")

    def _best_step(self, steps: list[int], metric: str, higher_is_better: bool) -> int | None:
        scored = {}
        for step in steps:
            try:
                value = self.read_manifest(step).extra.get(metric)
            except CheckpointError as error:
                logger.warning("ignoring %s/%s when choosing the best checkpoint: %s", self.uri, step_dir(step), error)
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:  # not NaN
                scored[step] = value if higher_is_better else -value
        # Ties go to the newer step.
        return max(scored, key=lambda step: (scored[step], step), default=None)

    def _delete_step(self, step: int) -> bool:
        try:
            # Manifest first: a half-deleted step is then an uncommitted one, never a broken committed one.
            self.backend.delete_key(f"{step_dir(step)}/{MANIFEST_NAME}")
            self.backend.delete_tree(step_dir(step))
        except _STORAGE_ERRORS as error:
            logger.warning("could not delete %s/%s: %s", self.uri, step_dir(step), error)
            return False
        logger.info("pruned %s/%s", self.uri, step_dir(step))
        return True


def load_tensors(path: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file (adapter or exported weights)."""
    return load_file(str(path), device=device)


def load_torch(path: str | Path, map_location: str | torch.device = "cpu") -> Any:
    """A ``torch.save`` file, always with ``weights_only=True``: unpickling arbitrary objects from a checkpoint
    would run whatever code whoever could write to the bucket put there."""
    return torch.load(path, map_location=map_location, weights_only=True)


def _same_location(location: str, uri: str) -> bool:
    try:
        return _canonical_location(location) == uri
    except UserError:
        return False


def _staged_files(local_dir: Path) -> list[tuple[Path, str]]:
    if not local_dir.is_dir():
        raise ValueError(f"checkpoint staging directory {local_dir} does not exist")
    staged = sorted(
        ((path, checked_relpath(path.relative_to(local_dir).as_posix())) for path in local_dir.rglob("*")
         if path.is_file()),
        key=lambda item: item[1],
    )
    if not staged:
        raise ValueError(f"{local_dir} holds no files: refusing to commit an empty checkpoint")
    if any(relpath == MANIFEST_NAME for _, relpath in staged):
        raise ValueError(f"{local_dir}/{MANIFEST_NAME}: that name is reserved for the store's manifest")
    return staged


def _file_entry(path: Path, relpath: str) -> FileEntry:
    sha256, size = _sha256_and_size(path)
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


def _sha256_and_size(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while chunk := file.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


class _HashingSink:
    """A write-only file object that keeps only the sha256 of what passes through it."""

    def __init__(self):
        self._digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self._digest.update(data)
        return len(data)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _durable_copy(source: Path, target: Path) -> None:
    with open(source, "rb") as reader, open(target, "wb") as writer:
        shutil.copyfileobj(reader, writer, _HASH_CHUNK)
        writer.flush()
        os.fsync(writer.fileno())


def _move_into_place(staging: Path, target: Path) -> None:
    if target.exists():
        # os.replace cannot overwrite a non-empty directory; moving the old one aside keeps the step directory from
        # ever being a mix of old and new files.
        discarded = target.with_name(f".discarded-{target.name}-{uuid.uuid4().hex}")
        os.replace(target, discarded)
        os.replace(staging, target)
        shutil.rmtree(discarded, ignore_errors=True)
    else:
        os.replace(staging, target)
    _fsync_dir(target.parent)


def _fsync_dirs(root: Path) -> None:
    """fsync every directory under ``root`` so that the entries of the files in them survive a power loss."""
    for directory, _, _ in os.walk(root):
        _fsync_dir(Path(directory))


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
