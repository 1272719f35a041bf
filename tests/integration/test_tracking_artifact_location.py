"""MLflow artifacts go under the configured store, never into ``./mlruns`` of the folder the job started in: a
SQLite tracking URI keeps them beside its database file (as the embedded store keeps its own in the run's
folder)."""

from pathlib import Path

import pytest

from sage_grpo.core.tracking import Tracker, TrackingConfig

pytestmark = pytest.mark.integration  # a real SQLite store: its migrations take seconds


def _log_one_artifact(config: TrackingConfig, run_dir: Path) -> Path:
    """Open a run, upload one file; the local folder the store put it in."""
    tracker = Tracker(config, run_dir)
    tracker.start({"seed": 0})
    note = run_dir / "note.txt"
    note.write_text("kept")
    tracker.log_artifact(note, "notes")
    artifact_uri = tracker.client().get_run(tracker.run_id).info.artifact_uri
    tracker.finish()
    return Path(artifact_uri.removeprefix("file://"))


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_a_sqlite_tracking_uri_keeps_artifacts_beside_its_database(tmp_path, monkeypatch, relative):
    started_in = tmp_path / "job-started-here"
    started_in.mkdir()
    monkeypatch.chdir(started_in)
    store = tmp_path / "store"
    store.mkdir()
    database = Path("../store/mlflow.db") if relative else store / "mlflow.db"
    config = TrackingConfig(tracking_uri=f"sqlite:///{database}", system_metrics=False)

    artifacts = _log_one_artifact(config, tmp_path / "run")

    assert (artifacts / "notes" / "note.txt").read_text() == "kept"
    assert artifacts.is_relative_to(store / "mlflow-artifacts"), artifacts
    assert not (started_in / "mlruns").exists()
