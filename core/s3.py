"""The one way this project opens an S3 client (checkpoints, prompt sets, the scheduler's markers): credentials
from boto3's standard chain only (environment, shared config and profiles, web identity, instance metadata; never
from our configs), botocore's own retries, explicit timeouts, and the addressing style S3-compatible stores need.
``endpoint_url`` None falls back to boto3's own ``AWS_ENDPOINT_URL`` handling."""

from __future__ import annotations

from typing import Literal

AddressingStyle = Literal["auto", "path", "virtual"]
RetryMode = Literal["standard", "adaptive"]


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
