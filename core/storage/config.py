"""The ``checkpoint`` config section, and the store it builds."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sage_grpo.core.errors import UserError
from sage_grpo.core.lazy import lazy_module
from sage_grpo.core.s3 import S3Config
from sage_grpo.core.storage.local_store import LocalBackend
from sage_grpo.core.storage.locations import canonical_location, local_path, split_s3
from sage_grpo.core.storage.s3_store import S3Backend
from sage_grpo.core.storage.store import CheckpointStore

if TYPE_CHECKING:
    from boto3.s3.transfer import TransferConfig

s3_transfer = lazy_module("boto3.s3.transfer", globals())

MiB = 1024 * 1024


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
                canonical_location(uri)
            except UserError as error:
                raise ValueError(str(error)) from None  # pydantic reports ValueErrors with the key's name
        return uri

    def build(self, output_dir: str | Path | None = None, s3: S3Config | None = None) -> CheckpointStore:
        """The store at ``uri``, or at ``<output_dir>/checkpoints`` when ``uri`` is not set; an S3 store is reached
        with ``s3`` (the run's ``s3`` section; default: boto3's own configuration)."""
        if self.uri is not None:
            uri = self.uri
        elif output_dir is not None:
            uri = str(Path(output_dir) / "checkpoints")
        else:
            raise UserError("checkpoint.uri is not set and no output directory was given")
        backend: LocalBackend | S3Backend
        if uri.startswith("s3://"):
            bucket, prefix = split_s3(uri)
            # The transfer manager runs max_concurrency requests at once; fewer pooled connections would serialise them.
            client = (s3 or S3Config()).client(max_pool_connections=max(10, self.max_concurrency))
            backend = S3Backend(client, bucket, prefix, self._transfer_config())
        else:
            backend = LocalBackend(local_path(uri))
        return CheckpointStore(backend, outage_retry_s=self.outage_retry_s)

    def _transfer_config(self) -> TransferConfig:
        return s3_transfer.TransferConfig(
            multipart_threshold=self.multipart_threshold_bytes,
            multipart_chunksize=self.multipart_chunksize_bytes,
            max_concurrency=self.max_concurrency,
        )
