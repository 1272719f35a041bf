"""A prompt source on S3 that answers 503 SlowDown (throttled) is a retryable stop, exit 75, not a user error (2):
nothing in the config is wrong, and the same run started later reads it. A real HTTP server answers every request
with S3's SlowDown error, so botocore parses and retries it as it would AWS's."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sage_grpo.core.errors import RETRYABLE_EXIT_CODE, RetryableStop
from sage_grpo.core.s3 import S3Config
from sage_grpo.pipeline import cli
from sage_grpo.stages.ingest import DataConfig, ingest

pytestmark = pytest.mark.unit

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>probe</RequestId></Error>"
)


class _SlowDown(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the name http.server dispatches to
        self.server.requests += 1
        self.send_response(503)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(SLOW_DOWN)))
        self.end_headers()
        self.wfile.write(SLOW_DOWN)

    def log_message(self, *args):
        pass


@pytest.fixture
def throttled_endpoint(monkeypatch, tmp_path):
    """The URL of an S3 endpoint that throttles every request, with dummy credentials and no AWS config."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(name, value)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowDown)
    server.requests = 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_a_throttled_s3_prompt_source_is_a_retryable_stop(throttled_endpoint):
    endpoint = f"http://127.0.0.1:{throttled_endpoint.server_port}"

    with pytest.raises(RetryableStop) as stop:
        ingest(DataConfig(source="s3://prompts/train.jsonl"), S3Config(endpoint_url=endpoint, max_attempts=2))

    assert stop.value.exit_code == RETRYABLE_EXIT_CODE
    message = str(stop.value)
    assert "\n" not in message and "SlowDown" in message and "s3://prompts/train.jsonl" in message
    assert throttled_endpoint.requests >= 2  # botocore's own retries ran before giving up


def test_sagegrpo_exits_75_in_one_line_on_a_throttled_prompt_source(throttled_endpoint, capsys):
    endpoint = f"http://127.0.0.1:{throttled_endpoint.server_port}"

    code = cli.main(
        [
            "check-reward",
            DEMO,
            "data.source=s3://prompts/train.jsonl",
            f"s3.endpoint_url={endpoint}",
            "s3.max_attempts=1",
        ]
    )

    err = capsys.readouterr().err
    assert code == RETRYABLE_EXIT_CODE, err
    [line] = err.strip().splitlines()
    assert "SlowDown" in line and "retryable" in line and "Traceback" not in err
