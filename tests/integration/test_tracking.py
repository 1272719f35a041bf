"""Tracking against a real ``mlflow server``: masked params, metrics, artifacts, resume by run id, and an outage
(server killed, then restarted on the same port and store) that the run survives without losing a metric."""

import json
import logging
from pathlib import Path

import matplotlib
import pytest
from mlflow import MlflowClient

from sage_grpo.core.secrets import masked_config
from sage_grpo.core.tracking import BUFFER_FILE, Tracker, TrackingConfig, metric_name_problem

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the headless backend)

pytestmark = pytest.mark.integration

RESOLVED_CONFIG = {
    "model": {"name": "tiny", "hf_token": "hf_abcdef"},
    "checkpoint": {"uri": "s3://bucket/run"},
    "s3": {"endpoint_url": "https://alice:s3cr3t@minio.local:9000"},
    "rewards": [{"name": "clip", "weight": 1.0, "api_key": "sk-live"}],
    "update": {"learning_rate": 1e-5, "betas": [0.9, 0.999]},
    "tracking": {"password": None},
}


def tracker_for(server, run_dir, **overrides) -> Tracker:
    return Tracker(TrackingConfig(tracking_uri=server.url, experiment="it", retry_interval_s=0, **overrides), run_dir)


def history(server, run_id: str, key: str = "loss") -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in MlflowClient(server.url).get_metric_history(run_id, key)]


def test_params_are_flattened_and_masked_and_metrics_and_artifacts_arrive(mlflow_server, tmp_path):
    tracker = tracker_for(mlflow_server, tmp_path / "run", run_name="smoke")
    run_id = tracker.start(RESOLVED_CONFIG)
    for step in range(3):
        tracker.log_metrics({"loss": 1.0 / (step + 1), "reward/mean": step}, step=step)
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "step-2.txt").write_text("a video")
    (tmp_path / "resolved.yaml").write_text("seed: 1\n")
    tracker.log_artifact(tmp_path / "resolved.yaml")
    tracker.log_artifact(tmp_path / "samples", "samples")
    figure = plt.figure()
    plt.plot([0, 1, 2], [1.0, 0.5, 0.33])
    tracker.log_figure(figure, "plots/loss.png")
    tracker.finish()

    client = MlflowClient(mlflow_server.url)
    run = client.get_run(run_id)
    assert run.info.run_name == "smoke" and run.info.status == "FINISHED"
    assert run.data.params == {
        "model.name": "tiny",
        "model.hf_token": "***",
        "checkpoint.uri": "s3://bucket/run",
        "s3.endpoint_url": "https://***@minio.local:9000",
        "rewards.0.name": "clip",
        "rewards.0.weight": "1.0",
        "rewards.0.api_key": "***",
        "update.learning_rate": "1e-05",
        "update.betas.0": "0.9",
        "update.betas.1": "0.999",
        "tracking.password": "null",
    }
    assert history(mlflow_server, run_id) == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert [step for step, _ in history(mlflow_server, run_id, "reward/mean")] == [0, 1, 2]
    listed = lambda path=None: sorted(item.path for item in client.list_artifacts(run_id, path))  # noqa: E731
    assert listed() == ["plots", "resolved.yaml", "samples"]
    assert listed("samples") == ["samples/step-2.txt"] and listed("plots") == ["plots/loss.png"]
    downloaded = client.download_artifacts(run_id, "samples/step-2.txt", str(tmp_path / "down"))
    assert Path(downloaded).read_text() == "a video"
    assert not (tmp_path / "run" / BUFFER_FILE).exists()


def test_resume_by_run_id_appends_to_the_same_run(mlflow_server, tmp_path, caplog):
    first = tracker_for(mlflow_server, tmp_path / "run")
    run_id = first.start({"lr": 1e-5, "steps": 2})
    first.log_metrics({"loss": 2.0}, step=0)
    first.log_metrics({"loss": 1.0}, step=1)
    first.finish("KILLED")  # preempted

    resumed = tracker_for(mlflow_server, tmp_path / "run")
    assert resumed.start({"lr": 1e-5, "steps": 4}, run_id=run_id) == run_id
    assert MlflowClient(mlflow_server.url).get_run(run_id).info.status == "RUNNING"
    resumed.log_metrics({"loss": 0.5}, step=2)
    resumed.finish()

    run = MlflowClient(mlflow_server.url).get_run(run_id)
    assert history(mlflow_server, run_id) == [(0, 2.0), (1, 1.0), (2, 0.5)]
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "1e-05", "steps": "2"}  # params are write-once
    assert "params keep old values: ['steps']" in caplog.text


def test_outage_buffers_metrics_and_flushes_them_when_the_server_returns(mlflow_server, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="sage_grpo.core.tracking")
    running = tracker_for(mlflow_server, tmp_path / "running")
    run_id = running.start({"seed": 1})
    running.log_metrics({"loss": 3.0}, step=0)

    mlflow_server.stop()
    running.log_metrics({"loss": 2.0}, step=1)
    running.log_metrics({"loss": 1.0}, step=2)
    running.log_artifact(tmp_path / "not-sent.txt")  # skipped with a warning, not an exception
    late = tracker_for(mlflow_server, tmp_path / "late")  # a run that starts during the outage
    assert late.start({"seed": 2}) is None
    late.log_metrics({"loss": 9.0}, step=0)
    assert len((tmp_path / "running" / BUFFER_FILE).read_text().splitlines()) == 2
    assert caplog.text.count("metrics are buffered in") == 2  # once per tracker, not once per call

    mlflow_server.start()
    running.log_metrics({"loss": 0.5}, step=3)
    late.log_metrics({"loss": 8.0}, step=1)
    running.finish()
    late.finish()

    assert history(mlflow_server, run_id) == [(0, 3.0), (1, 2.0), (2, 1.0), (3, 0.5)]
    assert history(mlflow_server, late.run_id) == [(0, 9.0), (1, 8.0)]
    assert MlflowClient(mlflow_server.url).get_run(late.run_id).data.params == {"seed": "2"}
    assert not (tmp_path / "running" / BUFFER_FILE).exists() and not (tmp_path / "late" / BUFFER_FILE).exists()
    assert "answers again" in caplog.text


