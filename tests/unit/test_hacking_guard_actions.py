"""What the recipe does when the hacking guard fires (``SageGRPORecipe._guard``), on a real config, KL controller and
(disabled) tracker: it marks the iteration, tightens the trust region or asks to stop, once per episode."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from sage_grpo.core.tracking import Tracker
from sage_grpo.pipeline.config import load_run_config
from sage_grpo.pipeline.recipe import Progress, SageGRPORecipe
from sage_grpo.stages.evaluate import GUARD_FIRED

pytestmark = pytest.mark.unit

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
JUDGE = "eval.judges=[{name: 'tests.fixtures.user_rewards.judges:Contrast'}]"


def recipe(tmp_path, action: str) -> SageGRPORecipe:
    overrides = [JUDGE, f"eval.guard.action={action}", "eval.guard.window=2", f"run.output_dir={tmp_path}"]
    if action == "stop":
        overrides.append("checkpoint.best_metric=eval/judge/contrast")
    config = load_run_config(DEMO, overrides)
    made = SageGRPORecipe(config)
    made.progress = Progress(iteration=4, history=[{"iteration": 2, "eval/reward": -0.6, "eval/judge/contrast": 0.11}])
    made.eval_judges = object()  # judges are configured; _guard reads only their scores in the metrics
    made.policy = SimpleNamespace(updater=SimpleNamespace(controller=config.trust_region.controller()))
    made.tracker = Tracker(config.tracking.model_copy(update={"enabled": False}), tmp_path)
    return made


HACKED = {"iteration": 4, "eval/reward": -0.5, "eval/judge/contrast": 0.10}


def test_tighten_doubles_the_kl_weight_once_per_episode(tmp_path):
    guarded = recipe(tmp_path, "tighten")
    before = guarded.policy.updater.controller.value
    metrics = dict(HACKED)
    assert guarded._guard(metrics) is False  # the run goes on
    assert metrics[GUARD_FIRED] == 1.0
    assert guarded.policy.updater.controller.value == pytest.approx(2 * before)
    assert guarded.policy.updater.controller.strength == 2.0
    guarded.progress.history.append(metrics)
    assert guarded._guard({"iteration": 6, "eval/reward": -0.4, "eval/judge/contrast": 0.09}) is False
    assert guarded.policy.updater.controller.strength == 2.0  # one point since it acted: no window yet


@pytest.mark.parametrize("action, stops", [("stop", True), ("warn", False), ("disabled", False)])
def test_stop_asks_the_loop_to_stop_and_warn_or_off_do_not(tmp_path, action, stops):
    guarded = recipe(tmp_path, action)
    metrics = dict(HACKED)
    assert guarded._guard(metrics) is stops
    assert (GUARD_FIRED in metrics) is (action != "disabled")
    assert guarded.policy.updater.controller.strength == 1.0


def test_the_guard_reads_the_start_evaluation_as_its_first_point(tmp_path):
    """With eval.at_start the untrained policy's evaluation is the guard's baseline: one later evaluation that hacks
    is already a trend of two points (window 2), where without it the guard would have nothing to compare."""
    guarded = recipe(tmp_path, "warn")
    guarded.progress = Progress(iteration=2)
    metrics = dict(HACKED)
    assert guarded._guard(metrics) is False and GUARD_FIRED not in metrics  # no baseline: one point, no trend
    guarded.progress.start_eval = {"metrics": {"eval/reward": -0.6, "eval/judge/contrast": 0.11}, "scores": {}}
    assert guarded._guard(metrics) is False and metrics[GUARD_FIRED] == 1.0
