"""``promote`` against a tracking server that is down: exit 75 with one whole line whose advice fits ``promote``."""

import socket

import pytest

from sage_grpo.core.errors import RETRYABLE_EXIT_CODE, RetryableStop
from sage_grpo.pipeline import cli

pytestmark = pytest.mark.unit


def test_promote_during_an_outage_says_why_in_whole_words_and_to_run_promote_again(capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    code = cli.main(["promote", "--tracking-uri", f"http://admin:hunter22@127.0.0.1:{port}", "--model", "m"])

    stderr = capsys.readouterr().err
    assert code == RETRYABLE_EXIT_CODE and stderr.count("\n") == 1
    assert stderr == (
        f"sagegrpo: tracking server http://***@127.0.0.1:{port} unreachable while promoting: Connection refused "
        "(retryable, run promote again once the server answers)\n"
    )


def test_a_run_that_stops_retryably_is_still_told_to_resume():
    assert RetryableStop("checkpoint store down").advice == "restart with --resume auto"
