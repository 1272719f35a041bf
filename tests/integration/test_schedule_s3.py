"""The scheduled run's markers on a real S3 endpoint (moto's standalone server over HTTP)."""

import pytest

from pipeline import schedule

pytestmark = pytest.mark.integration


def test_s3_store_lists_reads_and_writes_markers(s3_server, s3_bucket, monkeypatch):
    # The scheduler's store takes the endpoint from boto3's standard AWS_ENDPOINT_URL, as a MinIO user would set it.
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    root = schedule.Store(f"s3://{s3_bucket}/scheduled/")
    root.write("2026-12-01\n", "sage-2026-12-01", "schedule", "prompt_set")
    root.write("", "sage-2026-12-01", "schedule", "train.done")
    root.write("x", "sage-2026-12-01", "step-3", "manifest.json")
    assert root.children() == ["sage-2026-12-01"]
    assert root.children("sage-2026-12-01") == ["schedule", "step-3"]
    assert root.read("sage-2026-12-01", "missing") is None
    assert schedule.read_runs(root) == [schedule.RunState("sage-2026-12-01", "2026-12-01", frozenset({"train"}))]
