"""SageGRPORecipe in-process on the demo's model, made smaller (a world of one, gloo, a real ZeRO-3 engine; MLflow
off, which tests/integration covers): the loop runs its iterations through rollout, scoring, update, evaluation and
checkpoints, records the metrics docs/mlflow.md promises, and a run stopped by its time budget resumes into exactly
the metrics and weights of the run that never stopped."""

from __future__ import annotations

import gc
import json
import logging
import math
from logging.handlers import BufferingHandler
from pathlib import Path

import pytest

from sage_grpo.pipeline.config import RunConfig, load_run_config
from sage_grpo.pipeline.recipe import RunSummary, SageGRPORecipe
from tests.helpers import world_of_one

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
SMALL = [
    f"data.source={REPO / 'configs' / 'demo_prompts.txt'}",
    "model.kwargs={seed: 0, height: 16, width: 16, num_frames: 1}",
    "sde.steps=4",
    "rollout.group_size=2",
    "rollout.prompts_per_rank=2",
    "update.micro_batch_size=2",
    "trust_region.anchor_interval=2",
    "eval.every=2",
    "eval.num_prompts=2",
    "checkpoint.every=2",
    "run.max_iterations=3",
    "tracking.enabled=false",
]
# docs/mlflow.md, "Per iteration": the reward and its dimension, the update, seconds per stage and samples/s.
PROMISED = {
    "reward/mean",
    "reward/std",
    "reward/failed_samples",
    "reward/brightness/mean",
    "reward/brightness/std",
    "update/loss",
    "update/policy_loss",
    "update/position_kl",
    "update/velocity_kl",
    "update/lambda_kl",
    "update/grad_norm",
    "update/learning_rate",
    "update/equalizer_min",
    "update/equalizer_max",
    "update/logprob_mismatch",
    "update/grad_rms",
    "update/grad_rms_over_eps",
    "update/step_rms_per_lr",
    "update/zero_variance_groups",
    "update/first_micro_step/max_abs_ratio_minus_1",
    "update/first_micro_step/clip_fraction",
    "advantage/abs_mean",
    "time/rollout",
    "time/score",
    "time/update",
    "samples_per_second",
}
TIMING = ("time/", "samples_per_second", "mfu")  # the clock's, not the run's: they differ between any two runs


@pytest.fixture(scope="module", autouse=True)
def process_group():
    with world_of_one():
        yield


class Run:
    """One ``sagegrpo run`` in-process: its config, its summary and the lines it logged."""

    def __init__(self, output_dir: Path, *overrides: str, resume: str | None = None):
        self.config: RunConfig = load_run_config(DEMO, [*SMALL, f"run.output_dir={output_dir}", *overrides])
        gc.freeze()  # what the previous run imported (diffusers, the model) too: see world_of_one
        logged = BufferingHandler(capacity=10_000)
        logger = logging.getLogger("sage_grpo.pipeline.recipe")
        logger.addHandler(logged)
        level = logger.level
        logger.setLevel(logging.INFO)
        try:
            recipe = SageGRPORecipe(self.config)
            recipe.setup(resume=resume)
            self.summary: RunSummary = recipe.train()
        finally:
            logger.removeHandler(logged)
            logger.setLevel(level)
        self.lines = [record.getMessage() for record in logged.buffer]

    @property
    def header(self) -> str:
        return next(line for line in self.lines if line.startswith(f"run {self.config.run.name}:"))

    def audit(self) -> list[dict]:
        path = self.config.output_dir / "audit" / "rank-0.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    def committed(self) -> list[int]:
        return self.config.checkpoint.build(self.config.output_dir).list_steps()


def trained(history: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{key: value for key, value in metrics.items() if not key.startswith(TIMING)} for metrics in history]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Run:
    return Run(tmp_path_factory.mktemp("straight"))


def test_the_loop_runs_its_iterations_and_records_the_promised_metrics(straight):
    summary, history = straight.summary, straight.summary.history

    assert (summary.status, summary.exit_code, summary.iterations) == ("completed", 0, 3)
    assert [metrics["iteration"] for metrics in history] == [1, 2, 3]
    for metrics in history:
        assert metrics.keys() >= PROMISED, sorted(PROMISED - metrics.keys())
        assert all(math.isfinite(value) for value in metrics.values())
    assert ["eval/reward" in metrics for metrics in history] == [False, True, False]  # eval.every=2
    assert any(metrics["update/grad_norm"] > 0 for metrics in history)  # it trained
    assert history[1]["update/anchor_refreshes"] == 1  # trust_region.anchor_interval=2
    # One line per iteration for the person watching, after the header that says what will run.
    assert straight.header.endswith("iterations 1..3 (from the start)")
    assert ": 1 data-parallel rank(s) x " in straight.header
    shown = [line for line in straight.lines if line.startswith("iteration ")]
    expected = ["iteration 0 (before training)", "iteration 1", "iteration 2", "iteration 3"]
    assert [line.split(":")[0] for line in shown] == expected
    assert "eval/reward=" in shown[0] and "reward/mean=" in shown[1] and "eval/reward=" in shown[2]
    # Evaluated at the start (eval.at_start) and paired against it at iteration 2: its delta and standard error.
    assert history[1]["eval/reward/delta"] == pytest.approx(
        history[1]["eval/reward"] - float(shown[0].split("=")[-1]), abs=1e-3
    )
    assert history[1]["eval/reward/delta_se"] >= 0


def test_the_loop_checkpoints_when_due_and_at_the_end_and_a_completed_run_is_exported(straight):
    out = straight.config.output_dir

    assert straight.committed() == [2, 3]  # every 2, and the last iteration
    assert straight.summary.checkpoint == str(out / "checkpoints")
    assert straight.summary.export_dir == out / "exports" / "step-3" and any(straight.summary.export_dir.iterdir())
    assert any((out / "eval" / "iteration-00002").iterdir())
    assert {path.name for path in (out / "plots").iterdir()} >= {"reward_curves.png", "kl_lambda.png"}
    audit = straight.audit()
    assert [record["iteration"] for record in audit if "prompt_ids" in record] == [1, 2, 3]
    assert audit[-1]["status"] == "completed" and len(audit[-1]["weights_sha256"]) == 64


def test_a_run_out_of_time_checkpoints_and_resumes_into_the_same_run(straight, tmp_path):
    stopped = Run(tmp_path, "run.time_budget_minutes=1e-9")  # out of time after its first iteration

    assert (stopped.summary.status, stopped.summary.exit_code, stopped.summary.iterations) == ("time_budget", 75, 1)
    assert stopped.committed() == [1] and stopped.summary.export_dir is None

    resumed = Run(tmp_path, resume="auto")  # the time budget may change on resume; nothing else did

    assert resumed.header.endswith("iterations 2..3 (resuming after iteration 1)")
    assert resumed.summary.status == "completed" and resumed.committed() == [2, 3]
    # The history came back with the checkpoint; the iterations after it are the straight run's, bit for bit.
    assert trained(resumed.summary.history) == trained(straight.summary.history)
    trained_on = [(r["iteration"], r["prompt_ids"]) for r in resumed.audit() if "prompt_ids" in r]
    assert trained_on == [(r["iteration"], r["prompt_ids"]) for r in straight.audit() if "prompt_ids" in r]
    assert resumed.audit()[-1]["weights_sha256"] == straight.audit()[-1]["weights_sha256"]
