"""The one way this project opens an S3 client (checkpoints, prompt and eval sets, the scheduler's markers): the
run's one ``s3`` section (``S3Config``), credentials from boto3's standard chain only (environment, shared config and
profiles, web identity, instance metadata; never from our configs), botocore's own retries, explicit timeouts, and the
addressing style S3-compatible stores need. ``endpoint_url`` None falls back to boto3's own ``AWS_ENDPOINT_URL``
handling."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sage_grpo.core.secrets import mask_uri

AddressingStyle = Literal["auto", "path", "virtual"]
RetryMode = Literal["standard", "adaptive"]


class S3Config(BaseModel):
    """The ``s3`` section: how every S3 call of a run reaches its store (checkpoints, ``data.source``,
    ``eval.source``, the scheduler). Credentials deliberately have no field (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    endpoint_url: str | None = None  # an S3-compatible service (MinIO, Ceph) instead of AWS
    region_name: str | None = None
    addressing_style: AddressingStyle = "auto"  # most MinIO setups need "path"
    retry_mode: RetryMode = "standard"
    max_attempts: int = Field(10, ge=1)
    connect_timeout_s: float = Field(10.0, gt=0)
    read_timeout_s: float = Field(120.0, gt=0)

    @field_validator("endpoint_url")
    @classmethod
    def _http_endpoint(cls, url: str | None) -> str | None:
        if url is not None:
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError(f"{mask_uri(url)!r} is not an http(s) URL with a host")
        return url

    def client(self, max_pool_connections: int = 10):
        """A client with these settings; ``max_pool_connections``: the requests one caller runs at once."""
        return s3_client(
            endpoint_url=self.endpoint_url,
            region_name=self.region_name,
            addressing_style=self.addressing_style,
            retry_mode=self.retry_mode,
            max_attempts=self.max_attempts,
            connect_timeout_s=self.connect_timeout_s,
            read_timeout_s=self.read_timeout_s,
            max_pool_connections=max_pool_connections,
        )


def s3_client(
    *,
    endpoint_url: str | None = None,
    region_name: str | None = None,
    addressing_style: AddressingStyle = "auto",
    retry_mode: RetryMode = "standard",
    max_attempts: int = 10,
    connect_timeout_s: float = 10.0,
    read_timeout_s: float = 120.0,
    max_pool_connections: int = 10,
):
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"mode": retry_mode, "max_attempts": max_attempts},
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        max_pool_connections=max_pool_connections,
        s3={"addressing_style": addressing_style},
    )
    # A session of its own: boto3's default session is shared module state and not safe to use across threads.
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region_name, config=config)
