"""Preflight's one-update reward change: the paired per-sample differences (after - before) of the first batch,
re-sampled with its own noise after the first update, judged as mean +- se; it fails when the mean is below -2 se
(tests/integration/test_preflight.py runs the whole command, with a model whose update lowers the reward)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from sage_grpo.core.distributed import ParallelLayout
from sage_grpo.pipeline.preflight import REWARD_CHANGE, _reward_differences, reward_change_check
from sage_grpo.stages.score import ScoredBatch

pytestmark = pytest.mark.unit


def test_a_rise_passes_with_the_closed_form_mean_and_standard_error():
    check = reward_change_check([1.0, 2.0, 3.0, 4.0])
    # mean 2.5; sample std sqrt(5/3) = 1.291; se = 1.291 / sqrt(4) = 0.645
    assert (check.name, check.passed) == (REWARD_CHANGE, True)
    assert check.detail.startswith("one update changes the reward by +2.5 +- 0.65 (mean +- se over 4 samples")
    assert "fails below -2 se" in check.detail


def test_a_drop_beyond_two_standard_errors_fails_and_says_what_to_look_at():
    check = reward_change_check([-1.0, -2.0, -3.0, -4.0])  # -2.5 < -2 x 0.645
    assert check.passed is False
    assert check.detail.startswith("one update changes the reward by -2.5 +- 0.65")
    assert "the update lowers the reward it is given" in check.detail
    for lead in ("sde.window", "update.learning_rate", "update.adam_eps", "gradient's sign"):
        assert lead in check.detail


def test_a_drop_within_noise_passes():
    differences = [-3.0, 1.0, -1.0, 2.0]  # mean -0.25; se sqrt(14.75 / 3) / 2 = 1.109: -0.25 > -2.22
    check = reward_change_check(differences)
    assert check.passed is True
    assert "by -0.25 +- 1.1 " in check.detail
    # The same differences shifted down until the mean lies beyond 2 se (the se does not move): now it fails.
    assert reward_change_check([d - 2.1 for d in differences]).passed is False  # mean -2.35 < -2.22


@pytest.mark.parametrize(
    "differences, passed",
    [
        ([-0.5, -0.5, -0.5], False),  # every sample lower by the same amount: se 0, a drop beyond any noise
        ([0.0, 0.0], True),  # nothing changed: not a drop
        ([0.5, 0.5], True),
    ],
)
def test_without_spread_the_sign_alone_decides(differences, passed):
    check = reward_change_check(differences)
    assert check.passed is passed
    assert "+- 0 " in check.detail


@pytest.mark.parametrize("differences", [[], [0.3]])
def test_fewer_than_two_paired_samples_cannot_be_judged_and_fail(differences):
    check = reward_change_check(differences)
    assert check.passed is False
    assert f"{len(differences)} sample(s) scored both before and after the first update" in check.detail


def test_several_updates_per_rollout_are_named():
    assert reward_change_check([0.1, 0.2], updates=4).detail.startswith("one rollout's 4 updates change the reward")


def _recipe(before: list[float | None], after: list[float | None]) -> SimpleNamespace:
    """What ``_reward_differences`` reads of a recipe: the scores its first train_step left on the scorer, and the
    batch re-sampled under the updated weights (recorded, to check which batch was asked for)."""
    asked = []

    def resampled_rewards(prompt_ids, iteration):
        asked.append((prompt_ids, iteration))
        return after

    scorer = SimpleNamespace(last_scored=ScoredBatch(total=before, dimensions={}))
    return SimpleNamespace(scorer=scorer, resampled_rewards=resampled_rewards, parallel=ParallelLayout(), asked=asked)


def test_samples_are_paired_in_order_and_unscored_ones_left_out():
    recipe = _recipe([1.0, None, 2.0, 3.0, math.nan], [1.5, 2.0, None, 2.5, 1.0])
    assert _reward_differences(recipe, [7, 3]) == [0.5, -0.5]
    assert recipe.asked == [([7, 3], 0)]  # the first iteration's prompts, at its seed and sampler


def test_a_resample_of_another_size_is_an_error_not_a_pairing():
    with pytest.raises(RuntimeError, match="3 re-sampled samples for the first iteration's 2"):
        _reward_differences(_recipe([1.0, 2.0], [1.0, 2.0, 3.0]), [0])
