"""``sagegrpo promote`` against a registry edited by hand or a server that is down: a metric tag that is not a
number, an alias whose version is gone, each one line naming it (exit 2); a dead server one retryable line (exit
75)."""

import os
import time
from pathlib import Path

import pytest

from sage_grpo.core.errors import RetryableStop
from sage_grpo.core.tracking import FAIL_FAST_HTTP
from tests.helpers import free_port, refused_in_one_line

pytestmark = pytest.mark.unit

# One exam, scored one way: the gate compares only versions that share both (core.registry.EvalSet).
EXAM = {
    "eval_set.digest": "d" * 64,
    "eval_set.size": "20",
    "eval_set.source": "prompts.jsonl",
    "eval_set.definition": "e" * 64,
    "eval_set.definition_summary": "brightness",
}


def _registry(capsys, tmp_path: Path, rewards: list[str]) -> str:
    """A registry holding model ``m`` with one version per reward tag (v1 champion, the last challenger); what MLflow
    printed creating it is not the CLI's."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'registry.db'}"
    client = MlflowClient(uri)
    client.create_registered_model("m")
    for reward in rewards:
        client.create_model_version("m", str(tmp_path), tags={**EXAM, "metric.eval/reward": reward})
    client.set_registered_model_alias("m", "champion", "1")
    client.set_registered_model_alias("m", "challenger", str(len(rewards)))
    capsys.readouterr()
    return uri


@pytest.mark.parametrize(("rewards", "version"), [(["0.5", "abc"], "2"), (["high", "0.7"], "1"), (["0.5", ""], "2")])
def test_a_metric_tag_that_is_not_a_number_is_one_line_naming_it(capsys, tmp_path, rewards, version):
    uri = _registry(capsys, tmp_path, rewards)
    line = refused_in_one_line(capsys, ["promote", "--model", "m", "--tracking-uri", uri], "metric.eval/reward")
    assert f"version {version}:" in line, line


@pytest.mark.parametrize("alias", ["champion", "challenger"])
def test_an_alias_whose_version_is_gone_is_one_line_naming_it(capsys, tmp_path, alias):
    import sqlite3

    uri = _registry(capsys, tmp_path, ["0.5", "0.7"])
    with sqlite3.connect(tmp_path / "registry.db") as database:  # as another client or a hand edit leaves it
        database.execute("update registered_model_aliases set version = 9 where alias = ?", (alias,))
    line = refused_in_one_line(capsys, ["promote", "--model", "m", "--tracking-uri", uri, "--dry-run"], "version 9")
    assert alias in line, line


def test_promote_against_a_dead_server_is_one_retryable_line_in_seconds(capsys, monkeypatch):
    from sage_grpo.pipeline import cli

    # An environment of this test's own: none of the operator's settings (they would win), none left behind.
    monkeypatch.setattr(os, "environ", {key: value for key, value in os.environ.items() if key not in FAIL_FAST_HTTP})
    uri = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    code = cli.main(["promote", "--model", "m", "--tracking-uri", uri, "--dry-run"])
    err = capsys.readouterr().err
    assert code == RetryableStop.exit_code and len(err.strip().splitlines()) == 1, err
    assert f"tracking server {uri} unreachable while promoting" in err
    assert time.monotonic() - started < 60  # MLflow's own retries took 250 s
