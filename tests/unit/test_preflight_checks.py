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


def test_a_ratio_in_the_band_passes_and_outside_it_fails():
    config = load_run_config(DEMO)
    low, high = KL_GRAD_RATIO_BAND
    assert kl_ratio_check({"update/kl_grad_ratio": (low + high) / 2}, config).passed is True
    assert kl_ratio_check({"update/kl_grad_ratio": low / 10}, config).passed is False
    assert kl_ratio_check({"update/kl_grad_ratio": high * 10}, config).passed is False


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
