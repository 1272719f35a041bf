"""The hacking guard: its divergence signal against closed-form values, its reading of a run's history, the KL
controllers' tightening, and the config it needs to stop a run."""

from pathlib import Path

import pytest

from sage_grpo.core.errors import UserError
from sage_grpo.core.grpo import AdaptiveKLController, GradientRatioController
from sage_grpo.core.hacking_guard import divergence, fitted_change
from sage_grpo.pipeline.config import load_run_config
from sage_grpo.stages.evaluate import GUARD_FIRED, HackingGuardConfig, hacking_divergence

pytestmark = pytest.mark.unit

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def test_fitted_change_of_a_line_is_its_first_to_last_difference():
    assert fitted_change([2.0, 2.5, 3.0, 3.5, 4.0]) == pytest.approx(2.0)
    assert fitted_change([1.0, -1.0]) == pytest.approx(-2.0)


def test_fitted_change_reads_every_point_not_the_ends():
    # Least squares on 0..3: slope = sum((i - 1.5)(v - 2.5)) / sum((i - 1.5)^2) = 3 / 5; change 3 x 0.6 = 1.8.
    assert fitted_change([1.0, 4.0, 1.0, 4.0]) == pytest.approx(1.8)
    assert fitted_change([0.0, 1.0, 0.0]) == pytest.approx(0.0)


def test_fires_when_the_reward_rises_and_a_judge_falls_over_the_window():
    found = divergence(
        [0.0, 0.1, 0.2], {"eval/judge/contrast": [1.0, 0.9, 0.8]}, window=3, min_reward_rise=0.1, min_judge_drop=0.1
    )
    assert found is not None and found.judge == "eval/judge/contrast"
    assert (found.reward_change, found.judge_change) == pytest.approx((0.2, -0.2))
    assert "rose by +0.2" in found.described() and "changed by -0.2" in found.described()


@pytest.mark.parametrize(
    "rewards,judge",
    [
        ([0.0, 0.1, 0.2], [0.5, 0.6, 0.7]),  # both rise: the judge agrees
        ([0.2, 0.1, 0.0], [1.0, 0.9, 0.8]),  # both fall: not hacking, just a bad stretch
        ([0.0, 0.05, 0.1], [1.0, 0.9, 0.8]),  # reward rise 0.1 does not exceed min_reward_rise 0.1
        ([0.0, 0.1, 0.2], [1.0, 0.95, 0.9]),  # judge fall 0.1 does not exceed min_judge_drop 0.1
        ([0.0, 0.2], [1.0, 0.8]),  # two evaluations: the window of 3 is not full yet
        ([0.0, float("nan"), 0.2], [1.0, 0.9, 0.8]),  # no trend through a missing evaluation
    ],
)
def test_does_not_fire(rewards, judge):
    assert divergence(rewards, {"j": judge}, window=3, min_reward_rise=0.1, min_judge_drop=0.1) is None


def test_reads_only_the_last_window_and_names_the_judge_that_fell_furthest():
    rewards = [0.5, 0.0, 0.0, 0.1, 0.2]  # the early fall is outside the window
    judges = {"a": [9.0, 1.0, 1.0, 0.9, 0.8], "b": [0.0, 1.0, 1.0, 0.5, 0.0], "c": [0.0, 0.0, 0.1, 0.2, 0.3]}
    found = divergence(rewards, judges, window=3, min_reward_rise=0.0, min_judge_drop=0.0)
    assert found.judge == "b" and found.judge_change == pytest.approx(-1.0)


