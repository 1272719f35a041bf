"""A preemption is honoured within a bound even when the iteration cannot finish (a reward that never returns), and a
run that fails is closed in MLflow as FAILED, not left RUNNING."""

import signal
import subprocess

import pytest

from sage_grpo.core.errors import RETRYABLE_EXIT_CODE
from tests.integration.pipeline_runs import REPO, environment, run_sagegrpo, sagegrpo_command

pytestmark = [pytest.mark.integration]

HANGS = "rewards=[{name: 'tests.fixtures.user_rewards.kit:Hangs'}]"


def test_sigterm_during_a_hanging_reward_exits_retryable_after_the_grace_period(tmp_path):
    command = sagegrpo_command(tmp_path, HANGS, "scoring.timeout_s=100000", "run.preemption_grace_s=3")
    process = subprocess.Popen(
        command, cwd=REPO, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        # The embedding cache is written during the first rollout; scoring (which hangs) comes right after.
        while not (tmp_path / "embedding-cache").exists():
            assert process.poll() is None, process.stdout.read()[-3000:]
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=240)
    finally:
        process.kill()
    assert process.returncode == RETRYABLE_EXIT_CODE, output[-3000:]
    assert "run.preemption_grace_s=3" in output
    assert not list((tmp_path / "checkpoints").glob("step-*"))  # nothing half-committed


def test_a_failing_run_is_closed_as_failed_in_mlflow(tmp_path):
    from mlflow import MlflowClient

    result = run_sagegrpo(tmp_path, "rewards=[{name: 'tests.fixtures.user_rewards.kit:Exits'}]", "scoring.retries=0")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "scoring.max_failed_fraction" in result.stderr.strip().splitlines()[-1]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [run.info.status for run in runs] == ["FAILED"]
