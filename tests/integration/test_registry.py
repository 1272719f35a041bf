"""The model registry against a real ``mlflow server`` whose artifacts live on moto's S3 server: registration,
the promotion gate, idempotent reruns, and loading a registered tiny policy back to generate a video."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import mlflow.artifacts
import mlflow.models
import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from sage_grpo.core.errors import UserError
from sage_grpo.core.export import LORA_WEIGHT_NAME, export_full, export_lora, model_record
from sage_grpo.core.lora import LoraConfig, add_lora
from sage_grpo.core.models.tiny import tiny_hunyuan15_pipeline, tiny_wan
from sage_grpo.core.registry import (
    CHALLENGER,
    CHAMPION,
    DECISION_TAG,
    MODEL_MANIFEST,
    TINY_BASE_MODEL,
    EvalSet,
    TamperedArtifactError,
    export_key,
    load_registered_policy,
    promote,
    register_export,
)
from tests.integration.conftest import MotoServer
from tests.integration.mlflow_fixture import MlflowServer

pytestmark = pytest.mark.integration

S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
PROMPT = "a red fox runs through snow"
GENERATION = {"num_inference_steps": 2, "seed": 0}
EXAM = EvalSet(
    "6f1d0c3a9b8e7d6c5b4a39281706f5e4", 16, "s3://evals/t2v/v1.jsonl", "d1" * 16, "rewards brightness; seed 1234"
)


def s3_artifacts_mlflow_server(workdir: Path, endpoint_url: str, bucket: str) -> MlflowServer:
    """``mlflow server --artifacts-destination s3://...`` on a moto endpoint (the shared fixture's server keeps its
    artifacts on local disk)."""
    return MlflowServer(workdir, f"s3://{bucket}/mlflow", {**S3_CREDENTIALS, "MLFLOW_S3_ENDPOINT_URL": endpoint_url})


@pytest.fixture(scope="module")
def s3_artifacts(tmp_path_factory):
    """(endpoint URL, bucket) of a moto S3 server that holds the MLflow server's artifacts."""
    moto = MotoServer(tmp_path_factory.mktemp("moto-registry"))
    moto.start()
    bucket = f"mlflow-{uuid.uuid4().hex[:8]}"
    _s3(moto.endpoint_url).create_bucket(Bucket=bucket)
    try:
        yield moto.endpoint_url, bucket
    finally:
        moto.stop()


def _s3(endpoint_url: str):
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory, s3_artifacts):
    endpoint_url, bucket = s3_artifacts
    mlflow_server = s3_artifacts_mlflow_server(tmp_path_factory.mktemp("mlflow-s3"), endpoint_url, bucket)
    mlflow_server.start()
    try:
        yield mlflow_server
    finally:
        mlflow_server.stop()


@pytest.fixture(scope="module")
def client(server) -> MlflowClient:
    return MlflowClient(tracking_uri=server.url)


@pytest.fixture(scope="module")
def run_id(client) -> str:
    experiment = client.create_experiment(f"registry-{uuid.uuid4().hex[:8]}")
    return client.create_run(experiment).info.run_id