def test_the_history_reading_starts_after_the_guard_last_fired():
    guard = HackingGuardConfig(window=2)
    rising_reward_falling_judge = [
        {"iteration": i, "eval/reward": 0.1 * i, "eval/judge/contrast": 1.0 - 0.1 * i} for i in range(1, 4)
    ]
    training_only = {"iteration": 9, "reward/mean": 5.0}  # iterations without an evaluation are not points
    history = [rising_reward_falling_judge[0], training_only, rising_reward_falling_judge[1]]
    assert hacking_divergence(history, guard).judge == "eval/judge/contrast"
    history[-1] = {**history[-1], GUARD_FIRED: 1.0}
    assert hacking_divergence(history, guard) is None  # it acted on this episode
    assert hacking_divergence([*history, rising_reward_falling_judge[2]], guard) is None  # one point is no window
    assert hacking_divergence([*history, *rising_reward_falling_judge[1:]], guard) is not None


def test_it_watches_only_the_judge_dimensions_named():
    """ToyWorld's gold judge also counts static squares: that count falls as a run learns to move them, which is
    not a judge falling."""
    improving = [
        {"iteration": i, "eval/reward": 0.1 * i, "eval/judge/gold": 0.1 * i, "eval/judge/static": 1.0 - 0.1 * i}
        for i in range(1, 4)
    ]
    assert hacking_divergence(improving, HackingGuardConfig()).judge == "eval/judge/static"
    assert hacking_divergence(improving, HackingGuardConfig(judges=["gold"])) is None
    with pytest.raises(UserError, match=r"^eval.guard.judges names gld, which no judge reports \(they report: gold, "):
        hacking_divergence(improving, HackingGuardConfig(judges=["gld"]))


def test_a_tightened_gradient_ratio_controller_holds_factor_times_the_ratio():
    def controller():
        return GradientRatioController(initial=0.1, minimum=1e-4, maximum=100.0, target=0.003, history=1)

    plain, tight = controller(), controller()
    tight.tighten(2.0)
    assert tight.value == pytest.approx(0.2)
    # gain r / lambda = 0.06 for both: lambda = target x strength / gain.
    assert plain.update(0.0, 0.006) == pytest.approx(0.05)
    assert tight.update(0.0, 0.012) == pytest.approx(0.1)


def test_a_tightened_kl_controller_targets_a_smaller_kl_from_a_larger_lambda():
    def controller():
        return AdaptiveKLController(initial=1e-3, maximum=1.0, warmup_steps=0, history=1, target=1e-3)

    plain, tight = controller(), controller()
    tight.tighten(2.0)
    # KL 1.2e-3 is within [0.5, 1.5] x 1e-3 (unchanged) but above 1.5 x 5e-4 (tightened: x 1.1).
    assert plain.update(1.2e-3) == pytest.approx(1e-3)
    assert tight.update(1.2e-3) == pytest.approx(2e-3 * 1.1)


def test_tightening_survives_a_checkpoint():
    tight = GradientRatioController(initial=0.1, minimum=1e-4, maximum=100.0, target=0.003, history=1)
    tight.tighten(4.0)
    restored = GradientRatioController(initial=0.1, minimum=1e-4, maximum=100.0, target=0.003, history=1)
    restored.load_state_dict(tight.state_dict())
    assert restored.update(0.0, 0.024) == pytest.approx(tight.update(0.0, 0.024)) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="> 1"):
        tight.tighten(0.5)


JUDGE = "eval.judges=[{name: 'tests.fixtures.user_rewards.judges:Contrast'}]"


def test_a_guard_that_stops_needs_the_best_judge_step_kept():
    with pytest.raises(UserError, match="checkpoint.best_metric=eval/judge/") as error:
        load_run_config(DEMO, [JUDGE, "eval.guard.action=stop"])
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="eval.every=4 must be a multiple of checkpoint.every=3"):
        load_run_config(
            DEMO, [JUDGE, "eval.guard.action=stop", "checkpoint.best_metric=eval/judge/contrast", "checkpoint.every=3"]
        )
    config = load_run_config(DEMO, [JUDGE, "eval.guard.action=stop", "checkpoint.best_metric=eval/judge/contrast"])
    assert config.eval.judges[0].name.endswith(":Contrast")
