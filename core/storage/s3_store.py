"""The S3 store: objects under ``s3://bucket/prefix``, reached with the run's ``s3`` section (``core.s3.S3Config``).

Transfers go through boto3's transfer manager (multipart, concurrent, retried by botocore); this module has no
retry loop of its own: the commit protocol (``store.py``) retries a whole commit through an outage, and
``core.errors.is_outage`` tells an outage ("not now") from a refusal ("no"). S3 has no rename, so a step's files go
straight to their final keys and count only once the manifest, written last, is there; the root's owner record is
created with a conditional ``If-None-Match: *`` put.

Credentials come only from boto3's standard chain (environment, shared config and profiles, web identity, instance
metadata); they are never part of a config and never logged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from sage_grpo.core.lazy import lazy_module
from sage_grpo.core.storage.manifest import MANIFEST_NAME, step_dir

if TYPE_CHECKING:
    from boto3.s3.transfer import TransferConfig

# Imported on first use: a local store, and reading a config, do without boto3's import.
s3_transfer = lazy_module("boto3.s3.transfer", globals())
botocore_errors = lazy_module("botocore.exceptions", globals())
s3transfer_errors = lazy_module("s3transfer.exceptions", globals())


def remote_errors() -> tuple[type[Exception], ...]:
    """What an S3 store can raise; the store translates each to StoreUnavailable or StorageError."""
    return botocore_errors.BotoCoreError, botocore_errors.ClientError, s3transfer_errors.RetriesExceededError


class S3Backend:
    """Byte storage under ``s3://bucket/prefix``; keys are relative POSIX paths the store has already checked."""

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

    def create_exclusive(self, key: str, data: bytes) -> bool:
        try:
            self._client.put_object(Bucket=self._bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
        except botocore_errors.ClientError as error:
            # 412: the object exists; 409: a concurrent conditional write to the same key won.
            if error.response["Error"]["Code"] in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise
        return True

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

    # --- A step's life: opened, filled under incoming(step), sealed (or abandoned) -------------------------------

    def incoming(self, step: int) -> str:
        # Files go straight to their final keys; they count only once the manifest is there.
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


class _HashingSink:
    """A write-only file object that keeps only the sha256 of what passes through it."""

    def __init__(self):
        self._digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self._digest.update(data)
        return len(data)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()
