"""The trust region's config section: which KL terms each strategy uses, when the moving anchor refreshes, the
presets that fill lambda's keys, and the controller each feedback builds."""

import pytest

from sage_grpo.core.grpo import AdaptiveKLController, GradientRatioController
from sage_grpo.core.trust_region import KLStrategy, TrustRegionConfig

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "strategy,position,stepwise,moves",
    [
        ("none", False, False, False),
        ("fixed", True, False, False),
        ("step_wise", False, True, False),
        ("moving", True, False, True),
        ("dual", True, True, True),
    ],
)
def test_strategy_terms(strategy, position, stepwise, moves):
    region = TrustRegionConfig(strategy=strategy)
    assert (region.uses_position_kl, region.uses_stepwise_kl, region.anchor_moves) == (position, stepwise, moves)
    assert region.total_kl(2.0, 3.0) == pytest.approx(2.0 * position + 0.1 * 3.0 * stepwise)


def test_refresh_every_n_updates_even_when_n_does_not_divide_the_run():
    region = TrustRegionConfig(strategy=KLStrategy.DUAL, anchor_interval=3)
    assert [u for u in range(1, 11) if region.refresh_due(u)] == [3, 6, 9]


def test_fixed_anchor_never_refreshes():
    assert not any(TrustRegionConfig(strategy="fixed", anchor_interval=1).refresh_due(u) for u in range(1, 20))


@pytest.mark.parametrize(
    "bad",
    [
        dict(anchor_interval=0),
        dict(strategy="sometimes"),
        dict(stepwise_weight=-1),
        dict(kl_initial=1e-5),  # below the calibrated preset's floor kl_minimum 1e-4
        dict(kl_grad_ratio_every=5),
    ],
)
def test_invalid_trust_region_is_rejected(bad):
    with pytest.raises(ValueError):
        TrustRegionConfig(**bad)


def test_presets_fill_lambda_keys_and_an_explicit_key_wins():
    calibrated, paper = TrustRegionConfig(), TrustRegionConfig(preset="paper")
    assert isinstance(calibrated.controller(), GradientRatioController)
    assert isinstance(paper.controller(), AdaptiveKLController)
    assert (calibrated.kl_initial, paper.kl_initial, paper.kl_maximum) == (0.1, 1e-7, 1e-5)
    assert TrustRegionConfig(preset="paper", kl_maximum=1e-3).controller().maximum == 1e-3
