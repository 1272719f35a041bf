"""Preflight's verdict on the trust region from the second update's ``update/kl_grad_ratio`` (the integration test
runs the whole command; these pin what each measured value is reported as)."""

import pytest

from pipeline.config import load_run_config
from pipeline.preflight import KL_GRAD_RATIO_BAND, kl_ratio_check, time_check

pytestmark = pytest.mark.unit

DEMO = "configs/demo.yaml"


@pytest.mark.parametrize("lora", [False, True])
def test_no_policy_gradient_fails_and_says_why_on_any_number_of_ranks(lora):
    # NaN: the measured micro-steps had no policy gradient. On the on-policy second update that means no advantage,
    # whatever the ranks or fine-tuning (it was once excused as a ZeRO-3 limitation of full fine-tuning on 2 ranks).
    config = load_run_config(DEMO, [f"lora.enabled={str(lora).lower()}"])
    check = kl_ratio_check({"update/kl_grad_ratio": float("nan")}, config)
    assert check.passed is False
    assert "no policy gradient" in check.detail and "advantage" in check.detail


def _second_update(ratio: float, kl: float, weight: float) -> dict[str, float]:
    return {"update/kl_grad_ratio": ratio, "update/kl": kl, "update/lambda_kl": weight}


def test_the_demos_second_update_passes_though_its_raw_ratio_is_below_the_band():
    # The full demo's second update on CPU measured 0.00123 at KL 6.8e-4 (one update from its references, below
    # the 1e-3 target, lambda at its 0.1 minimum); from the third update on its ratios ran 0.007-0.19. Judged raw it
    # failed; projected over lambda's [0.1, 10] at the target it reaches the band.
    config = load_run_config(DEMO)
    check = kl_ratio_check(_second_update(0.00123, 6.8e-4, 0.1), config)
    assert check.passed is True
    assert "0.00123" in check.detail and "reaches 0.00149-0.149" in check.detail


def test_an_inert_or_a_dominant_trust_region_fails():
    low, high = KL_GRAD_RATIO_BAND
    paper = load_run_config(DEMO, ["trust_region.preset=paper"])  # lambda 1e-7..1e-5: ratio ~1e-6 at most
    assert kl_ratio_check(_second_update(1e-8, 6.8e-4, 1e-7), paper).passed is False
    calibrated = load_run_config(DEMO)
    at_target = calibrated.trust_region.kl_target
    assert kl_ratio_check(_second_update(high * 3, at_target, 0.1), calibrated).passed is False  # even lambda's min
    assert kl_ratio_check(_second_update((low + high) / 2, at_target, 0.1), calibrated).passed is True


def test_without_kl_the_raw_ratio_is_judged():
    config = load_run_config(DEMO)
    low, high = KL_GRAD_RATIO_BAND
    assert kl_ratio_check(_second_update((low + high) / 2, 0.0, 0.1), config).passed is True
    assert kl_ratio_check(_second_update(low / 10, 0.0, 0.1), config).passed is False


def test_unmeasured_is_not_applicable():
    config = load_run_config(DEMO, ["trust_region.strategy=none"])
    assert kl_ratio_check({}, config).passed is None
    assert kl_ratio_check({}, load_run_config(DEMO)).passed is None  # below ZeRO-3: not measured


def test_the_time_check_projects_the_run_and_reports_mfu_where_measured():
    config = load_run_config(DEMO)  # 8 iterations
    stages = {"time/rollout": 1.0, "time/score": 0.5, "time/update": 2.5, "time/iteration": 4.5}
    without = time_check(stages, config)
    assert "4.50s per iteration" in without.detail and "projected 0.01 h for 8 iterations" in without.detail
    assert "MFU" not in without.detail  # off a GPU of known peak the recipe reports none
    assert "MFU 12.5%" in time_check(stages | {"mfu": 0.125}, config).detail
