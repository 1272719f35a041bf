"""The GRPO update under real DeepSpeed ZeRO-3 with gloo on CPU: 1 and 2 processes launched by torchrun."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = Path(__file__).with_name("update_worker.py")


def _launch(world: int, out: Path, *extra: str) -> list[dict]:
    torchrun(world, str(WORKER), "--out", str(out), *extra)
    return [json.loads((out / f"report_rank{r}_world{world}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module", params=["lora", "full"])
def scenario(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    flags = ["--lora"] if request.param == "lora" else []
    return request.param, out, {world: _launch(world, out, *flags) for world in (1, 2)}


def test_two_ranks_equal_one_process(scenario):
    _, out, _ = scenario
    single = load_file(out / "after_first_update_world1.safetensors")
    sharded = load_file(out / "after_first_update_world2.safetensors")
    assert single.keys() == sharded.keys() and single
    for name in single:
        torch.testing.assert_close(sharded[name], single[name], rtol=1e-5, atol=1e-6, msg=name)


def test_first_update_is_on_policy(scenario):
    _, _, reports = scenario
    for report in reports[2]:
        first = report["history"][0]
        assert first["logprob_mismatch"] == 0.0  # the rollout's log-probs, recomputed bit for bit
        assert not {"ratio_mean", "ratio_min", "ratio_max", "clip_fraction"} & set(first)  # constant here: not logged
        assert first["position_kl"] == 0.0  # the anchor starts as the initial policy


def test_anchor_refreshes_every_n_and_position_kl_resets(scenario):
    _, _, reports = scenario
    history = reports[2][0]["history"]
    # anchor_interval = 2: refreshed after updates 2 and 4 (update 4 is skipped, so after update 5's count of 4).
    assert [h["anchor_refreshes"] for h in history[:3]] == [0, 1, 1]
    assert history[1]["position_kl"] > 0  # policy moved once away from the anchor
    assert history[2]["position_kl"] == 0.0  # measured right after the refresh


def test_nan_loss_on_one_rank_skips_the_step_on_all_ranks(scenario):
    _, _, reports = scenario
    for report in reports[2]:
        nan_update = report["history"][3]
        assert nan_update["skipped"] == 1.0 and nan_update["weights_unchanged"] == 1.0
        assert report["history"][4]["skipped"] == 0.0
        assert report["history"][4]["updates_done"] == 4


def test_velocity_kl_is_positive_from_the_second_update(scenario):
    for report in scenario[2][2]:
        history = report["history"]
        assert history[0]["velocity_kl"] == 0.0 and history[1]["velocity_kl"] > 0
        # Update 4 is skipped: the lagged copy stays one applied update behind, so update 5 still sees a KL.
        assert history[4]["velocity_kl"] > 0


# anchor_interval = 2: update 1 starts at both references, update 3 at the anchor refreshed after update 2, update 4
# is skipped (its loss is NaN on one rank); update 2 is measured. (Update 5 may clip every sample of the reused
# rollout, lr 1e-3 against clip range 1e-4: no policy gradient, so no ratio, rather than an infinite one.)
MEASURED = [False, True, False, False]
RATIOS = ("kl_grad_ratio", "kl_grad_ratio/position", "kl_grad_ratio/velocity")


def _check_gradient_ratios(reports: list[dict]) -> None:
    for report in reports:
        history = report["history"]
        assert ["kl_grad_ratio" in h for h in history[: len(MEASURED)]] == MEASURED
        for h in history:
            if "kl_grad_ratio" in h:
                assert all(math.isfinite(h[key]) and h[key] > 0 for key in RATIOS), h
    # All-reduced: every rank logs and steers lambda by the same numbers.
    keys = (*RATIOS, "lambda_kl")
    first, *others = reports
    for other in others:
        for mine, theirs in zip(first["history"], other["history"]):
            assert {k: mine.get(k) for k in keys} == {k: theirs.get(k) for k in keys}


def test_gradient_ratio_is_measured_away_from_refreshes_and_never_nan_under_zero3(scenario):
    _check_gradient_ratios(scenario[2][2])


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_gradient_ratio_is_measured_and_never_nan_on_two_ranks_under_zero2(kind, tmp_path):
    out = tmp_path / kind
    out.mkdir()
    flags = ["--lora"] if kind == "lora" else []
    _check_gradient_ratios(_launch(2, out, *flags, "--deepspeed-config", "zero2"))


def test_lora_trains_only_the_adapter(scenario):
    kind, _, reports = scenario
    for report in reports[1] + reports[2]:
        assert report["trainable_changed"]
        if kind == "lora":
            assert report["frozen_count"] > 0 and report["frozen_identical"]


# Summed over the ranks' partitions and all-reduced: the same training on 1 and on 2 ranks logs the same sizes.
SIZES = ("grad_rms", "grad_rms_over_eps", "step_rms_per_lr", "zero_variance_groups")


def test_learning_diagnostics_are_over_every_rank(scenario):
    _, _, reports = scenario
    single = reports[1][0]["history"]
    for report in reports[2]:
        for update, (one, two) in enumerate(zip(single, report["history"]), start=1):
            keys = [key for key in one if key in SIZES or key.startswith("update_share/")]
            if update == 4:  # skipped (its loss is NaN on one rank): nothing moved, no step to size
                assert keys == ["zero_variance_groups"]
            else:
                assert {"step_rms_per_lr", "grad_rms"} <= set(keys)
                shares = [one[key] for key in keys if key.startswith("update_share/")]
                assert len(shares) > 1 and math.fsum(shares) == pytest.approx(1.0)
            assert {key: two[key] for key in keys} == pytest.approx({key: one[key] for key in keys}, rel=1e-3)
    # Each rank trains on its own first micro-steps; the all-reduced values agree.
    first, second = (report["history"] for report in reports[2])
    for mine, theirs in zip(first, second):
        keys = [key for key in mine if key.startswith("first_micro_step/")]
        assert len(keys) == 2 and {key: mine[key] for key in keys} == {key: theirs[key] for key in keys}
