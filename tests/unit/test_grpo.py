"""Group advantages, the clipped surrogate, KL terms and the adaptive KL controller (spec sections 3-4)."""

import math

import pytest
import torch

from sage_grpo.core.grpo import (
    AdaptiveKLController,
    GradientRatioController,
    KLFeedback,
    clipped_surrogate,
    gaussian_mean_kl,
    group_advantages,
    stepwise_kl,
)

pytestmark = pytest.mark.unit


def test_advantages_are_zero_mean_unit_std_per_group():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 0.0, 5.0, 7.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = group_advantages(rewards, groups)
    for g in (0, 1):
        values = adv.values[groups == g].double()
        assert values.mean().abs() < 1e-6
        assert values.std(unbiased=False) == pytest.approx(1.0, abs=1e-6)
    assert adv.valid.all()


def test_nan_and_none_rewards_are_dropped_not_scored_zero():
    adv = group_advantages([1.0, None, 3.0, float("nan"), 5.0, 7.0], [0, 0, 0, 1, 1, 1])
    assert adv.valid.tolist() == [True, False, True, False, True, True]
    assert adv.values.tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0, -1.0, 1.0], abs=1e-6)
    # Had the missing reward counted as 0, the group's mean would move and these would not be +-1.


def test_degenerate_groups_contribute_nothing():
    adv = group_advantages([1.0, None, None, 2.0, 2.0, 3.0], [0, 0, 1, 1, 2, 2])
    assert adv.valid.tolist() == [False, False, False, False, True, True]
    assert adv.values[:4].abs().sum() == 0


def test_advantages_are_clipped():
    rewards = torch.tensor([0.0] * 99 + [1.0])
    adv = group_advantages(rewards, torch.zeros(100, dtype=torch.long), clip=5.0)
    assert adv.values.max() == pytest.approx(5.0)
    assert math.sqrt(99) > 5.0  # the unclipped advantage of the outlier


def test_global_std_divides_by_the_std_of_all_scored_rewards():
    rewards = torch.tensor([0.0, 2.0, 10.0, 30.0])
    adv = group_advantages(rewards, torch.tensor([0, 0, 1, 1]), global_std=True)
    scale = rewards.double().std(unbiased=False)
    torch.testing.assert_close(
        adv.values.double(), torch.tensor([-1.0, 1.0, -10.0, 10.0], dtype=torch.float64) / scale, rtol=1e-6, atol=1e-6
    )


def test_global_std_uses_every_ranks_rewards_when_given():
    mine = [0.0, 2.0]
    everyone = mine + [10.0, 30.0, None]
    adv = group_advantages(mine, [0, 0], global_std=True, all_rewards=everyone)
    scale = torch.tensor([0.0, 2.0, 10.0, 30.0], dtype=torch.float64).std(unbiased=False)
    torch.testing.assert_close(adv.values.double(), torch.tensor([-1.0, 1.0], dtype=torch.float64) / scale)
    # This rank's rewards alone would give the group's own std: advantages of +-1.
    assert group_advantages(mine, [0, 0], global_std=True).values.abs().tolist() == [1.0, 1.0]


def test_surrogate_on_policy_has_ratio_one_and_no_clipping():
    logp = torch.randn(8)
    adv = torch.randn(8)
    terms = clipped_surrogate(logp, logp.clone(), adv, clip_range=1e-4, weights=torch.full((8,), 2.0))
    assert torch.equal(terms.ratio, torch.ones(8))
    assert not terms.clipped.any()
    torch.testing.assert_close(terms.loss, -2.0 * adv)


def test_surrogate_clips_in_the_direction_that_removes_the_incentive():
    log_ratio = torch.tensor([0.01, 0.01, -0.01, -0.01])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    terms = clipped_surrogate(log_ratio, torch.zeros(4), adv, clip_range=1e-4)
    ratio = math.exp(0.01)
    # Positive advantage and ratio above 1+eps: the clipped (flat) branch; negative advantage: the unclipped one.
    assert terms.loss.tolist() == pytest.approx([-(1 + 1e-4), ratio, -math.exp(-0.01), 1 - 1e-4], rel=1e-6)
    assert terms.clipped.tolist() == [True, False, False, True]


def test_gaussian_mean_kl_closed_form():
    mean = torch.zeros(2, 3, 4)
    ref = torch.full((2, 3, 4), 0.3)
    ref[1] = 0.0
    kl = gaussian_mean_kl(mean, ref, std=0.2)
    assert kl.tolist() == pytest.approx([0.09 / (2 * 0.04), 0.0])
    expected = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean[0], 0.2), torch.distributions.Normal(ref[0], 0.2)
    ).mean()
    assert kl[0] == pytest.approx(float(expected), rel=1e-5)


def test_stepwise_kl_is_mean_log_ratio():
    old, new = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert float(stepwise_kl(old, new)) == pytest.approx((0.5 - 1.0) / 2)


def test_controller_without_warmup_starts_at_the_initial_value_and_raises_it_while_kl_is_high():
    ctl = AdaptiveKLController(initial=0.1, maximum=10.0, warmup_steps=0, target=1e-3)
    assert ctl.value == 0.1
    assert ctl.update(1e-2) == pytest.approx(0.11)


