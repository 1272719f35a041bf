"""A registered version is logged from files (MLflow's models-from-code), never a pickle, with serving requirements
free of the training stack, against a real ``mlflow server``."""

import uuid
from pathlib import Path

import mlflow.artifacts
import numpy as np
import pytest
import yaml
from mlflow import MlflowClient

from sage_grpo.core.registry import TINY_BASE_MODEL, EvalSet, export_key, load_registered_policy, register_export
from tests.integration.test_registry import GENERATION, PROMPT, generate, trained  # noqa: F401 (trained: a fixture)

pytestmark = pytest.mark.integration


def test_a_registered_version_is_code_and_weights_as_files_and_loads_back(mlflow_server, trained, tmp_path):  # noqa: F811
    client = MlflowClient(tracking_uri=mlflow_server.url)
    run_id = client.create_run(client.create_experiment(f"files-{uuid.uuid4().hex[:8]}")).info.run_id
    name = f"t2v-policy-{uuid.uuid4().hex[:8]}"
    _, export_dir = trained
    version = register_export(client, name, export_dir, run_id, {}, export_key(run_id, 1), base_model=TINY_BASE_MODEL)

    source = client.get_model_version_download_uri(name, version.version)
    model_dir = Path(
        mlflow.artifacts.download_artifacts(source, dst_path=str(tmp_path), tracking_uri=mlflow_server.url)
    )
    files = {path.relative_to(model_dir).as_posix() for path in model_dir.rglob("*") if path.is_file()}
    flavor = yaml.safe_load((model_dir / "MLmodel").read_text())["flavors"]["python_function"]
    requirements = (model_dir / "requirements.txt").read_text()

    assert not [file for file in files if file.endswith((".pkl", ".pickle", ".cloudpickle"))], sorted(files)
    assert "python_model" not in flavor and flavor["model_code_path"].endswith("policy_model.py")
    assert "deepspeed" not in requirements and "boto3" not in requirements and "diffusers==" in requirements
    policy = load_registered_policy(f"models:/{name}/{version.version}", tracking_uri=mlflow_server.url)
    np.testing.assert_array_equal(policy.predict([PROMPT], params=GENERATION), generate(trained[0]))


def test_the_registered_eval_metrics_are_one_point_per_step_in_the_run(mlflow_server, trained):  # noqa: F811
    client = MlflowClient(tracking_uri=mlflow_server.url)
    run_id = client.create_run(client.create_experiment(f"once-{uuid.uuid4().hex[:8]}")).info.run_id
    client.log_metric(run_id, "eval/reward", 0.25, step=3)  # the final evaluation, as the run logs it
    exam = EvalSet("0" * 32, 4, "/data/eval.jsonl")
    register_export(
        client, f"m-{uuid.uuid4().hex[:8]}", trained[1], run_id, {"eval/reward": 0.25}, export_key(run_id, 3),
        base_model=TINY_BASE_MODEL, eval_set=exam, step=3,
    )  # fmt: skip

    history = client.get_metric_history(run_id, "eval/reward")
    assert [(point.step, point.value) for point in history] == [(3, 0.25)]
    # Still linked to the model, with its dataset (the server leaves ModelVersion.model_id empty: the run's output).
    model_id = client.get_run(run_id).outputs.model_outputs[0].model_id
    linked = client.get_logged_model(model_id).metrics
    assert [(m.key, m.value, m.step, m.dataset_digest) for m in linked] == [("eval/reward", 0.25, 3, exam.digest)]
