"""The scheduled run's markers on a real S3 endpoint (moto's standalone server over HTTP), reached with the run's own
S3 settings, from a process whose PATH lacks the venv."""

import subprocess
import sys

import boto3
import pytest

from sage_grpo.core.errors import RETRYABLE_EXIT_CODE
from sage_grpo.pipeline import scheduled_run
from tests.helpers import free_port
from tests.integration.pipeline_runs import DEMO, environment

DEMO_PROMPTS = DEMO.parent / "demo_prompts.txt"

pytestmark = pytest.mark.integration


def test_s3_store_lists_reads_and_writes_markers(s3_server, s3_bucket, monkeypatch):
    # The scheduler's store takes the endpoint from boto3's standard AWS_ENDPOINT_URL, as a MinIO user would set it.
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    root = scheduled_run.Store(f"s3://{s3_bucket}/scheduled/")
    root.write("2026-12-01\n", "sage-2026-12-01", "schedule", "prompt_set")
    root.write("", "sage-2026-12-01", "schedule", "train.done")
    root.write("x", "sage-2026-12-01", "step-3", "manifest.json")
    assert root.children() == ["sage-2026-12-01"]
    assert root.children("sage-2026-12-01") == ["schedule", "step-3"]
    assert root.read("sage-2026-12-01", "missing") is None
    assert scheduled_run.read_runs(root) == [
        scheduled_run.RunState("sage-2026-12-01", "2026-12-01", frozenset({"train"}))
    ]


def _schedule(cwd, *arguments: str) -> subprocess.CompletedProcess:
    """``python -m sage_grpo.pipeline.cli schedule`` as cron starts it: the venv is not on PATH, only its
    interpreter is named."""
    env = environment(PATH="/usr/bin:/bin")
    command = [sys.executable, "-m", "sage_grpo.pipeline.cli", "schedule", str(DEMO), *arguments]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_schedule_reaches_the_checkpoint_root_with_the_runs_s3_settings(s3_server, s3_bucket, tmp_path):
    # An unfinished run's markers, on a store only s3.endpoint_url names (no AWS_ENDPOINT_URL).
    client = boto3.client("s3", endpoint_url=s3_server)
    client.put_object(Bucket=s3_bucket, Key="scheduled/sage-2026-12-01/schedule/prompt_set", Body=b"2026-12-01.txt\n")
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "2026-12-01.txt").write_text(DEMO_PROMPTS.read_text())  # the set the run resumes on
    exam = tmp_path / "exam.txt"  # the fixed evaluation set a scheduled run needs
    exam.write_text("a red square\na blue square\n")
    result = _schedule(
        tmp_path,
        f"s3.endpoint_url={s3_server}",
        "tracking.tracking_uri=http://127.0.0.1:9",  # never contacted: a dry run
        f"eval.source={exam}",
        "--prompts",
        str(tmp_path / "prompts"),
        "--checkpoint-root",
        f"s3://{s3_bucket}/scheduled",
        "--model",
        "m",
        "--date",
        "2026-12-02",
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "schedule: resume: sage-2026-12-01 is unfinished: train, promote left"
    train, promote = (line.split(": ", 2)[2].split() for line in lines[1:])
    assert train[:3] == [sys.executable, "-m", "sage_grpo.pipeline.launch"]
    assert promote[:4] == [sys.executable, "-m", "sage_grpo.pipeline.cli", "promote"]
    # Both steps get the user's overrides (the endpoint and the tracking server among them).
    for command in (train, promote):
        assert {
            f"s3.endpoint_url={s3_server}",
            "tracking.tracking_uri=http://127.0.0.1:9",
            f"eval.source={exam}",
        } <= set(command)


def test_an_unreachable_checkpoint_root_is_one_line_and_retryable(aws_credentials, tmp_path):
    (tmp_path / "prompts").mkdir()
    result = _schedule(
        tmp_path,
        f"s3.endpoint_url=http://127.0.0.1:{free_port()}",  # nothing listens there
        "s3.max_attempts=1",
        "s3.connect_timeout_s=1",
        "tracking.tracking_uri=http://127.0.0.1:9",
        "--prompts",
        str(tmp_path / "prompts"),
        "--checkpoint-root",
        "s3://scheduled-bucket/root",
        "--model",
        "m",
    )
    assert result.returncode == RETRYABLE_EXIT_CODE, result.stderr[-3000:]
    assert result.stderr.count("\n") == 1 and "s3://scheduled-bucket/root unreachable" in result.stderr
