"""Where runs and the registry are tracked: the config first, then MLflow's own environment variables
(``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``), then the local default, the same in every command; and the
tags MLflow's fluent API would set, on the runs the pipeline creates through the client. Against a real server."""

from __future__ import annotations

import getpass
import subprocess
import sys
import uuid

import pytest
import yaml
from mlflow import MlflowClient

from sage_grpo.core.registry import CHALLENGER, CHAMPION, DEFAULT_MIN_EVAL_PROMPTS, METRIC_TAG_PREFIX, EvalSet
from sage_grpo.core.tracking import Tracker, TrackingConfig
from tests.integration.pipeline_runs import environment

pytestmark = pytest.mark.integration


@pytest.fixture
def no_mlflow_environment(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)


def _experiment_of(client: MlflowClient, run_id: str) -> str:
    return client.get_experiment(client.get_run(run_id).info.experiment_id).name


def test_a_run_without_tracking_settings_follows_mlflows_environment(
    mlflow_server, tmp_path, monkeypatch, no_mlflow_environment
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team")
    tracker = Tracker(TrackingConfig(system_metrics=False), tmp_path / "run")
    run_id = tracker.start({"seed": 1})
    tracker.finish()

    assert tracker.tracking_uri == mlflow_server.url
    client = MlflowClient(mlflow_server.url)
    assert _experiment_of(client, run_id) == "team"
    assert not client.get_run(run_id).info.artifact_uri.startswith("file:")  # the server's store, not the run dir
    assert not (tmp_path / "run" / "mlflow.db").exists() and not (tmp_path / "mlflow.db").exists()


def test_the_config_wins_over_the_environment(mlflow_server, tmp_path, monkeypatch, no_mlflow_environment):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team")
    config = TrackingConfig(tracking_uri=mlflow_server.url, experiment="configured", system_metrics=False)
    tracker = Tracker(config, tmp_path / "run")
    run_id = tracker.start({"seed": 1})
    tracker.finish()
    assert _experiment_of(MlflowClient(mlflow_server.url), run_id) == "configured"


def test_runs_carry_the_fluent_source_tags(mlflow_server, tmp_path):
    tracker = Tracker(TrackingConfig(tracking_uri=mlflow_server.url, system_metrics=False), tmp_path / "run")
    run_id = tracker.start({"seed": 1})
    tracker.finish()
    tags = MlflowClient(mlflow_server.url).get_run(run_id).data.tags
    assert tags["mlflow.user"] == getpass.getuser()
    assert tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.source.name"] == sys.argv[0]


def _challenger_on(server_url: str) -> str:
    client = MlflowClient(server_url)
    name = f"env-{uuid.uuid4().hex[:8]}"
    client.create_registered_model(name)
    tags = {f"{METRIC_TAG_PREFIX}eval/reward": "0.5", **EvalSet("0" * 32, DEFAULT_MIN_EVAL_PROMPTS, "exam.txt").tags()}
    version = client.create_model_version(name, "s3://nowhere/model", tags=tags)
    client.set_registered_model_alias(name, CHALLENGER, version.version)
    return name


def _promote(cwd, *arguments: str, **env: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "sage_grpo.pipeline.cli", "promote", *arguments]
    env = {k: v for k, v in environment().items() if not k.startswith("MLFLOW_")} | env
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_promote_follows_the_same_rule_and_never_creates_a_store_in_the_working_directory(mlflow_server, tmp_path):
    model = _challenger_on(mlflow_server.url)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"data": {"source": "prompts.txt"}, "run": {"output_dir": str(tmp_path / "o")}}))

    # A config without tracking settings and MLFLOW_TRACKING_URI: the environment's server.
    result = _promote(tmp_path, "--config", str(config), "--model", model, MLFLOW_TRACKING_URI=mlflow_server.url)
    assert result.returncode == 0, result.stderr[-3000:]
    assert dict(MlflowClient(mlflow_server.url).get_registered_model(model).aliases)[CHAMPION] == "1"

    # An override of the config's tracking URI, as the schedule passes it, wins over the environment.
    result = _promote(
        tmp_path,
        "--config",
        str(config),
        f"tracking.tracking_uri={mlflow_server.url}",
        "--model",
        model,
        "--dry-run",
        MLFLOW_TRACKING_URI="http://127.0.0.1:9",
    )
    assert result.returncode == 0 and "already the champion" in result.stdout, result.stderr[-3000:]

    # Neither a config nor the environment: one line, exit 2, and no ./mlflow.db.
    result = _promote(tmp_path, "--model", model)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "MLFLOW_TRACKING_URI" in result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run.yaml"]


def test_promote_refuses_overrides_without_a_config(tmp_path):
    result = _promote(tmp_path, "--model", "m", "tracking.tracking_uri=http://127.0.0.1:9")
    assert result.returncode == 2 and "need a --config" in result.stderr
