"""``sagegrpo run`` on the tiny two-expert Wan 2.2, demo-sized (the shipped demo with ``model.name=tiny-wan22``,
4 iterations; shift 3 puts steps 0-2 on the high-noise expert, 3-6 on the low-noise one): the brightness reward
rises, and the export holds both experts' folders."""

import json

import pytest
from mlflow import MlflowClient

from tests.integration.pipeline_runs import DEMO, sagegrpo

pytestmark = [pytest.mark.integration]


def test_a_demo_sized_run_of_two_expert_wan_raises_its_reward(tmp_path):
    result = sagegrpo(
        "run",
        str(DEMO),
        f"run.output_dir={tmp_path}",
        "model.name=tiny-wan22",
        "run.max_iterations=4",
        "eval.every=4",
        "checkpoint.every=4",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("sage-grpo").experiment_id])
    rewards = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "reward/mean")}
    assert sorted(rewards) == [1, 2, 3, 4]
    assert rewards[4] > rewards[1]
    files = json.loads((tmp_path / "exports" / "step-4" / "export.json").read_text())["files"]
    assert {name.split("/")[0] for name in files} == {"transformer", "transformer_2"}