def test_only_rank_zero_tracks(monkeypatch, tmp_path):
    from sage_grpo.core import distributed

    monkeypatch.setattr(distributed, "is_main", lambda: False)  # rank 1, whatever process group this process holds
    tracker = Tracker(TrackingConfig(tracking_uri="http://127.0.0.1:9"), tmp_path / "run")
    assert tracker.start(RESOLVED_CONFIG) is None
    tracker.log_metrics({"loss": 1.0}, step=0)
    tracker.finish()
    assert not (tmp_path / "run").exists()


def test_embedded_default_keeps_database_and_artifacts_in_the_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory
    tracker = Tracker(TrackingConfig(experiment="embedded"), tmp_path / "run")
    run_id = tracker.start({"seed": 1})
    tracker.log_metrics({"loss": 1.0}, step=0)
    (tmp_path / "run" / "note.txt").write_text("x")
    tracker.log_artifact(tmp_path / "run" / "note.txt")
    tracker.finish()
    assert tracker.tracking_uri == f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}"
    client = MlflowClient(tracker.tracking_uri)
    assert client.get_run(run_id).info.artifact_uri.startswith((tmp_path / "run" / "mlflow-artifacts").as_uri())
    assert [item.path for item in client.list_artifacts(run_id)] == ["note.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_metric_name_mlflow_rejects_is_dropped_once_and_the_others_still_log(mlflow_server, tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="sage_grpo.core.tracking")
    tracker = tracker_for(mlflow_server, tmp_path / "run")
    run_id = tracker.start({"seed": 1})
    for step in range(3):  # a reward dimension MLflow refuses ("a//b" is not a normalised path) next to good ones
        tracker.log_metrics({"reward/judge//safety": 1.0, "loss": 1.0 / (step + 1), "reward/VQ": step}, step=step)
    tracker.finish()
    assert history(mlflow_server, run_id) == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert [step for step, _ in history(mlflow_server, run_id, "reward/VQ")] == [0, 1, 2]
    assert MlflowClient(mlflow_server.url).get_metric_history(run_id, "reward/judge//safety") == []
    assert caplog.text.count("'reward/judge//safety' is not logged to MLflow") == 1
    assert not list((tmp_path / "run").glob("mlflow-rejected-*.jsonl"))


def test_metric_name_problem_follows_mlflow():
    assert metric_name_problem("reward/VQ") is None and metric_name_problem("eval/reward mean:0") is None
    for bad in ("a//b", "a/../b", "/abs", "x" * 251, "bad\nname", "emoji\u2728"):
        assert metric_name_problem(bad), bad


SECRET_CONFIG = {
    "storage": {
        "Authorization": "Bearer eyJhbGci",
        "passwd": "hunter2",
        "auth": "basic-creds",
        "cookie": "session=abc123",
        "session_token": "FQoGZXIvYXdzE",
    },
    "data": {
        "prompts": "https://bucket.s3.amazonaws.com/p.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIAEXAMPLE%2F20250101&X-Amz-Signature=deadbeef0123&X-Amz-Expires=3600",
        "mirror": "https://acct.blob.core.windows.net/c/p.jsonl?sv=2022-11-02&sig=c2VjcmV0c2ln%3D&se=2030",
    },
    "sde": {"sigma_max": 1.0, "signal": "on"},  # not secrets, though they start like "sig"
}
SECRET_VALUES = [
    "eyJhbGci",
    "hunter2",
    "basic-creds",
    "abc123",
    "FQoGZXIvYXdzE",
    "AKIAEXAMPLE",
    "deadbeef0123",
    "c2VjcmV0c2ln",
]


def test_auth_keys_and_signed_url_queries_are_masked_in_params_and_the_saved_config(mlflow_server, tmp_path):
    tracker = tracker_for(mlflow_server, tmp_path / "run")
    run_id = tracker.start(SECRET_CONFIG)
    tracker.finish()
    params = MlflowClient(mlflow_server.url).get_run(run_id).data.params
    saved = json.dumps(masked_config(SECRET_CONFIG))
    for secret in SECRET_VALUES:
        assert secret not in json.dumps(params) and secret not in saved, secret
    assert {key for key, value in params.items() if value == "***"} == {
        "storage.Authorization",
        "storage.passwd",
        "storage.auth",
        "storage.cookie",
        "storage.session_token",
    }
    assert params["data.prompts"].startswith("https://bucket.s3.amazonaws.com/p.jsonl?X-Amz-Algorithm=AWS4-HMAC")
    assert "X-Amz-Signature=***" in params["data.prompts"] and "X-Amz-Expires=3600" in params["data.prompts"]
    assert "sig=***" in params["data.mirror"] and "sv=2022-11-02" in params["data.mirror"]
    assert params["sde.sigma_max"] == "1.0" and params["sde.signal"] == "on"
