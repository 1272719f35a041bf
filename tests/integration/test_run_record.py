"""What a run records besides config and metrics, against a real ``mlflow server``: where the code came from (git
commit, package versions, image), the recipe's tags and derived params, MLflow's system metrics, the prompt set as
dataset inputs, images by step and tables."""

import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

from sage_grpo.core.tracking import Tracker, TrackingConfig, environment_tags
from sage_grpo.stages.ingest import IngestReport, Prompt, PromptSet

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def tracker_for(server, run_dir, **overrides) -> Tracker:
    return Tracker(
        TrackingConfig(tracking_uri=server.url, experiment="record", retry_interval_s=0, **overrides), run_dir
    )


def test_environment_tags_name_the_commit_the_versions_and_the_image(monkeypatch, tmp_path):
    monkeypatch.setenv("SAGEGRPO_IMAGE", "registry.example/sage-grpo:1.2")
    tags = environment_tags()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert tags["mlflow.source.git.commit"] == head and tags["mlflow.source.git.dirty"] in ("true", "false")
    assert tags["version.torch"] == torch.__version__ and tags["container.image"] == "registry.example/sage-grpo:1.2"
    packages = ("sage-grpo", "deepspeed", "diffusers", "transformers", "peft", "mlflow")
    assert {f"version.{package}" for package in packages} <= set(tags)

    outside = environment_tags(tmp_path)  # not a checkout (an installed package): no commit, no failure
    assert "mlflow.source.git.commit" not in outside and "version.torch" in outside
    monkeypatch.setenv("PATH", str(tmp_path))  # no git binary at all
    monkeypatch.delenv("SAGEGRPO_IMAGE")
    bare = environment_tags()
    assert "mlflow.source.git.commit" not in bare and "container.image" not in bare


def test_describe_sets_tags_and_derived_params_and_a_resumed_run_keeps_them(mlflow_server, tmp_path):
    tracker = tracker_for(mlflow_server, tmp_path / "run", system_metrics=False)
    run_id = tracker.start({"seed": 1})
    tracker.describe(
        {"model": "tiny-hunyuan15", "sampler": "sage"}, {"derived.world_size": 2, "derived.effective_batch": 16}
    )
    tracker.finish()
    run = MlflowClient(mlflow_server.url).get_run(run_id)
    assert run.data.params == {"seed": "1", "derived.world_size": "2", "derived.effective_batch": "16"}
    assert run.data.tags["model"] == "tiny-hunyuan15" and run.data.tags["sampler"] == "sage"
    assert run.data.tags["version.mlflow"] == environment_tags()["version.mlflow"]

    resumed = tracker_for(mlflow_server, tmp_path / "run", system_metrics=False)
    resumed.start({"seed": 1}, run_id=run_id)
    resumed.describe(
        {"model": "tiny-hunyuan15", "sampler": "sage"}, {"derived.world_size": 2, "derived.effective_batch": 16}
    )
    resumed.finish()
    assert MlflowClient(mlflow_server.url).get_run(run_id).data.params == run.data.params


def test_describe_during_an_outage_is_sent_when_the_server_answers(mlflow_server, tmp_path):
    tracker = tracker_for(mlflow_server, tmp_path / "run", system_metrics=False)
    mlflow_server.stop()
    try:
        assert tracker.start({"seed": 1}) is None
        tracker.describe({"model": "tiny"}, {"derived.world_size": 1})
    finally:
        mlflow_server.start()
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.finish()
    run = MlflowClient(mlflow_server.url).get_run(tracker.run_id)
    assert run.data.tags["model"] == "tiny" and run.data.params["derived.world_size"] == "1"


def test_system_metrics_are_sampled_for_the_run_and_can_be_turned_off(mlflow_server, tmp_path):
    client = MlflowClient(mlflow_server.url)
    on = tracker_for(mlflow_server, tmp_path / "on", system_metrics_interval_s=0.5)
    on_id = on.start({"seed": 1})
    time.sleep(3)
    on.finish()
    samples = client.get_metric_history(on_id, "system/cpu_utilization_percentage")
    assert len(samples) >= 2 and all(0 <= m.value <= 100 * 64 for m in samples)
    assert "system/system_memory_usage_megabytes" in client.get_run(on_id).data.metrics
    assert client.get_run(on_id).info.status == "FINISHED"

    off = tracker_for(mlflow_server, tmp_path / "off", system_metrics=False, system_metrics_interval_s=0.5)
    off_id = off.start({"seed": 1})
    time.sleep(1.5)
    off.finish()
    assert not [key for key in client.get_run(off_id).data.metrics if key.startswith("system/")]


def prompt_set(texts: list[str], held_out: list[str]) -> PromptSet:
    report = IngestReport(kept=len(texts) + len(held_out))
    report.skip("duplicate", 7)
    as_prompts = lambda items: [Prompt(t, {"style": "anime"}, i + 1) for i, t in enumerate(items)]  # noqa: E731
    return PromptSet(train=as_prompts(texts), eval=as_prompts(held_out), report=report)


