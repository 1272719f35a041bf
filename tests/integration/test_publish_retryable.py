"""A run that has trained must not fail at its end: the tracking server going down while the challenger is being
registered, or a full disk under the checkpoint store, the checkpoint staging or the export folder, is a retryable
stop (one line, exit 75, every committed step kept), and ``--resume auto`` afterwards publishes exactly once."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from mlflow import MlflowClient

from sage_grpo.core.errors import RETRYABLE_EXIT_CODE
from tests.integration.pipeline_runs import REPO, environment, run_sagegrpo, sagegrpo_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "probe-policy"


def committed_steps(output_dir: Path) -> list[str]:
    return sorted(
        path.name for path in (output_dir / "checkpoints").glob("step-*") if (path / "manifest.json").exists()
    )


def one_line_retryable(stderr: str) -> str:
    """The run's last stderr line, after checking that nothing before it was a traceback."""
    assert "Traceback" not in stderr, stderr[-4000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("sagegrpo: ") and "--resume auto" in last, last
    return last


def test_a_tracking_outage_while_registering_is_retryable_and_resume_publishes_once(mlflow_server, tmp_path):
    tracking = [
        f"tracking.tracking_uri={mlflow_server.url}",
        "tracking.experiment=outage",
        f"registry.model_name={MODEL}",
    ]
    command = sagegrpo_command(tmp_path, "run.max_iterations=2", *tracking)
    log = tmp_path / "first.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(command, cwd=REPO, env=environment(), stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        # The last step is committed before publishing starts: the server goes down between the two.
        while "checkpoint step-2 committed" not in log.read_text():
            assert process.poll() is None, log.read_text()[-4000:]
        mlflow_server.stop()
        process.wait(timeout=600)
    finally:
        process.kill()
        mlflow_server.start()
    first = log.read_text()
    assert process.returncode == RETRYABLE_EXIT_CODE, first[-4000:]
    assert "tracking" in one_line_retryable(first)
    assert committed_steps(tmp_path) == ["step-2"]

    resumed = run_sagegrpo(tmp_path, "run.max_iterations=2", *tracking, flags=("--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    client = MlflowClient(mlflow_server.url)
    versions = client.search_model_versions(f"name = '{MODEL}'")
    assert len(versions) == 1, [v.version for v in versions]
    assert client.get_model_version_by_alias(MODEL, "challenger").version == versions[0].version
    run = client.get_run(versions[0].run_id)
    assert run.data.tags["sagegrpo.run_id"] and run.info.status == "FINISHED"


# Where a full disk stops the run: a tmpfs of ``size`` mounted over that folder of the output dir, and the steps
# committed when it stops (the store holds step-2 but not step-4 too; a full staging stops the first save).
DISK_FULL = {
    "checkpoint store": ("checkpoints", "120m", 4, ["step-2"]),
    "checkpoint staging": ("checkpoint-staging", "40m", 2, []),
    "export folder": ("exports", "8m", 2, ["step-2"]),
}


def unshare_available() -> bool:
    probe = ["unshare", "--user", "--map-root-user", "--mount", "mount", "-t", "tmpfs", "tmpfs", "/mnt"]
    return shutil.which("unshare") is not None and subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.skipif(not unshare_available(), reason="needs a user and mount namespace for a small tmpfs")
@pytest.mark.parametrize("where", DISK_FULL)
def test_a_full_disk_is_retryable_and_resume_publishes_once(mlflow_server, tmp_path, where):
    folder, size, iterations, committed = DISK_FULL[where]
    output_dir, model = tmp_path / "run", f"{MODEL}-{folder}"
    (output_dir / folder).mkdir(parents=True)
    run = sagegrpo_command(
        output_dir,
        f"run.max_iterations={iterations}",
        f"tracking.tracking_uri={mlflow_server.url}",
        f"tracking.experiment=disk-full-{folder}",
        f"registry.model_name={model}",
    )
    # One namespace for both runs: the tmpfs fills during the first, is grown (the operator frees space) and the
    # second resumes. What the runs left is listed from inside, where the tmpfs is visible.
    script = f"""
        cd "{REPO}"
        mount -t tmpfs -o size={size} tmpfs "{output_dir / folder}" || exit 99
        "$@" 2> "{tmp_path}/first.log"; echo $? > "{tmp_path}/first.rc"
        ls "{output_dir}/checkpoints"/step-*/manifest.json > "{tmp_path}/first.steps" 2>/dev/null
        mount -o remount,size=1g "{output_dir / folder}" || exit 99
        "$@" --resume auto 2> "{tmp_path}/second.log"; echo $? > "{tmp_path}/second.rc"
        ls "{output_dir}/exports" > "{tmp_path}/second.exports"
    """
    namespace = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh"]
    subprocess.run([*namespace, *run], env=environment(), timeout=900, check=True)
    first, second = (tmp_path / "first.log").read_text(), (tmp_path / "second.log").read_text()
    assert int((tmp_path / "first.rc").read_text()) == RETRYABLE_EXIT_CODE, first[-4000:]
    assert "space" in one_line_retryable(first)
    assert [Path(line).parent.name for line in (tmp_path / "first.steps").read_text().split()] == committed
    assert int((tmp_path / "second.rc").read_text()) == 0, second[-4000:]
    if committed:
        assert f"loaded checkpoint {committed[-1]}" in second
    assert (tmp_path / "second.exports").read_text().split() == [f"step-{iterations}"]
    versions = MlflowClient(mlflow_server.url).search_model_versions(f"name = '{model}'")
    assert len(versions) == 1, [v.version for v in versions]
