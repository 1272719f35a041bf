"""The trust region's reach (how far an update's weights may be from its KL reference, in summed learning rates)
and lambda set per unit of it: under an lr warm-up, and wherever an update lies in its anchor cycle, the controller
holds the gradient ratio at its target, where a per-update gain (the controller before the reach) overshoots while
the lr rises."""

import math

import pytest

from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.update import UpdateConfig

pytestmark = pytest.mark.unit


def constant(update: int) -> float:
    return 0.5


@pytest.mark.parametrize(
    "strategy,reaches",
    [
        ("moving", [0, 0.5, 1.0, 0, 0.5, 1.0, 0]),  # anchor N = 3: refreshed after updates 3 and 6
        ("dual", [0, 0.5, 1.0, 0, 0.5, 1.0, 0]),  # the anchor's reach: its term dominates
        ("fixed", [0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]),  # never refreshed
        ("step_wise", [0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]),  # the lagged policy, one update behind
        ("none", [0] * 7),
    ],
)
def test_reach_is_the_summed_lr_since_the_reference(strategy, reaches):
    region = TrustRegionConfig(strategy=strategy, anchor_interval=3)
    assert [region.reach(u, constant) for u in range(1, 8)] == pytest.approx(reaches)


def test_reach_follows_the_lr_schedule():
    region = TrustRegionConfig(strategy="moving", anchor_interval=3)
    warm = UpdateConfig(learning_rate=1.0, lr_warmup_steps=9).learning_rate_of  # update u at lr u / 10
    # Cycle 2 (updates 4-6): update 5 is one step (update 4's, lr 0.4) from the anchor, update 6 two (0.4 + 0.5).
    assert [region.reach(u, warm) for u in (4, 5, 6)] == pytest.approx([0.0, 0.4, 0.9])
    assert TrustRegionConfig(strategy="fixed").reach(3, warm) == pytest.approx(0.1 + 0.2)


def test_learning_rate_of_an_update_is_the_schedulers():
    config = UpdateConfig(learning_rate=0.8, lr_warmup_steps=3, lr_schedule="linear", lr_decay_steps=4)
    assert [config.learning_rate_of(u) for u in range(1, 9)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.6, 0.4, 0.2, 0])


def _cycle_means(use_reach: bool, warmup: int = 20, updates: int = 30) -> list[float]:
    """A trust region whose KL gradient grows with the reach (ratio = lambda x gain per reach x reach, the gain drawn
    from a fixed spread) under a warm-up, steered by the calibrated controller: each cycle's geometric-mean ratio."""
    region = TrustRegionConfig(anchor_interval=5)
    lr = UpdateConfig(learning_rate=1e-4, lr_warmup_steps=warmup).learning_rate_of
    controller = region.controller()
    ratios: dict[int, list[float]] = {}
    for update in range(1, updates + 1):
        reach = region.reach(update, lr)
        gain_per_reach = 30.0 * (1.2 if update % 2 else 1 / 1.2)
        ratio = controller.value * gain_per_reach * reach if reach > 0 else None
        if ratio is not None:
            ratios.setdefault(region.reference_taken(update), []).append(ratio)
        if use_reach:
            controller.update(0.0, ratio, reach=reach, next_reach=region.reach(update + 1, lr))
        else:
            controller.update(0.0, ratio)
    # From the second cycle on: the first one's first ratio was measured at kl_initial.
    cycles = sorted(ratios)[1:]
    return [math.exp(sum(map(math.log, ratios[c])) / len(ratios[c])) for c in cycles]


def test_lambda_per_unit_of_reach_holds_each_cycle_at_the_target_through_a_warm_up():
    target = TrustRegionConfig().kl_ratio_target
    with_reach = _cycle_means(use_reach=True)
    assert all(m == pytest.approx(target, rel=0.25) for m in with_reach), with_reach
    # The gain per update rises with the lr: the same controller without the reach lags behind it.
    without = _cycle_means(use_reach=False)
    assert max(without) > 1.5 * target, without
