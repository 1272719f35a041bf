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

import numpy as np
import pytest
from mlflow import MlflowClient

from sage_grpo.core.registry import CHALLENGER, CHAMPION, DECISION_TAG, load_registered_policy
from tests.integration.scheduled_jobs import DAYS, PROMPTS, ScheduledJob, scheduled_job, succeeded

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "t2v-scheduled"
MARGIN = 1.0  # larger than any gain of a reward in [-1, 0]
EXAM_SIZE = 3


@pytest.fixture
def scheduled(tmp_path, mlflow_server) -> ScheduledJob:
    return scheduled_job(
        tmp_path,
        mlflow_server.url,
        MODEL,
        exam_size=EXAM_SIZE,
        run={"max_iterations": 2},
        registry={"margin": MARGIN},
    )


def _start(job: ScheduledJob, day: str) -> str:
    return succeeded(job.start(day, flags=("--nproc-per-node", "1")))


def _metric(version, name: str = "eval/reward") -> float:
    return float(version.tags[f"metric.{name}"])


def test_scheduled_job_trains_registers_and_promotes_only_a_better_challenger(scheduled, mlflow_server):
    client = MlflowClient(mlflow_server.url)

    # Day one: train on the only prompt set, register, and promote the first champion.
    _start(scheduled, DAYS[0])
    [first] = client.search_model_versions(f"name = '{MODEL}'")
    assert math.isfinite(_metric(first))
    assert dict(client.get_registered_model(MODEL).aliases) == {CHALLENGER: first.version, CHAMPION: first.version}
    assert first.tags[DECISION_TAG].startswith("promoted: first champion")
    assert {"train.done", "promote.done"} <= {
        p.name for p in (scheduled.root / f"sage-{DAYS[0]}" / "schedule").iterdir()
    }
    assert (scheduled.work / f"sage-{DAYS[0]}" / "exports" / "step-2" / "export.json").is_file()
    assert list(scheduled.cwd.iterdir()) == []  # no ./mlflow.db: promote used the same server as training

    # Day two: a new prompt set, a new run, a new challenger that cannot beat the champion by the margin.
    scheduled.add_day(DAYS[1], PROMPTS[8:])
    _start(scheduled, DAYS[1])
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
    assert "schedule: skip" in _start(scheduled, DAYS[1])
    assert len(client.search_model_versions(f"name = '{MODEL}'")) == 2

    # The champion is inference-ready: it loads back from the registry and generates a video.
    policy = load_registered_policy(f"models:/{MODEL}@{CHAMPION}", tracking_uri=mlflow_server.url)
    video = policy.predict(["a red fox runs through snow"], params={"num_inference_steps": 2, "seed": 0})
    assert video.dtype == np.uint8 and video.shape[0] == 1
