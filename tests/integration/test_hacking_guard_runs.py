"""The hacking guard on real runs of the shortened demo (tiny HunyuanVideo 1.5, CPU): trained on brightness toward
white at a high learning rate, the policy washes its videos out, and a contrast judge (what the user wants beside
brightness) falls while the reward rises. Unguarded (eval.guard.action=warn, same settings, 16 iterations, measured
2026-12-06) the judge fell from its best 0.1094 at iteration 4 to 0.0903 at iteration 16 (-0.019) while eval/reward
rose from -0.580 to -0.473. The guard must stop that run before the judge has fallen by more than JUDGE_DROP_BOUND
from its best, export the best-by-judge step, and register nothing; on a run whose reward and judge rise together it
must never fire."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from tests.integration.pipeline_runs import CONTRAST_JUDGE, HACKING, metric_history, only_run_id, run_sagegrpo

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JUDGE_DROP_BOUND = 0.005  # contrast (luma std in [0, 1]), ~5% of its starting 0.108
HACKING_STOP_EXIT_CODE = 3
GUARDED = [*HACKING, "eval.guard.action=stop"]


def _tracking_uri(output_dir) -> str:
    return f"sqlite:///{output_dir}/mlflow.db"  # the demo's embedded store, under run.output_dir


def test_the_guard_stops_a_hacking_run_before_its_judge_falls_far_and_exports_the_best_by_judge(tmp_path):
    result = run_sagegrpo(
        tmp_path,
        *GUARDED,
        "run.max_iterations=16",
        CONTRAST_JUDGE,
        "checkpoint.best_metric=eval/judge/contrast",
    )
    assert result.returncode == HACKING_STOP_EXIT_CODE, result.stderr[-4000:]
    assert "sage-grpo: hacking after" in result.stdout and "nothing registered" in result.stdout
    assert "hacking guard: stop at iteration" in result.stderr

    uri = _tracking_uri(tmp_path)
    run_id = only_run_id(uri)
    [(fired_at, _)] = metric_history(uri, run_id, "guard/fired")
    judge = dict(metric_history(uri, run_id, "eval/judge/contrast"))
    reward = dict(metric_history(uri, run_id, "eval/reward"))
    assert max(judge) == fired_at < 16  # it stopped where it fired, long before the end
    assert reward[fired_at] > reward[min(reward)]  # the reward was rising...
    best_step = max(judge, key=judge.get)
    assert judge[fired_at] < judge[best_step]  # ...while the judge fell, but not far:
    assert judge[best_step] - judge[fired_at] <= JUDGE_DROP_BOUND

    # The best step by the judge is restored and exported; the hacked policy is neither exported nor registered.
    exports = sorted(path.name for path in (tmp_path / "exports").iterdir())
    assert exports == [f"best-by-judge-step-{best_step}"]
    assert json.loads((tmp_path / "exports" / exports[0] / "export.json").read_text())
    tags = MlflowClient(uri).get_run(run_id).data.tags
    assert tags["hacking_guard.best_step"] == str(best_step)
    assert tags["hacking_guard"].startswith(f"stop at iteration {fired_at}: ")

    # A restart of the stopped run stays stopped: no further training.
    again = run_sagegrpo(
        tmp_path,
        *GUARDED,
        "run.max_iterations=16",
        CONTRAST_JUDGE,
        "checkpoint.best_metric=eval/judge/contrast",
        flags=("--resume", "auto"),
    )
    assert again.returncode == HACKING_STOP_EXIT_CODE, again.stderr[-4000:]
    assert f"hacking after {fired_at} iteration(s)" in again.stdout


def test_a_run_whose_reward_and_judge_rise_together_is_never_stopped(tmp_path):
    result = run_sagegrpo(
        tmp_path,
        *GUARDED,
        "run.max_iterations=8",
        "eval.judges=[{name: brightness, kwargs: {target: 0.75}}]",  # agrees with brightness toward 1 below 0.75
        "checkpoint.best_metric=eval/judge/brightness",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "sage-grpo: completed after 8 iteration(s)" in result.stdout
    uri = _tracking_uri(tmp_path)
    run_id = only_run_id(uri)
    judge = [value for _, value in metric_history(uri, run_id, "eval/judge/brightness")]
    reward = [value for _, value in metric_history(uri, run_id, "eval/reward")]
    assert len(judge) == 5 and judge[-1] > judge[0] and reward[-1] > reward[0]  # iteration 0, then every 2
    assert metric_history(uri, run_id, "guard/fired") == []
    assert "hacking guard" not in result.stderr
