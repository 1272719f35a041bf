"""Buffered metrics: two runs share an output folder (and its embedded MLflow store). Run A's metrics
were left in ``mlflow-buffer.jsonl`` by an outage; run B (another training run) must neither log A's rows nor skip
its own iterations because of them, and A, resumed, still sends its rows to its own MLflow run."""

import json

import pytest
import requests
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from sage_grpo.core.tracking import BUFFER_FILE, Tracker, TrackingConfig

pytestmark = pytest.mark.unit


class Unreachable:
    """An MLflow client during an outage: every request fails as a refused connection does."""

    def __getattr__(self, name):
        def refuse(*args, **kwargs):
            raise requests.ConnectionError("connection refused")

        return refuse


@pytest.fixture(autouse=True)
def embedded_store(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)


def tracker(run_dir) -> Tracker:
    return Tracker(TrackingConfig(retry_interval_s=0, system_metrics=False), run_dir)


def history(run_dir, run_id: str) -> list[tuple[int, float]]:
    client = MlflowClient(tracker(run_dir).tracking_uri)
    return sorted((metric.step, metric.value) for metric in client.get_metric_history(run_id, "loss"))


def a_before_its_run_opened(run_dir) -> str | None:
    a = tracker(run_dir)
    a._client = Unreachable()
    assert a.start({"seed": 1}, identity="run-a") is None
    for step in (1, 2, 3, 4, 5):
        a.log_metrics({"loss": 100.0 + step}, step=step)
    return None


def a_after_its_run_opened(run_dir) -> str | None:
    a = tracker(run_dir)
    run_id = a.start({"seed": 1}, identity="run-a")
    a.log_metrics({"loss": 100.0}, step=0)
    a._client = Unreachable()
    for step in (1, 2, 3, 4, 5):
        a.log_metrics({"loss": 100.0 + step}, step=step)
    return run_id


def a_without_an_identity(run_dir) -> str | None:
    a = tracker(run_dir)
    a._client = Unreachable()
    a.start({"seed": 1})
    for step in (1, 2, 3, 4, 5):
        a.log_metrics({"loss": 100.0 + step}, step=step)
    return None


def a_from_before_rows_named_their_run(run_dir) -> str | None:
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"key": "loss", "value": 100.0 + step, "step": step, "timestamp": 1} for step in (1, 2, 3, 4, 5)]
    (run_dir / BUFFER_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"key": "lo')
    return None


LEFT_BEHIND = {
    "before A's run opened": a_before_its_run_opened,
    "after A's run opened": a_after_its_run_opened,
    "by a tracker without an identity": a_without_an_identity,
    "in the old format, with a torn last line": a_from_before_rows_named_their_run,
}


@pytest.mark.parametrize("how", LEFT_BEHIND)
def test_a_run_logs_only_its_own_rows_from_a_shared_buffer(tmp_path, caplog, how):
    run_dir = tmp_path / "shared"
    a_run_id = LEFT_BEHIND[how](run_dir)
    left = (run_dir / BUFFER_FILE).read_text()

    b = tracker(run_dir)
    b_run_id = b.start({"seed": 2}, identity="run-b")
    assert b_run_id and b_run_id != a_run_id
    assert b.logged_through("loss") == 0  # B re-executes nothing it did not log
    for step in (1, 2, 3):
        b.log_metrics({"loss": float(step)}, step=step)
    b.finish()

    assert history(run_dir, b_run_id) == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert (run_dir / BUFFER_FILE).read_text().count('"loss"') == left.count('"value"')  # A's rows, all of them
    assert caplog.text.count("of another run: left there for it") == 1


@pytest.mark.parametrize("how", ["before A's run opened", "after A's run opened"])
def test_the_run_that_left_rows_sends_them_to_its_own_run_when_it_resumes(tmp_path, how):
    run_dir = tmp_path / "shared"
    a_run_id = LEFT_BEHIND[how](run_dir)
    b = tracker(run_dir)
    b_run_id = b.start({"seed": 2}, identity="run-b")
    b.log_metrics({"loss": 1.0}, step=1)

    a = tracker(run_dir)
    a_run_id = a.start({"seed": 1}, run_id=a_run_id, identity="run-a")
    a.log_metrics({"loss": 106.0}, step=6)

    assert history(run_dir, a_run_id)[-6:] == [(step, 100.0 + step) for step in range(1, 7)]
    assert history(run_dir, b_run_id) == [(1, 1.0)]
    assert not (run_dir / BUFFER_FILE).exists()


def test_a_rejected_batch_sets_aside_only_this_runs_rows(tmp_path, monkeypatch):
    run_dir = tmp_path / "shared"
    a_before_its_run_opened(run_dir)
    b = tracker(run_dir)
    b.start({"seed": 2}, identity="run-b")

    def reject(*args, **kwargs):
        raise MlflowException("invalid value", error_code=INVALID_PARAMETER_VALUE)

    monkeypatch.setattr(b._client, "log_batch", reject)
    b.log_metrics({"loss": 2.0}, step=2)

    [rejected] = run_dir.glob("mlflow-rejected-*.jsonl")
    assert [json.loads(line)["value"] for line in rejected.read_text().splitlines()] == [2.0]
    assert (run_dir / BUFFER_FILE).read_text().count('"loss"') == 5  # A's rows stay for A
