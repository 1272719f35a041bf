"""A checkpoint exports to the same diffusers files as the run's own end-of-run export; a second run pointed at a
checkpoint root another run owns is refused in one line, and continues only with --resume auto."""

import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tests.integration.pipeline_runs import DEMO, REPO, SHORT, environment, run_sagegrpo

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WEIGHTS = "diffusion_pytorch_model.safetensors"


def test_export_from_a_checkpoint_equals_the_run_end_export_and_the_root_has_one_owner(tmp_path):
    first = run_sagegrpo(tmp_path, "run.max_iterations=2")
    assert first.returncode == 0, first.stderr[-3000:]
    run_end = load_file(tmp_path / "exports" / "step-2" / WEIGHTS)

    out = tmp_path / "exported"
    exported = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "export",
            str(DEMO),
            f"run.output_dir={tmp_path}",
            *SHORT,
            "--checkpoint",
            "auto",
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert exported.stdout.strip() == str(out.resolve())  # the only stdout line
    again = load_file(out / WEIGHTS)
    assert again.keys() == run_end.keys()
    assert all(again[name].equal(run_end[name]) for name in run_end)

    second = run_sagegrpo(tmp_path, "run.max_iterations=3")  # no --resume: another run on the same root
    assert second.returncode == 2
    assert second.stderr.strip().splitlines()[-1].startswith("sagegrpo: error: checkpoint root")
    assert "belongs to run" in second.stderr
    resumed = run_sagegrpo(tmp_path, "run.max_iterations=3", flags=("--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "loaded checkpoint step-2" in resumed.stderr