def test_the_prompt_set_is_logged_as_dataset_inputs_with_digest_counts_and_split(mlflow_server, tmp_path):
    client = MlflowClient(mlflow_server.url)

    def logged(prompts: PromptSet) -> dict:
        tracker = tracker_for(mlflow_server, tmp_path / "run", system_metrics=False)
        run_id = tracker.start({"seed": 1})
        tracker.log_prompt_set(prompts, "s3://bucket/prompts/2026-12-02.jsonl")
        tracker.finish()
        inputs = client.get_run(run_id).inputs.dataset_inputs
        return {next(t.value for t in i.tags if t.key == "mlflow.data.context"): i for i in inputs}

    first = logged(prompt_set(["a fox", "a cat", "a dog"], ["a cow"]))
    assert set(first) == {"training", "evaluation"}
    training = first["training"]
    assert training.dataset.name == "2026-12-02.jsonl" and '"num_rows": 3' in training.dataset.profile
    assert '"uri": "s3://bucket/prompts/2026-12-02.jsonl"' in training.dataset.source
    assert '"style"' in training.dataset.schema  # the metadata columns the rewards receive
    tags = {t.key: t.value for t in training.tags}
    assert tags["kept"] == "4" and tags["skipped.duplicate"] == "1"
    assert '"num_rows": 1' in first["evaluation"].dataset.profile

    same = logged(prompt_set(["a fox", "a cat", "a dog"], ["a cow"]))
    changed = logged(prompt_set(["a fox", "a cat", "a bird"], ["a cow"]))
    assert same["training"].dataset.digest == training.dataset.digest
    assert changed["training"].dataset.digest != training.dataset.digest


def test_images_by_step_and_an_appended_table(mlflow_server, tmp_path):
    tracker = tracker_for(mlflow_server, tmp_path / "run", system_metrics=False)
    run_id = tracker.start({"seed": 1})
    for step in (2, 4):
        tracker.log_image(np.full((8, 8, 3), 40 * step, dtype=np.uint8), key="eval/frames", step=step)
        tracker.log_table(
            {"iteration": [step, step], "prompt": ["a", "b"], "eval/reward": [0.1 * step, 0.5]}, "eval_samples.json"
        )
    tracker.finish()
    client = MlflowClient(mlflow_server.url)
    images = [a.path for a in client.list_artifacts(run_id, "images") if a.path.endswith(".png")]
    # MLflow's image series layout (what its UI's step slider reads): images/<key with / as ~>+step+<step>+...
    assert sorted(p.split("+")[:3] for p in images) == [
        ["images/eval~frames", "step", "2"],
        ["images/eval~frames", "step", "4"],
    ]
    # Read as MLflow writes it (pandas "split" JSON); client.load_table's tag search finds no run on this server.
    table = pd.read_json(client.download_artifacts(run_id, "eval_samples.json", str(tmp_path)), orient="split")
    assert list(table["iteration"]) == [2, 2, 4, 4] and list(table["prompt"]) == ["a", "b", "a", "b"]


def test_eval_samples_reach_mlflow_as_a_frame_series_and_a_table(mlflow_server, tmp_path):
    from sage_grpo.stages.evaluate import EVAL_TABLE, Evaluation, log_samples

    tracker = tracker_for(mlflow_server, tmp_path / "run", system_metrics=False)
    run_id = tracker.start({"seed": 1})
    frames = np.zeros((2, 3, 16, 16, 3), dtype=np.uint8)
    for iteration in (2, 4):
        result = Evaluation(
            {"eval/reward": 0.5},
            [tmp_path / "eval_00.gif"],
            ["a fox", "a cat"],
            {"brightness": [0.4, None], "reward": [0.4, None]},
            frames,
        )
        log_samples(tracker, result, iteration, f"eval/iteration-{iteration:05d}")
    tracker.finish()
    client = MlflowClient(mlflow_server.url)
    steps = sorted(p.path.split("+")[2] for p in client.list_artifacts(run_id, "images") if p.path.endswith(".png"))
    assert steps == ["2", "4"]
    table = pd.read_json(client.download_artifacts(run_id, EVAL_TABLE, str(tmp_path)), orient="split")
    assert list(table["iteration"]) == [2, 2, 4, 4] and list(table["prompt"]) == ["a fox", "a cat"] * 2
    assert list(table["video"]) == ["eval/iteration-00002/eval_00.gif", "", "eval/iteration-00004/eval_00.gif", ""]
    assert table["reward"][0] == 0.4 and pd.isna(table["reward"][1])


def test_system_metrics_go_on_after_an_outage(mlflow_server, tmp_path):
    tracker = tracker_for(mlflow_server, tmp_path / "run", system_metrics_interval_s=0.3)
    run_id = tracker.start({"seed": 1})
    time.sleep(1.5)
    mlflow_server.stop()
    time.sleep(1.0)  # the monitor fails to reach the server and stops
    mlflow_server.start()
    back = time.time() * 1000
    tracker.log_metrics({"loss": 1.0}, step=1)  # the tracker notices the server is back
    time.sleep(2.0)
    tracker.finish()
    samples = MlflowClient(mlflow_server.url).get_metric_history(run_id, "system/cpu_utilization_percentage")
    after = [m for m in samples if m.timestamp > back]
    assert after, "no system metrics after the outage"
    assert min(m.step for m in after) > max(m.step for m in samples if m.timestamp <= back)  # steps go on


def test_a_prompt_set_with_mixed_metadata_still_logs(mlflow_server, tmp_path):
    report = IngestReport(kept=3)
    prompts = [
        Prompt("a", {"tags": ["x", "y"], "n": 1}, 1),
        Prompt("b", {"style": None}, 2),
        Prompt("c", {"n": "s"}, 3),
    ]
    tracker = tracker_for(mlflow_server, tmp_path / "run", system_metrics=False)
    run_id = tracker.start({"seed": 1})
    tracker.log_prompt_set(PromptSet(train=prompts, eval=[], report=report), "/data/prompts.jsonl")
    tracker.finish()
    (logged,) = MlflowClient(mlflow_server.url).get_run(run_id).inputs.dataset_inputs
    assert '"num_rows": 3' in logged.dataset.profile and logged.dataset.name == "prompts.jsonl"
