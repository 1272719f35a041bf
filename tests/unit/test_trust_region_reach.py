"""lambda per unit of learning rate: the KL's gain grows with the step the optimizer takes, so under an lr warm-up
the calibrated controller takes each gain per unit of the last step's lr and sets lambda for the next step's. Its
anchor cycles then stay at the target where a per-update gain (the controller without the lr) overshoots while the lr
rises; at a constant lr the two are the same controller."""

import math

import pytest

from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.update import UpdateConfig

pytestmark = pytest.mark.unit

INTERVAL = 5


def test_learning_rate_of_an_update_is_the_schedulers():
    config = UpdateConfig(learning_rate=0.8, lr_warmup_steps=3, lr_schedule="linear", lr_decay_steps=4)
    assert [config.learning_rate_of(u) for u in range(1, 9)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.6, 0.4, 0.2, 0])


def _cycle_means(per_lr: bool, warmup: int = 20, updates: int = 30) -> tuple[list[float], list[float]]:
    """A trust region whose KL gradient grows with the displacement from the anchor (ratio = lambda x a gain per unit
    of summed lr since the refresh, drawn from a fixed spread), steered by the calibrated controller: each cycle's
    geometric-mean ratio, and lambda after every update."""
    region = TrustRegionConfig(anchor_interval=INTERVAL)
    lr = UpdateConfig(learning_rate=1e-4, lr_warmup_steps=warmup).learning_rate_of
    controller = region.controller()
    ratios: dict[int, list[float]] = {}
    lambdas = []
    for update in range(1, updates + 1):
        start = (update - 1) // INTERVAL * INTERVAL
        reach = sum(lr(u) for u in range(start + 1, update))
        gain = 30.0 * (1.2 if update % 2 else 1 / 1.2)
        ratio = controller.value * gain * reach if reach > 0 else None
        if ratio is not None:
            ratios.setdefault(start, []).append(ratio)
        rates = dict(lr=lr(max(update - 1, 1)), next_lr=lr(update)) if per_lr else {}
        lambdas.append(controller.update(0.0, ratio, **rates))
    cycles = sorted(ratios)[1:]  # from the second cycle on: the first one's first ratio was measured at kl_initial
    return [math.exp(sum(map(math.log, ratios[c])) / len(ratios[c])) for c in cycles], lambdas


def test_lambda_per_unit_of_lr_keeps_the_trust_region_at_its_target_through_a_warm_up():
    target = TrustRegionConfig().kl_ratio_target
    per_lr, _ = _cycle_means(per_lr=True)
    per_update, _ = _cycle_means(per_lr=False)
    assert max(per_update) > 2 * target, per_update  # lags the rising lr: out of preflight's band
    assert all(0.5 * target <= m <= 2 * target for m in per_lr), per_lr
    assert max(per_lr) < 0.7 * max(per_update)


def test_at_a_constant_lr_it_is_the_per_update_controller():
    assert _cycle_means(per_lr=True, warmup=0)[1] == pytest.approx(_cycle_means(per_lr=False, warmup=0)[1], rel=1e-9)
