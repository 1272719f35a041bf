"""The nightly job promotes on day two, as cron runs it (``python -m sage_grpo.pipeline.cli schedule`` with a PATH
that lacks the venv, no ``--nproc-per-node``: one process on this GPU-less machine), against a real ``mlflow
server``: both days are scored on the config's fixed evaluation set by one evaluation definition (the brightness
reward and a contrast judge), day one's version becomes the first champion, and day two's, trained longer at a higher
learning rate, beats it on ``eval/reward`` by more than the default margin (the measured noise floor) while the
judge, gated as a guard, does not drop past its tolerance. MLflow records the fixed set as each run's evaluation
dataset."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from mlflow import MlflowClient

from sage_grpo.core.registry import CHALLENGER, CHAMPION, DECISION_TAG
from sage_grpo.core.registry_config import DEFAULT_MARGIN
from tests.integration.pipeline_runs import DEMO, REPO, environment

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "t2v-nightly"
DAYS = ("2026-12-01", "2026-12-02")
EXAM_SIZE = 4
JUDGE_TOLERANCE = 0.01


@pytest.fixture
def nightly(tmp_path, mlflow_server):
    config = yaml.safe_load(DEMO.read_text())
    config["sde"]["steps"] = 4
    config["rollout"] = {"group_size": 2, "prompts_per_rank": 2}
    config["update"]["micro_batch_size"] = 2
    prompts = (REPO / "configs" / "demo_prompts.txt").read_text().splitlines()
    exam = tmp_path / "eval-v1.txt"
    exam.write_text("\n".join(prompts[-EXAM_SIZE:]) + "\n")
    config["eval"] = {
        "every": 2,
        "write_videos": 0,
        "source": str(exam),
        "judges": [{"name": "tests.fixtures.user_rewards.judges:Contrast"}],
    }
    config["checkpoint"] = {"every": 2, "keep_last": 2}
    config["trust_region"]["anchor_interval"] = 2
    config["registry"] = {"min_eval_prompts": EXAM_SIZE, "guards": {"eval/judge/contrast": JUDGE_TOLERANCE}}
    config_path = tmp_path / "nightly.yaml"
    config_path.write_text(yaml.safe_dump(config))
    prompt_dir = tmp_path / "prompts"
    prompt_dir.mkdir()
    (prompt_dir / f"{DAYS[0]}.txt").write_text("\n".join(prompts[:12]) + "\n")

    def start(day: str, *overrides: str) -> subprocess.CompletedProcess:
        command = [
            sys.executable,
            "-m",
            "sage_grpo.pipeline.cli",
            "schedule",
            str(config_path),
            f"tracking.tracking_uri={mlflow_server.url}",
            *overrides,
            "--prompts",
            str(prompt_dir),
            "--checkpoint-root",
            str(tmp_path / "scheduled"),
            "--model",
            MODEL,
            "--work-dir",
            str(tmp_path / "work"),
            "--date",
            day,
        ]
        env = environment(PATH="/usr/bin:/bin")
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)

    return start, prompt_dir, prompts, exam


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    return result.stdout


def _evaluation_dataset(client: MlflowClient, run_id: str):
    inputs = client.get_run(run_id).inputs.dataset_inputs
    [evaluated] = [i.dataset for i in inputs if any(t.value == "evaluation" for t in i.tags)]
    return evaluated


def test_the_nightly_job_promotes_a_better_challenger_on_day_two(nightly, mlflow_server):
    start, prompt_dir, prompts, exam = nightly
    client = MlflowClient(mlflow_server.url)

    first_day = _ok(start(DAYS[0], "run.max_iterations=2"))
    assert "--nproc-per-node=1" in first_day  # no GPU here: one training process
    [first] = client.search_model_versions(f"name = '{MODEL}'")
    assert client.get_model_version(MODEL, first.version).tags[DECISION_TAG].startswith("promoted: first champion")

    (prompt_dir / f"{DAYS[1]}.txt").write_text("\n".join(prompts[8:]) + "\n")
    _ok(start(DAYS[1], "run.max_iterations=6", "update.learning_rate=1e-2"))
    second = next(v for v in client.search_model_versions(f"name = '{MODEL}'") if v.version != first.version)
    second = client.get_model_version(MODEL, second.version)

    assert dict(client.get_registered_model(MODEL).aliases) == {CHALLENGER: second.version, CHAMPION: second.version}
    assert second.tags["eval_set.definition"] == first.tags["eval_set.definition"]
    assert "judges tests.fixtures.user_rewards.judges:Contrast" in second.tags["eval_set.definition_summary"]
    gain = float(second.tags["metric.eval/reward"]) - float(first.tags["metric.eval/reward"])
    drop = float(first.tags["metric.eval/judge/contrast"]) - float(second.tags["metric.eval/judge/contrast"])
    decision = second.tags[DECISION_TAG]
    assert decision.startswith("promoted: eval/reward") and gain > DEFAULT_MARGIN
    assert f"margin {DEFAULT_MARGIN:g}" in decision
    assert "guarded eval/judge/contrast" in decision and drop <= JUDGE_TOLERANCE

    # The evaluation dataset MLflow records is the fixed set that was scored, not the prompt file's held-out split.
    for version in (first, second):
        dataset = _evaluation_dataset(client, version.run_id)
        assert dataset.name == exam.name and f'"num_rows": {EXAM_SIZE}' in dataset.profile
