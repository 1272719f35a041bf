"""The scheduled job end to end on the tiny model, as cron runs it: ``python -m sage_grpo.pipeline.cli schedule`` with a
PATH that lacks the venv, the tracking server given as an override, against a real ``mlflow server`` and a local
checkpoint root, on two days. Each day trains a run on that day's prompt set, the run
registers its policy as the challenger, and the promote step gates it with the config's registry settings.

Day one has no champion, so its version becomes the champion. Day two's outcome is known in advance: the demo's
brightness reward lies in [-1, 0], so no gain can exceed the config's margin of 1 and the challenger is rejected,
with the config's margin in the recorded decision (the promote command line's default would be 0). Both days are
scored on the config's fixed evaluation set (``eval.source``), not on their own prompt files' held-out splits, and
the decision names that set."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import yaml
from mlflow import MlflowClient

from sage_grpo.core.registry import CHALLENGER, CHAMPION, DECISION_TAG, load_registered_policy
from tests.integration.pipeline_runs import DEMO, REPO, environment

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "t2v-scheduled"
MARGIN = 1.0  # larger than any gain of a reward in [-1, 0]
DAYS = ("2026-12-01", "2026-12-02")
EXAM_SIZE = 3


@pytest.fixture
def scheduled(tmp_path, mlflow_server):
    """Prompts location, checkpoint root and work dir of a scheduled job, and the command that starts it."""
    config = yaml.safe_load(DEMO.read_text())
    config["run"]["max_iterations"] = 2
    config["sde"]["steps"] = 4
    config["rollout"] = {"group_size": 2, "prompts_per_rank": 2}
    config["update"]["micro_batch_size"] = 2
    prompts = (REPO / "configs" / "demo_prompts.txt").read_text().splitlines()
    exam = tmp_path / "eval-v1.txt"
    exam.write_text("\n".join(prompts[-EXAM_SIZE:]) + "\n")
    config["eval"] = {"every": 2, "write_videos": 0, "source": str(exam)}
    config["checkpoint"] = {"every": 2, "keep_last": 2}
    config["trust_region"]["anchor_interval"] = 2
    config["registry"] = {"margin": MARGIN, "min_eval_prompts": EXAM_SIZE}
    config_path = tmp_path / "scheduled.yaml"
    config_path.write_text(yaml.safe_dump(config))

    prompt_dir = tmp_path / "prompts"
    prompt_dir.mkdir()
    (prompt_dir / f"{DAYS[0]}.txt").write_text("\n".join(prompts[:12]) + "\n")  # day two's set is added later
    root, work, cwd = tmp_path / "scheduled", tmp_path / "work", tmp_path / "cwd"
    cwd.mkdir()

    def start(day: str) -> subprocess.CompletedProcess:
        command = [
            sys.executable,
            "-m",
            "sage_grpo.pipeline.cli",
            "schedule",
            str(config_path),
            f"tracking.tracking_uri={mlflow_server.url}",  # train and promote alike must use it
            "--prompts",
            str(prompt_dir),
            "--checkpoint-root",
            str(root),
            "--model",
            MODEL,
            "--work-dir",
            str(work),
            "--nproc-per-node",
            "1",
            "--date",
            day,
        ]
        env = environment(PATH="/usr/bin:/bin")  # as under cron: the steps find nothing of the venv on PATH
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)

    return start, prompt_dir, prompts, root, work, cwd


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    return result.stdout


def _metric(version, name: str = "eval/reward") -> float:
    return float(version.tags[f"metric.{name}"])


def test_scheduled_job_trains_registers_and_promotes_only_a_better_challenger(scheduled, mlflow_server):
    start, prompt_dir, prompts, root, work, cwd = scheduled
    client = MlflowClient(mlflow_server.url)

    # Day one: train on the only prompt set, register, and promote the first champion.
    _ok(start(DAYS[0]))
    [first] = client.search_model_versions(f"name = '{MODEL}'")
    assert math.isfinite(_metric(first))
    assert dict(client.get_registered_model(MODEL).aliases) == {CHALLENGER: first.version, CHAMPION: first.version}
    assert first.tags[DECISION_TAG].startswith("promoted: first champion")
    assert {"train.done", "promote.done"} <= {p.name for p in (root / f"sage-{DAYS[0]}" / "schedule").iterdir()}
    assert (work / f"sage-{DAYS[0]}" / "exports" / "step-2" / "export.json").is_file()
    assert list(cwd.iterdir()) == []  # no ./mlflow.db: promote used the same server as training

    # Day two: a new prompt set, a new run, a new challenger that cannot beat the champion by the margin.
    (prompt_dir / f"{DAYS[1]}.txt").write_text("\n".join(prompts[8:]) + "\n")
    _ok(start(DAYS[1]))
    second = next(v for v in client.search_model_versions(f"name = '{MODEL}'") if v.version != first.version)
    second = client.get_model_version(MODEL, second.version)
    assert second.run_id != first.run_id
    assert dict(client.get_registered_model(MODEL).aliases) == {CHALLENGER: second.version, CHAMPION: first.version}
    gain = _metric(second) - _metric(first)
    digest = first.tags["eval_set.digest"]
    assert (second.tags["eval_set.digest"], second.tags["eval_set.size"]) == (digest, str(EXAM_SIZE))
    assert second.tags[DECISION_TAG] == (
        f"rejected: eval/reward {_metric(second):.4g} vs {_metric(first):.4g}: gain {gain:+.4g} <= margin {MARGIN:g}"
        f" [evaluation set sha256:{digest} ({EXAM_SIZE} prompts)]"
    )

    # Starting again the same day trains nothing and registers nothing.
    assert "schedule: skip" in _ok(start(DAYS[1]))
    assert len(client.search_model_versions(f"name = '{MODEL}'")) == 2

    # The champion is inference-ready: it loads back from the registry and generates a video.
    policy = load_registered_policy(f"models:/{MODEL}@{CHAMPION}", tracking_uri=mlflow_server.url)
    video = policy.predict(["a red fox runs through snow"], params={"num_inference_steps": 2, "seed": 0})
    assert video.dtype == np.uint8 and video.shape[0] == 1