@torch.no_grad()
def perturb(params, scale: float) -> None:
    """Stand-in for training."""
    generator = torch.Generator().manual_seed(1)
    for param in params:
        param.add_(scale * torch.randn(param.shape, generator=generator))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny pipeline with a perturbed LoRA adapter (the 'trained' policy) and its export."""
    pipeline = tiny_hunyuan15_pipeline()
    add_lora(pipeline.transformer, LoraConfig(enabled=True, rank=4, alpha=8.0))
    perturb((param for param in pipeline.transformer.parameters() if param.requires_grad), scale=0.2)
    return pipeline, export_lora(pipeline.transformer, tmp_path_factory.mktemp("export") / "lora")


@pytest.fixture
def model_name() -> str:
    return f"t2v-policy-{uuid.uuid4().hex[:8]}"


def register(client, model_name, trained, run_id, step: int, eval_set: EvalSet = EXAM, **metrics):
    _, export_dir = trained
    return register_export(
        client,
        model_name,
        export_dir,
        run_id,
        metrics,
        export_key(run_id, step),
        base_model=TINY_BASE_MODEL,
        eval_set=eval_set,
        step=step,
    )


def model_id(version) -> str:
    # MLflow 3.17's server leaves ModelVersion.model_id empty; the version's source is its logged model's storage.
    match = re.search(r"/models/(m-[0-9a-f]+)/artifacts$", version.source)
    assert match, version.source
    return match.group(1)


def aliases(client, model_name) -> dict[str, str]:
    return dict(client.get_registered_model(model_name).aliases)


def generate(pipeline, height: int = 32, width: int = 32, num_frames: int = 5) -> np.ndarray:
    frames = pipeline(
        prompt=[PROMPT],
        height=height,
        width=width,
        num_frames=num_frames,
        output_type="np",
        num_inference_steps=GENERATION["num_inference_steps"],
        generator=torch.Generator().manual_seed(GENERATION["seed"]),
    ).frames
    return (frames * 255).round().clip(0, 255).astype("uint8")


def test_registered_policy_loads_from_verified_artifacts_and_generates_the_trained_video(
    client, model_name, trained, run_id, server
):
    version = register(client, model_name, trained, run_id, step=10, **{"eval/reward": 0.5})

    policy = load_registered_policy(f"models:/{model_name}@{CHALLENGER}", tracking_uri=server.url)
    video = policy.predict([PROMPT], params=GENERATION)

    assert aliases(client, model_name) == {CHALLENGER: version.version}
    assert version.tags["metric.eval/reward"] == "0.5" and version.tags["base_model"] == TINY_BASE_MODEL
    assert video.dtype == np.uint8 and video.shape == (1, 5, 32, 32, 3)
    np.testing.assert_array_equal(video, generate(trained[0]))  # the trained adapter, not the base model
    assert not np.array_equal(video, generate(tiny_hunyuan15_pipeline()))


def test_a_full_export_registers_and_generates_the_trained_video(client, model_name, run_id, server, tmp_path):
    pipeline = tiny_hunyuan15_pipeline()
    perturb(pipeline.transformer.parameters(), scale=0.05)
    export_dir = export_full(pipeline.transformer, tmp_path / "full")
    version = register_export(
        client, model_name, export_dir, run_id, {}, export_key(run_id, 30), base_model=TINY_BASE_MODEL
    )

    policy = load_registered_policy(f"models:/{model_name}/{version.version}", tracking_uri=server.url)
    video = policy.predict([PROMPT], params=GENERATION)

    np.testing.assert_array_equal(video, generate(pipeline))
    assert not np.array_equal(video, generate(tiny_hunyuan15_pipeline()))


def test_a_registered_wan_policy_loads_back_on_the_base_model_its_export_names(
    client, model_name, run_id, server, tmp_path
):
    # seed 1: the base weights come from the recorded kwargs, not from the factory's default (seed 0).
    trained = tiny_wan(seed=1)
    add_lora(trained.transformer, LoraConfig(enabled=True, rank=4, alpha=8.0))
    perturb((param for param in trained.transformer.parameters() if param.requires_grad), scale=0.2)
    export_dir = export_lora(
        trained.transformer, tmp_path / "wan-lora", model=model_record("tiny-wan", kwargs={"seed": 1})
    )
    version = register_export(client, model_name, export_dir, run_id, {}, export_key(run_id, 40), base_model="tiny-wan")

    policy = load_registered_policy(f"models:/{model_name}/{version.version}", tracking_uri=server.url)
    video = policy.predict([PROMPT], params=GENERATION)

    size = {"height": trained.height, "width": trained.width, "num_frames": trained.num_frames}
    assert video.shape == (1, size["num_frames"], size["height"], size["width"], 3)
    np.testing.assert_array_equal(video, generate(trained.pipeline, **size))
    assert not np.array_equal(video, generate(tiny_wan(seed=1).pipeline, **size))


def test_artifacts_live_on_s3(client, model_name, trained, run_id, s3_artifacts):
    register(client, model_name, trained, run_id, step=11)
    endpoint_url, bucket = s3_artifacts

    keys = [item["Key"] for item in _s3(endpoint_url).list_objects_v2(Bucket=bucket)["Contents"]]

    assert any(key.startswith("mlflow/") and key.endswith(LORA_WEIGHT_NAME) for key in keys)


def test_tampered_artifacts_are_detected_at_load(client, model_name, trained, run_id, server, tmp_path):
    version = register(client, model_name, trained, run_id, step=12)
    uri = f"models:/{model_name}/{version.version}"
    sums_file = Path(
        mlflow.artifacts.download_artifacts(
            f"{client.get_logged_model(model_id(version)).artifact_location}/{MODEL_MANIFEST}",
            dst_path=str(tmp_path),
            tracking_uri=server.url,
        )
    )
    sums = json.loads(sums_file.read_text())
    [adapter_path] = [name for name in sums if name.endswith(LORA_WEIGHT_NAME)]
    forged = tmp_path / "forged"
    forged.mkdir()

    # Someone with write access to the bucket replaces the adapter...
    (forged / LORA_WEIGHT_NAME).write_bytes((trained[1] / LORA_WEIGHT_NAME).read_bytes()[:-1] + b" ")
    client.log_model_artifact(model_id(version), str(forged / LORA_WEIGHT_NAME), str(Path(adapter_path).parent))
    with pytest.raises(TamperedArtifactError, match=f"files changed since registration: \\['{adapter_path}'\\]"):
        load_registered_policy(uri, tracking_uri=server.url)

    # ... and rewrites the sha256 list to match: the digest in the registry still tells.
    sums[adapter_path] = hashlib.sha256((forged / LORA_WEIGHT_NAME).read_bytes()).hexdigest()
    (forged / MODEL_MANIFEST).write_text(json.dumps(sums))
    client.log_model_artifact(model_id(version), str(forged / MODEL_MANIFEST))
    with pytest.raises(TamperedArtifactError, match="not the one registered"):
        load_registered_policy(uri, tracking_uri=server.url)


def test_rerun_after_a_crash_between_create_and_alias_creates_no_second_version(
    client, model_name, trained, run_id, monkeypatch
):
    def crash(*args, **kwargs):
        raise RuntimeError("killed before the alias was set")

    with monkeypatch.context() as patch:
        patch.setattr(client, "set_registered_model_alias", crash)
        with pytest.raises(RuntimeError, match="killed"):
            register(client, model_name, trained, run_id, step=20, **{"eval/reward": 0.5})
    assert aliases(client, model_name) == {}

    version = register(client, model_name, trained, run_id, step=20, **{"eval/reward": 0.5})
    again = register(client, model_name, trained, run_id, step=20, **{"eval/reward": 0.5})

    assert len(client.search_model_versions(f"name = '{model_name}'")) == 1
    assert version.version == again.version and aliases(client, model_name) == {CHALLENGER: version.version}


def test_promotion_gate_moves_the_champion_only_past_the_margin_and_guards(client, model_name, trained, run_id):
    gate = {"primary_metric": "eval/reward", "min_improvement": 0.05, "guarded": {"eval/aesthetic": 0.1}}
    first = register(client, model_name, trained, run_id, step=1, **{"eval/reward": 0.5, "eval/aesthetic": 0.8})
    decision = promote(client, model_name, **gate)
    assert decision.promoted and decision.champion is None
    assert aliases(client, model_name)[CHAMPION] == first.version

    small_gain = register(client, model_name, trained, run_id, step=2, **{"eval/reward": 0.53, "eval/aesthetic": 0.8})
    decision = promote(client, model_name, **gate)
    assert not decision.promoted and "margin" in decision.reasons[0]
    assert client.get_model_version(model_name, small_gain.version).tags[DECISION_TAG].startswith("rejected:")

    uglier = register(client, model_name, trained, run_id, step=3, **{"eval/reward": 0.9, "eval/aesthetic": 0.6})
    decision = promote(client, model_name, **gate)
    assert not decision.promoted
    assert any("guarded eval/aesthetic" in reason and "> tolerance" in reason for reason in decision.reasons)
    assert "eval/aesthetic" in client.get_model_version(model_name, uglier.version).tags[DECISION_TAG]
    assert aliases(client, model_name)[CHAMPION] == first.version

    better = register(client, model_name, trained, run_id, step=4, **{"eval/reward": 0.9, "eval/aesthetic": 0.75})
    decision = promote(client, model_name, **gate)
    assert decision.promoted and decision.champion == first.version
    assert aliases(client, model_name) == {CHAMPION: better.version, CHALLENGER: better.version}

    rerun = promote(client, model_name, **gate)
    assert rerun.promoted and rerun.reasons == ["already the champion"]
    assert len(client.search_model_versions(f"name = '{model_name}'")) == 4


def test_a_version_comes_from_a_logged_model_of_its_run_that_lists_the_eval_metrics(
    client, model_name, trained, run_id, server, monkeypatch
):
    metrics = {"eval/reward": 0.5, "eval/aesthetic": 0.8}
    version = register(client, model_name, trained, run_id, step=5, **metrics)

    model = client.get_logged_model(model_id(version))
    linked = [metric for metric in model.metrics if metric.step == 5]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
    info = mlflow.models.get_model_info(f"models:/{model_name}/{version.version}")

    assert info.model_id == model.model_id and info.run_id == run_id and version.run_id == run_id
    assert model.source_run_id == run_id and str(model.status) == "READY"
    assert {metric.key: metric.value for metric in linked} == metrics
    assert {(metric.dataset_name, metric.dataset_digest) for metric in linked} == {("v1.jsonl", EXAM.digest)}
    assert model_id(version) in {output.model_id for output in client.get_run(run_id).outputs.model_outputs}
    assert (version.tags["eval_set.digest"], version.tags["eval_set.size"]) == (EXAM.digest, "16")


def test_the_gate_compares_only_versions_scored_on_the_same_evaluation_set(client, model_name, trained, run_id):
    champion = register(client, model_name, trained, run_id, step=1, **{"eval/reward": 0.5})
    assert promote(client, model_name).promoted
    assert (
        client.get_model_version(model_name, champion.version)
        .tags[DECISION_TAG]
        .endswith(f"[evaluation set sha256:{EXAM.digest} (16 prompts)]")
    )

    other_exam = EvalSet("0f" * 16, 16, "prompts-2026-12-02.txt (held-out split)")
    easier = register(client, model_name, trained, run_id, step=2, eval_set=other_exam, **{"eval/reward": 0.9})
    decision = promote(client, model_name)

    assert not decision.promoted and "not comparable" in decision.reasons[0]
    assert aliases(client, model_name)[CHAMPION] == champion.version
    recorded = client.get_model_version(model_name, easier.version).tags[DECISION_TAG]
    assert recorded.startswith("rejected:") and f"sha256:{other_exam.digest} (16 prompts)" in recorded


def test_a_set_below_the_minimum_is_refused_in_one_line_and_nothing_is_promoted(
    client, model_name, trained, run_id, server, capsys
):
    from sage_grpo.pipeline.cli import build_parser

    small = EvalSet("ab" * 16, 2, "prompts.txt (held-out split)")
    version = register(client, model_name, trained, run_id, step=1, eval_set=small, **{"eval/reward": 0.9})
    args = build_parser().parse_args(
        ["promote", "--tracking-uri", server.url, "--model", model_name, "--min-eval-prompts", "3"]
    )

    assert args.handler(args) == 0
    [line] = capsys.readouterr().out.splitlines()
    assert line == (
        f"did not promote {model_name} v{version.version} (no champion): its evaluation set has 2 prompts, fewer "
        f"than the minimum 3 [evaluation set sha256:{small.digest} (2 prompts)]"
    )
    assert CHAMPION not in aliases(client, model_name)
    assert promote(client, model_name, min_eval_prompts=2).promoted


def test_a_nan_metric_never_becomes_the_first_champion(client, model_name, trained, run_id):
    version = register(client, model_name, trained, run_id, step=1, **{"eval/reward": float("nan")})

    decision = promote(client, model_name)

    assert not decision.promoted and "not a number" in decision.reasons[0]
    assert CHAMPION not in aliases(client, model_name)
    assert client.get_model_version(model_name, version.version).tags[DECISION_TAG].startswith("rejected:")


def test_dry_run_changes_nothing(client, model_name, trained, run_id):
    version = register(client, model_name, trained, run_id, step=1, **{"eval/reward": 0.5})

    decision = promote(client, model_name, dry_run=True)

    assert decision.promoted and decision.dry_run and "would promote" in decision.summary()
    assert aliases(client, model_name) == {CHALLENGER: version.version}
    assert DECISION_TAG not in client.get_model_version(model_name, version.version).tags


def test_promote_cli_prints_the_decision_and_reports_unknown_models_as_user_errors(
    client, model_name, trained, run_id, server, capsys
):
    from sage_grpo.pipeline.cli import build_parser

    parser = build_parser()
    run = lambda *argv: (args := parser.parse_args(["promote", "--tracking-uri", server.url, *argv])).handler(args)
    register(client, model_name, trained, run_id, step=1, **{"eval/reward": 0.5, "eval/aesthetic": 0.8})

    assert run("--model", model_name, "--guard", "eval/aesthetic=0.1", "--margin", "0.01") == 0
    assert capsys.readouterr().out.startswith(f"promoted {model_name} v1 (no champion): first champion")

    with pytest.raises(UserError, match="does not exist"):
        run("--model", f"{model_name}-missing")
    with pytest.raises(UserError, match="version 7 does not exist"):
        run("--model", model_name, "--version", "7")
    with pytest.raises(UserError, match="METRIC=TOLERANCE"):
        run("--model", model_name, "--guard", "eval/aesthetic")


def test_promote_cli_takes_the_gate_and_tracking_server_from_a_run_config(
    client, model_name, trained, run_id, server, tmp_path, capsys
):
    import yaml

    from sage_grpo.pipeline.cli import build_parser

    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "data": {"source": "prompts.txt"},
                "tracking": {"tracking_uri": server.url},
                "registry": {"model_name": model_name, "margin": 0.2, "guards": {"eval/aesthetic": 0.1}},
            }
        )
    )
    parser = build_parser()
    run = lambda *argv: (args := parser.parse_args(["promote", "--config", str(config), *argv])).handler(args)
    champion = register(client, model_name, trained, run_id, step=1, **{"eval/reward": 0.5, "eval/aesthetic": 0.8})
    assert run() == 0  # no --model, no --tracking-uri: both from the config

    register(client, model_name, trained, run_id, step=2, **{"eval/reward": 0.6, "eval/aesthetic": 0.8})
    run()
    assert "did not promote" in capsys.readouterr().out.splitlines()[-1]
    assert "margin 0.2" in client.get_model_version(model_name, "2").tags[DECISION_TAG]

    register(client, model_name, trained, run_id, step=3, **{"eval/reward": 0.9, "eval/aesthetic": 0.6})
    run("--margin", "0.05")  # the flag wins over the config; the config's guard still applies
    assert "guarded eval/aesthetic" in client.get_model_version(model_name, "3").tags[DECISION_TAG]
    assert aliases(client, model_name)[CHAMPION] == champion.version

    with pytest.raises(UserError, match="needs --model"):
        config.write_text(yaml.safe_dump({"data": {"source": "prompts.txt"}}))
        run()


FRESH_LOAD = """
import hashlib, json, sys
import mlflow.pyfunc
policy = mlflow.pyfunc.load_model(sys.argv[1])
video = policy.predict([sys.argv[2]], params=json.loads(sys.argv[3]))
from sage_grpo import core
print(json.dumps({"core": core.__file__, "sha256": hashlib.sha256(video.tobytes()).hexdigest()}))
"""


def test_a_registered_model_carries_its_code_and_serving_requirements_and_loads_in_a_fresh_process(
    client, model_name, trained, run_id, server, tmp_path
):
    """What ``mlflow models serve`` needs: the code the pyfunc imports and its requirements, pinned (a real serve
    builds a virtualenv from them, too slow for this suite; the fresh interpreter stands in for the server). The
    requirements pin what serving imports, not the training stack."""
    import mlflow.artifacts

    from sage_grpo.core.registry import serving_requirements

    version = register(client, model_name, trained, run_id, step=30)
    source = client.get_model_version_download_uri(model_name, version.version)
    model_dir = Path(
        mlflow.artifacts.download_artifacts(source, dst_path=str(tmp_path / "model"), tracking_uri=server.url)
    )
    requirements = (model_dir / "requirements.txt").read_text().split()
    pinned = {line.split("==")[0]: line.split("==")[1] for line in requirements if "==" in line}
    assert pinned["torch"] == torch.__version__.split("+")[0] and {"diffusers", "peft"} <= set(pinned)
    assert not {"deepspeed", "boto3"} & set(pinned)  # serving needs no training stack
    assert set(serving_requirements()) <= set(requirements)
    assert "mlflow" in pinned  # MLflow adds itself
    code = model_dir / "code" / "sage_grpo" / "core"
    assert (code / "registry.py").read_text() == (Path(__file__).parents[2] / "core" / "registry.py").read_text()
    assert not list(code.rglob("__pycache__"))

    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", FRESH_LOAD, str(model_dir), PROMPT, json.dumps(GENERATION)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(loaded["core"]).resolve().is_relative_to((model_dir / "code").resolve())  # the logged code ran
    assert loaded["sha256"] == hashlib.sha256(generate(trained[0]).tobytes()).hexdigest()
