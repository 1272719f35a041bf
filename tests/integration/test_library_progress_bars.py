"""MLflow's and diffusers' own progress bars stay out of a redirected log: they draw by switches of their own, on by
default, that ignore tqdm's "only on a terminal" rule; ``TQDM_DISABLE=`` (set, empty: bars off a terminal too)
brings them back, which shows the check below can see them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# An artifact round trip through MLflow (its upload and download bars) and a diffusers pipeline call (its loop bar),
# as the run, the registry and the registered pyfunc make them; stderr is a pipe, as a log file or a pod's log is.
# Twice in one process (imports cost a minute here): first with TQDM_DISABLE= (bars wanted), then without it.
SCRIPT = """
import os, sys
from pathlib import Path
import mlflow.artifacts
from sage_grpo.core.models import build_adapter
from sage_grpo.core.tracking import Tracker, TrackingConfig

def round_trip(run_dir):
    files = run_dir / "files"
    files.mkdir(parents=True)
    for index in range(3):
        (files / f"{index}.txt").write_text("x")
    tracker = Tracker(TrackingConfig(system_metrics=False), run_dir)
    tracker.start({"seed": 0})
    tracker.log_artifact(files, "files")
    mlflow.artifacts.download_artifacts(
        run_id=tracker.run_id, artifact_path="files", dst_path=str(run_dir / "back"), tracking_uri=tracker.tracking_uri
    )
    tracker.finish()
    adapter = build_adapter("tiny-hunyuan15")
    size = {"height": adapter.height, "width": adapter.width, "num_frames": adapter.num_frames}
    adapter.pipeline(prompt=["a cat"], num_inference_steps=2, output_type="np", **size)

os.environ["TQDM_DISABLE"] = ""
round_trip(Path(sys.argv[1]) / "drawn")
del os.environ["TQDM_DISABLE"]
print(QUIET, file=sys.stderr, flush=True)
round_trip(Path(sys.argv[1]) / "quiet")
print("done")
""".replace("QUIET", repr("--- quiet from here ---"))
BAR = "it/s]"  # what every tqdm refresh ends with


def test_library_bars_stay_out_of_a_redirected_log(tmp_path):
    # quiet_library_bars sets the libraries' own switches in the environment of a process it runs in: tests run in
    # this worker before may have left them here.
    inherited = (
        "TQDM_DISABLE",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR",
        "HF_HUB_DISABLE_PROGRESS_BARS",
    )
    env = {key: value for key, value in os.environ.items() if key not in inherited}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("done"), result.stderr[-2000:]
    drawn, _, quiet = result.stderr.partition("--- quiet from here ---")
    assert "Downloading artifacts" in drawn and drawn.count(BAR) >= 3  # MLflow's and diffusers' bars, when wanted
    assert BAR not in quiet, quiet[-2000:]