def test_controller_warmup_is_linear_and_reaches_the_maximum_at_step_k():
    ctl = AdaptiveKLController(initial=1e-7, maximum=1e-5, warmup_steps=100)
    assert ctl.value == 1e-7
    values = [ctl.update(0.0) for _ in range(100)]
    assert values[49] == pytest.approx(1e-7 + (1e-5 - 1e-7) * 0.5)
    assert values[-1] == pytest.approx(1e-5)


def _after_warmup(feedback, start_value):
    ctl = AdaptiveKLController(warmup_steps=1, target=1e-5, feedback=feedback)
    ctl.update(1e-5)
    ctl.value = start_value
    return ctl


def test_toward_target_tightens_when_kl_is_high_and_relaxes_when_low():
    ctl = _after_warmup(KLFeedback.TOWARD_TARGET, 1e-6)
    assert ctl.update(1e-3) == pytest.approx(1.1e-6)  # mean of [1e-5, 1e-3] > 1.5 x target
    ctl = _after_warmup("toward_target", 1e-6)
    ctl.measurements.clear()
    assert ctl.update(0.0) == pytest.approx(0.9e-6)
    ctl = _after_warmup("toward_target", 1e-6)
    assert ctl.update(1e-5) == pytest.approx(1e-6)  # inside the band: unchanged


def test_as_written_moves_the_other_way():
    ctl = _after_warmup(KLFeedback.AS_WRITTEN, 1e-6)
    assert ctl.update(1e-3) == pytest.approx(0.9e-6)
    ctl = _after_warmup("as_written", 1e-6)
    ctl.measurements.clear()
    assert ctl.update(0.0) == pytest.approx(1.1e-6)


@pytest.mark.parametrize(
    "feedback,kl", [("toward_target", 1.0), ("toward_target", 0.0), ("as_written", 1.0), ("as_written", 0.0)]
)
def test_controller_stays_within_bounds(feedback, kl):
    ctl = AdaptiveKLController(warmup_steps=3, feedback=feedback)
    for _ in range(200):
        value = ctl.update(kl)
        assert 1e-7 <= value <= 1e-5
    assert value in (pytest.approx(1e-7), pytest.approx(1e-5))


def test_controller_save_load_round_trip_continues_identically():
    measurements = [abs(math.sin(i)) * 3e-5 for i in range(60)]
    original = AdaptiveKLController(warmup_steps=20, history=10)
    for kl in measurements[:30]:
        original.update(kl)
    restored = AdaptiveKLController(warmup_steps=20, history=10)
    restored.load_state_dict(original.state_dict())
    assert [original.update(kl) for kl in measurements[30:]] == [restored.update(kl) for kl in measurements[30:]]


def test_ratio_controller_sets_lambda_so_the_last_measured_gain_meets_the_target():
    ctl = GradientRatioController(initial=1.0, minimum=1e-3, maximum=1e3, target=0.1, history=10)
    # Measured 0.5 at lambda 1: the gain is 0.5 per unit lambda, so lambda 0.2 gives the target exactly.
    assert ctl.update(0.0, 0.5) == pytest.approx(0.2)
    # The gain is averaged geometrically over the window: gains 0.5 and 0.125 -> 0.25 -> lambda 0.4.
    assert ctl.update(0.0, 0.2 * 0.125) == pytest.approx(0.4)


@pytest.mark.parametrize("ratio", [None, 0.0, float("nan"), float("inf")])
def test_ratio_controller_holds_lambda_without_a_usable_measurement(ratio):
    ctl = GradientRatioController(initial=2.0, minimum=1e-3, maximum=1e3, target=0.1, history=3)
    assert ctl.update(1e-3, ratio) == 2.0 and not ctl.measurements and ctl.steps == 1


def test_ratio_controller_moves_both_ways_and_stays_within_its_range():
    ctl = GradientRatioController(initial=1.0, minimum=0.5, maximum=4.0, target=0.1, history=1)
    assert ctl.update(0.0, 0.05) == pytest.approx(2.0)  # too weak: up
    assert ctl.update(0.0, 0.4) == pytest.approx(0.5)  # too strong: down
    assert ctl.update(0.0, 1e-6) == 4.0  # hopelessly weak: at the maximum
    assert ctl.update(0.0, 1e6) == 0.5  # hopelessly strong: at the minimum


def test_ratio_controller_save_load_round_trip_continues_identically():
    ratios = [0.05 + 0.1 * abs(math.sin(i)) for i in range(40)]
    original = GradientRatioController(initial=1.0, minimum=1e-3, maximum=1e3, target=0.1, history=5)
    for r in ratios[:20]:
        original.update(0.0, r)
    restored = GradientRatioController(initial=1.0, minimum=1e-3, maximum=1e3, target=0.1, history=5)
    restored.load_state_dict(original.state_dict())
    assert [original.update(0.0, r) for r in ratios[20:]] == [restored.update(0.0, r) for r in ratios[20:]]
