"""The promotion gate compares like with like, against a real ``mlflow server``: versions evaluated by different
definitions (rewards, weights, kwargs, judges, prompt set, seed, sampler settings) are refused in one line and
``promote`` exits 2; with one definition it can gate on a judge. Versions are created with the tags a registration
writes (the gate reads nothing else), so no model is logged."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
from mlflow import MlflowClient

from sage_grpo.core.registry import CHALLENGER, CHAMPION, DECISION_TAG, METRIC_TAG_PREFIX, EvalSet, promote
from sage_grpo.pipeline.config import load_run_config
from sage_grpo.stages.evaluate import eval_definition, eval_sampler
from tests.integration.pipeline_runs import DEMO, environment

pytestmark = pytest.mark.integration

EXAM = "6f1d0c3a9b8e7d6c5b4a39281706f5e4"
BRIGHTNESS = ("b1" * 16, "rewards brightness; judges user_rewards.judges:Contrast; seed 1234")
COLORFULNESS = ("c2" * 16, "rewards colorfulness; judges user_rewards.judges:Contrast; seed 1234")


@pytest.fixture
def registry(mlflow_server):
    """A new registered model; ``challenger(definition, **metrics)`` adds a version as the challenger."""
    client = MlflowClient(mlflow_server.url)
    name = f"gate-{uuid.uuid4().hex[:8]}"
    client.create_registered_model(name)

    def challenger(definition: tuple[str, str] | None, **metrics: float) -> str:
        exam = EvalSet(EXAM, 8, "s3://evals/v1.jsonl", *(definition or ("", "")))
        tags = {f"{METRIC_TAG_PREFIX}{key.replace('__', '/')}": repr(value) for key, value in metrics.items()}
        version = client.create_model_version(name, "s3://nowhere/model", tags=tags | exam.tags()).version
        client.set_registered_model_alias(name, CHALLENGER, version)
        return version

    return client, name, challenger


def _promote_command(url: str, name: str, *options: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "sage_grpo.pipeline.cli", "promote", "--tracking-uri", url, "--model", name]
    return subprocess.run([*command, *options], env=environment(), capture_output=True, text=True, timeout=120)


def test_versions_evaluated_by_different_definitions_are_refused_in_one_line(registry, mlflow_server):
    client, name, challenger = registry
    first = challenger(BRIGHTNESS, eval__reward=-0.55, eval__judge__contrast=0.1122)
    assert promote(client, name).promoted
    # The story: another reward scores higher on its own scale; the one metric both compute fell.
    other = challenger(COLORFULNESS, eval__reward=0.07, eval__judge__contrast=0.1117)

    result = _promote_command(mlflow_server.url, name)
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = result.stdout.splitlines()
    assert line.startswith(f"did not promote {name} v{other} (champion v{first}): champion v{first} was evaluated by ")
    assert f"definition {BRIGHTNESS[0][:12]} ({BRIGHTNESS[1]})" in line
    assert f"this version by definition {COLORFULNESS[0][:12]} ({COLORFULNESS[1]})" in line
    assert "different evaluation definitions, not comparable" in line
    assert dict(client.get_registered_model(name).aliases)[CHAMPION] == first
    assert client.get_model_version(name, other).tags[DECISION_TAG].startswith("rejected: champion")


def test_versions_sampled_with_other_steps_are_refused(registry, mlflow_server):
    """Same rewards, judges, prompts and seed; the challenger's evaluation videos were sampled in 4 steps, the
    champion's in 8 (``eval_sampler`` in the digest)."""
    client, name, challenger = registry
    eight, four = (_demo_definition(f"sde.steps={steps}") for steps in (8, 4))
    first = challenger(eight, eval__reward=-0.55)
    assert promote(client, name).promoted
    other = challenger(four, eval__reward=-0.50)

    result = _promote_command(mlflow_server.url, name)
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = result.stdout.splitlines()
    assert f"evaluated by definition {eight[0][:12]} ({eight[1]}), this version by definition {four[0][:12]}" in line
    assert eight[1].endswith("; ode steps 8, shift 3, guidance_scale 1") and four[1].endswith(
        "ode steps 4, shift 3, guidance_scale 1"
    )
    assert "different evaluation definitions, not comparable" in line
    assert dict(client.get_registered_model(name).aliases)[CHAMPION] == first != other


def _demo_definition(*overrides: str) -> tuple[str, str]:
    config = load_run_config(DEMO, list(overrides))
    sampler = eval_sampler(config.sde, config.model.guidance_scale, config.model.guidance_scale_2)
    return eval_definition(config.rewards, config.eval, EXAM, sampler)


def test_a_version_or_champion_without_a_recorded_definition_is_not_compared(registry):
    client, name, challenger = registry
    challenger(None, eval__reward=0.1)
    assert promote(client, name).promoted  # a first champion has nothing to be compared with
    challenger(BRIGHTNESS, eval__reward=0.9)
    decision = promote(client, name)
    assert not decision.promoted and not decision.comparable
    assert "evaluated by no recorded evaluation definition" in decision.reasons[0]


def test_with_one_definition_the_gate_can_gate_on_a_judge(registry, mlflow_server):
    client, name, challenger = registry
    first = challenger(BRIGHTNESS, eval__reward=-0.58, eval__judge__contrast=0.109)
    assert promote(client, name).promoted
    judged = ("--primary-metric", "eval/judge/contrast", "--margin", "0.001")

    # Brighter (a higher reward) but washed out: the judge fell, so it is rejected, a verdict (exit 0).
    hacked = challenger(BRIGHTNESS, eval__reward=-0.47, eval__judge__contrast=0.090)
    result = _promote_command(mlflow_server.url, name, *judged)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "eval/judge/contrast 0.09 vs 0.109: gain -0.019 <= margin 0.001" in result.stdout
    assert dict(client.get_registered_model(name).aliases)[CHAMPION] == first

    # Or as a guard beside the reward.
    decision = promote(client, name, version=hacked, guarded={"eval/judge/contrast": 0.005})
    assert not decision.promoted and decision.comparable
    assert "guarded eval/judge/contrast 0.09 vs 0.109: drop 0.019 > tolerance 0.005" in decision.reasons

    better = challenger(BRIGHTNESS, eval__reward=-0.57, eval__judge__contrast=0.115)
    result = _promote_command(mlflow_server.url, name, *judged)
    assert result.returncode == 0 and result.stdout.startswith(f"promoted {name} v{better}")
    assert dict(client.get_registered_model(name).aliases)[CHAMPION] == better
