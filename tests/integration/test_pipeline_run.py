"""The demo config end to end against a real ``mlflow server``: one process, and two under the ``deepspeed``
launcher; checked through the MLflow client as a user would look at the run."""

import json
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from tests.helpers import free_port
from tests.integration.pipeline_runs import DEMO, REPO, SHORT, environment, run_sagegrpo, sagegrpo

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _the_run(tracking_uri: str, experiment: str):
    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def _check_tracked_run(tracking_uri: str, experiment: str, iterations: int):
    client, run = _the_run(tracking_uri, experiment)
    assert run.info.status == "FINISHED"
    assert run.data.params["sde.variant"] == "sage" and run.data.params["rollout.group_size"] == "2"
    rewards = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted(m.step for m in rewards) == list(range(1, iterations + 1))
    for key in (
        "update/grad_norm",
        "update/lambda_kl",
        "update/logprob_mismatch",
        "reward/brightness/mean",
        "time/rollout",
        "eval/reward",
        "advantage/abs_mean",
    ):
        assert key in run.data.metrics, key
    # The untrained policy is evaluated at step 0, and each later evaluation is its paired difference from it.
    evaluations = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/reward")}
    assert sorted(evaluations) == list(range(0, iterations + 1, 2))
    (delta,) = client.get_metric_history(run.info.run_id, "eval/reward/delta")[-1:]
    assert delta.value == pytest.approx(evaluations[delta.step] - evaluations[0], abs=1e-6)
    assert run.data.metrics["eval/reward/delta_se"] > 0
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"plots", "config.json", "eval"} <= artifacts
    eval_files = [a.path for a in client.list_artifacts(run.info.run_id, "eval/iteration-00002")]
    assert any(path.endswith((".mp4", ".gif")) for path in eval_files)
    return run


def test_demo_single_process_against_mlflow_server(mlflow_server, tmp_path):
    result = run_sagegrpo(
        tmp_path,
        "run.max_iterations=2",
        f"tracking.tracking_uri={mlflow_server.url}",
        "tracking.experiment=single",
        "lora.enabled=true",
        "lora.rank=4",
        "registry.model_name=demo-policy",
        "registry.promote=true",
        "registry.min_eval_prompts=2",  # the short demo's held-out split
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "completed after 2 iteration(s)" in result.stdout
    run = _check_tracked_run(mlflow_server.url, "single", 2)
    assert (tmp_path / "checkpoints" / "step-2" / "manifest.json").exists()
    # Published: the LoRA export registered as a version, the first one promoted to champion by the gate.
    client = MlflowClient(mlflow_server.url)
    champion = client.get_model_version_by_alias("demo-policy", "champion")
    assert champion.run_id == run.info.run_id
    assert float(champion.tags["metric.eval/reward"]) == pytest.approx(run.data.metrics["eval/reward"])
    audit = [json.loads(line) for line in (tmp_path / "audit" / "rank-0.jsonl").read_text().splitlines()]
    assert audit[-1]["weights_sha256"] == run.data.tags["weights_sha256"]

    # The saved policy evaluates to the logged numbers and writes videos for a new prompt.
    same = [f"run.output_dir={tmp_path}", *SHORT, "lora.enabled=true", "lora.rank=4"]
    evaluated = sagegrpo("eval", str(DEMO), *same, "--checkpoint", "auto", timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout)["eval/reward"] == pytest.approx(run.data.metrics["eval/reward"], rel=1e-5)
    samples = tmp_path / "samples"
    sampled = sagegrpo(
        "sample", str(DEMO), *same, "--checkpoint", "auto", "--prompt", "a red kite", "--out", str(samples), timeout=300
    )
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert any(samples.glob("sample_00.*"))


def test_demo_two_processes_under_the_deepspeed_launcher(mlflow_server, tmp_path):
    command = [
        str(REPO / ".venv" / "bin" / "deepspeed") if (REPO / ".venv/bin/deepspeed").exists() else "deepspeed",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "--module",
        "sage_grpo.pipeline.cli",
        "run",
        str(DEMO),
        f"run.output_dir={tmp_path}",
        *SHORT,
        "run.max_iterations=2",
        f"tracking.tracking_uri={mlflow_server.url}",
        "tracking.experiment=two-ranks",
        "registry.model_name=two-rank-policy",
        "registry.promote=true",
        "registry.min_eval_prompts=2",
    ]
    result = subprocess.run(command, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    run = _check_tracked_run(mlflow_server.url, "two-ranks", 2)
    # Full fine-tuning + registry on 2 ranks ends well: the transformer consolidated from both ranks' ZeRO-3 shards
    # is exported, registered and (first version) promoted.
    champion = MlflowClient(mlflow_server.url).get_model_version_by_alias("two-rank-policy", "champion")
    assert champion.run_id == run.info.run_id
    assert (tmp_path / "exports" / "step-2" / "diffusion_pytorch_model.safetensors").exists()
    manifest = (tmp_path / "checkpoints" / "step-2" / "manifest.json").read_text()
    assert '"world_size": 2' in manifest or '"world_size":2' in manifest
    assert run.data.metrics["samples_per_second"] > 0
    # Resuming it on another number of ranks: tests/integration/test_universal_resume.py.


def test_checkpoints_on_s3_commit_and_resume(s3_server, s3_bucket, tmp_path):
    import boto3

    location = [
        f"checkpoint.uri=s3://{s3_bucket}/runs/demo",
        f"s3.endpoint_url={s3_server}",
        "s3.addressing_style=path",
        "eval.every=0",
    ]
    first = run_sagegrpo(tmp_path, "run.max_iterations=2", *location)
    assert first.returncode == 0, first.stderr[-4000:]
    second = run_sagegrpo(tmp_path, "run.max_iterations=3", *location, flags=("--resume", "auto"))
    assert second.returncode == 0, second.stderr[-4000:]
    assert "loaded checkpoint step-2" in second.stderr
    keys = [
        o["Key"]
        for o in boto3.client("s3", endpoint_url=s3_server).list_objects_v2(Bucket=s3_bucket, Prefix="runs/demo/")[
            "Contents"
        ]
    ]
    assert "runs/demo/step-3/manifest.json" in keys and "runs/demo/latest" in keys


def test_bad_config_is_one_line_and_exit_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "sage_grpo.pipeline.cli", "run", str(DEMO), "rollout.group_size=1"],
        cwd=REPO,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "rollout.group_size" in result.stderr
