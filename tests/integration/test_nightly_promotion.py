"""The nightly job promotes on day two, as cron runs it (``python -m sage_grpo.pipeline.cli schedule`` with a PATH
that lacks the venv, no ``--nproc-per-node``: one process on this GPU-less machine), against a real ``mlflow
server``: both days are scored on the config's fixed evaluation set by one evaluation definition (the brightness
reward and a contrast judge), day one's version becomes the first champion, and day two's, trained longer at a higher
learning rate, beats it on ``eval/reward`` by more than the default margin (the measured noise floor) while the
judge, gated as a guard, does not drop past its tolerance. MLflow records the fixed set as each run's evaluation
dataset."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from sage_grpo.core.registry import CHALLENGER, CHAMPION, DECISION_TAG
from sage_grpo.core.registry_config import DEFAULT_MARGIN
from tests.integration.scheduled_jobs import DAYS, PROMPTS, ScheduledJob, scheduled_job, succeeded

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "t2v-nightly"
EXAM_SIZE = 4
JUDGE_TOLERANCE = 0.01


@pytest.fixture
def nightly(tmp_path, mlflow_server) -> ScheduledJob:
    return scheduled_job(
        tmp_path,
        mlflow_server.url,
        MODEL,
        exam_size=EXAM_SIZE,
        eval={"judges": [{"name": "tests.fixtures.user_rewards.judges:Contrast"}]},
        registry={"guards": {"eval/judge/contrast": JUDGE_TOLERANCE}},
    )


def _evaluation_dataset(client: MlflowClient, run_id: str):
    inputs = client.get_run(run_id).inputs.dataset_inputs
    [evaluated] = [i.dataset for i in inputs if any(t.value == "evaluation" for t in i.tags)]
    return evaluated


def test_the_nightly_job_promotes_a_better_challenger_on_day_two(nightly, mlflow_server):
    client = MlflowClient(mlflow_server.url)

    first_day = succeeded(nightly.start(DAYS[0], "run.max_iterations=2"))
    assert "--nproc-per-node=1" in first_day  # no GPU here: one training process
    [first] = client.search_model_versions(f"name = '{MODEL}'")
    assert client.get_model_version(MODEL, first.version).tags[DECISION_TAG].startswith("promoted: first champion")

    nightly.add_day(DAYS[1], PROMPTS[8:])
    # 5e-3, not 1e-2: with every step trained (issue 49) 8 iterations at 1e-2 lowered the exam reward by 0.028.
    succeeded(nightly.start(DAYS[1], "run.max_iterations=8", "update.learning_rate=5e-3"))
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
        assert dataset.name == nightly.exam.name and f'"num_rows": {EXAM_SIZE}' in dataset.profile
