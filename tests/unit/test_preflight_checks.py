"""Preflight's verdict on the trust region from the ``update/kl_grad_ratio`` measured over one anchor cycle of its
trial iterations, at the lambda the run chose (the integration test runs the whole command; these pin what each value
is judged as)."""

import pytest

from sage_grpo.pipeline.config import load_run_config
from sage_grpo.pipeline.preflight import (
    KL_GRAD_RATIO_BAND,
    TARGET_FACTOR,
    kl_ratio_check,
    time_check,
    trial_iterations,
)

pytestmark = pytest.mark.unit

DEMO = "configs/demo.yaml"


def _steps(*ratios: float | None, weight: float = 1.0) -> list[dict[str, float]]:
    """One metrics dict per trial iteration; None: that update was not measured (it started at its reference)."""
    steps = []
    for ratio in ratios:
        step = {"update/lambda_kl": weight}
        if ratio is not None:
            step |= {"update/kl_grad_ratio": ratio, "update/kl_grad_ratio/position": ratio * 0.9}
            step["update/kl_grad_ratio/velocity"] = ratio * 0.1
        steps.append(step)
    return steps


@pytest.mark.parametrize("lora", [False, True])
def test_no_measured_update_fails_and_says_why(lora):
    config = load_run_config(DEMO, [f"lora.enabled={str(lora).lower()}"])
    check = kl_ratio_check(_steps(None, None, None), config)
    assert check.passed is False
    assert "no update of 3 measured" in check.detail and "anchor_interval" in check.detail


def test_the_calibrated_preset_is_judged_over_one_anchor_cycle_against_its_own_target():
    config = load_run_config(DEMO)  # anchor N = 3: update 1 and 4 start at the anchor, update 2 runs at kl_initial
    target = config.trust_region.kl_ratio_target
    check = kl_ratio_check(_steps(None, 30 * target, 2.5 * target, None, 0.8 * target), config)
    # Update 3 alone is out of band (the pull grows within a cycle); the cycle's geometric mean, sqrt(2) x, is not.
    assert check.passed is True
    assert f"geometric mean over updates 3-5: {2.5 * target:.3g}, {0.8 * target:.3g}" in check.detail
    assert f"band {target / TARGET_FACTOR:.3g}-{target * TARGET_FACTOR:.3g}" in check.detail
    assert "position" in check.detail and "velocity" in check.detail
    assert kl_ratio_check(_steps(None, target, 3 * target, None, 3 * target), config).passed is False  # too strong
    assert kl_ratio_check(_steps(None, target, target / 3, None, target / 3), config).passed is False  # too weak
    # Updates after the cycle are not judged.
    assert kl_ratio_check(_steps(None, target, target, None, target, 100 * target), config).passed is True


def test_a_cycle_with_no_update_at_the_controllers_lambda_fails():
    config = load_run_config(DEMO, ["trust_region.anchor_interval=2"])  # updates 2, 4, 6 measured
    check = kl_ratio_check(_steps(None, 0.003, None), config)
    assert check.passed is False and "none at a lambda the controller chose" in check.detail


def test_the_trial_covers_one_anchor_cycle_after_the_first_measured_update():
    assert trial_iterations(load_run_config(DEMO)) == 6  # N = 3
    assert trial_iterations(load_run_config(DEMO, ["trust_region.anchor_interval=10"])) == 13
    assert trial_iterations(load_run_config(DEMO, ["trust_region.strategy=fixed"])) == 6


def test_the_paper_preset_is_inert_and_fails():
    low, high = KL_GRAD_RATIO_BAND
    paper = load_run_config(DEMO, ["trust_region.preset=paper"])  # lambda 1e-7..1e-5, steered by the KL
    assert kl_ratio_check(_steps(None, 1e-6, 1e-6, weight=1e-7), paper).passed is False
    assert kl_ratio_check(_steps(None, (low + high) / 2, (low + high) / 2), paper).passed is True


def test_without_a_kl_term_it_does_not_apply():
    config = load_run_config(DEMO, ["trust_region.strategy=none"])
    assert kl_ratio_check(_steps(None, None, None), config).passed is None


def test_the_time_check_projects_the_run_and_reports_mfu_where_measured():
    config = load_run_config(DEMO)  # 8 iterations
    stages = {"time/rollout": 1.0, "time/score": 0.5, "time/update": 2.5, "time/iteration": 4.5}
    without = time_check(stages, config)
    assert "4.50s per iteration" in without.detail and "projected 0.01 h for 8 iterations" in without.detail
    assert "MFU" not in without.detail  # off a GPU of known peak the recipe reports none
    assert "MFU 12.5%" in time_check(stages | {"mfu": 0.125}, config).detail
