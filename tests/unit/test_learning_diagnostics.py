"""The update's learning diagnostics (issue 49): the gradient's RMS against Adam's eps, the step per unit of learning
rate, each top-level module's share of the step, the prompt groups without reward variance and the first micro-step's
ratio. Closed forms for the arithmetic, then real DeepSpeed engines (a world of one, ZeRO-2 and ZeRO-3, CPU) where
Adam's first step has a closed form: every coordinate with a gradient far above eps moves by exactly the learning rate.
"""

from __future__ import annotations

import math

import pytest
import torch

from sage_grpo.core.grpo import group_advantages
from sage_grpo.core.learning_diagnostics import (
    gradient_signals,
    mean_per_key,
    sample_strides,
    step_signals,
    top_level_name,
)
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.engine import build_engine
from sage_grpo.stages.master_weights import WeightStep
from sage_grpo.stages.rollout import SDEConfig, generate
from sage_grpo.stages.update import UpdateConfig, Updater
from tests.helpers import LinearAdapter, world_of_one

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------------------------------------------------------
# The arithmetic
# ---------------------------------------------------------------------------------------------------------------


def test_gradient_rms_is_the_norm_per_coordinate_and_compared_with_eps_after_the_clip():
    assert gradient_signals(6.0, 9, adam_eps=1e-8) == pytest.approx({"grad_rms": 2.0, "grad_rms_over_eps": 2e8})
    # Adam steps with the clipped gradient: a norm of 6 clipped to 3 halves what eps is compared with.
    clipped = gradient_signals(6.0, 9, adam_eps=1e-8, gradient_clipping=3.0)
    assert clipped == pytest.approx({"grad_rms": 2.0, "grad_rms_over_eps": 1e8})
    assert gradient_signals(6.0, 9, adam_eps=1e-8, gradient_clipping=12.0)["grad_rms_over_eps"] == pytest.approx(2e8)
    assert gradient_signals(6.0, 9, adam_eps=None) == pytest.approx({"grad_rms": 2.0})  # Muon: no eps to read


def test_step_per_unit_of_learning_rate_and_each_modules_share():
    # 4 coordinates: ||delta||^2 = 3 + 1, so the RMS change is 1 and, at lr 0.5, 2 per unit of learning rate.
    signals = step_signals({"blocks": 3.0, "embed": 1.0, "frozen_by_the_loss": 0.0}, 4, 0.5)
    assert signals == pytest.approx(
        {
            "step_rms_per_lr": 2.0,
            "update_share/blocks": 0.75,
            "update_share/embed": 0.25,
            "update_share/frozen_by_the_loss": 0.0,
        }
    )
    # Nothing moved: the step is 0 and a share means nothing, so none is given.
    assert step_signals({"blocks": 0.0}, 4, 0.5) == {"step_rms_per_lr": 0.0}


def test_top_level_names_sampling_stride_and_means_over_updates():
    assert top_level_name("transformer_blocks.3.attn.to_q.lora_A.default.weight") == "transformer_blocks"
    assert top_level_name("scale_shift_table") == "scale_shift_table"
    assert sample_strides([600, 400], 1000) == [1, 1]
    # 10 fits whole; the cap 95 of the remaining 190 for two: 100 -> every 2nd, made odd (2 would keep the same
    # columns of every row of a 2^k-wide matrix), 1000 -> every 11th.
    assert sample_strides([100, 1000, 10], 200) == [3, 11, 1]
    rows = [{"a": 1.0, "b": 4.0}, {"a": 3.0}]
    assert mean_per_key(rows) == {"a": 2.0, "b": 4.0} and mean_per_key([]) == {}


def test_zero_variance_groups_count_the_groups_whose_scored_rewards_are_all_equal():
    rewards = [0.1, 0.1, 0.1, 0.2, 0.9, 0.5, 0.5, None, 0.5, None, None, 0.3]
    group_ids = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    advantages = group_advantages(rewards, group_ids)
    # Group 0: three equal rewards (whose advantages are rounding-sized, not exactly 0); group 2: the two scored are
    # equal; group 1 has spread; group 3 has one score, no baseline and no variance to speak of.
    assert (advantages.groups, advantages.zero_variance_groups) == (4, 2)
    assert group_advantages([0.0, 1.0], [0, 0]).zero_variance_groups == 0


def test_a_sampled_weight_step_estimates_the_squared_change_and_is_exact_when_it_fits():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    module[1].bias.requires_grad_(False)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    whole, sampled = WeightStep(module), WeightStep(module, budget=500)
    whole.start(optimizer)
    sampled.start(optimizer)
    # Steps of +-0.5 on the first child and +-0.25 on the second, with random signs: every coordinate's square is
    # known, so the sample's mean square times each parameter's size must give the whole sum exactly.
    with torch.no_grad():
        for name, p in module.named_parameters():
            p += torch.randn_like(p).sign() * (0.5 if name.startswith("0.") else 0.25)
    expected = {"0": (64 * 64 + 64) * 0.25, "1": 8 * 64 * 0.0625}  # the frozen bias is not trained: left out
    assert whole.coordinates == 64 * 64 + 64 + 8 * 64
    assert whole.squared_change(optimizer) == pytest.approx(expected, rel=1e-6)
    assert sampled._strides == [19, 1, 3]  # 4672 coordinates in a budget of 500: the 64 biases kept whole
    assert sampled.squared_change(optimizer) == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# On real DeepSpeed engines
# ---------------------------------------------------------------------------------------------------------------

SDE = SDEConfig(variant="sage", eta=0.7, steps=3, shift=3.0)
PROMPTS = ["a", "b", "c"]
GROUP = 2
REWARDS = [0.1, 0.9, 0.5, 0.5, 0.3, 0.8]  # the second prompt's group has no variance


class Parts(torch.nn.Module):
    """Three trained children and a frozen one; ``unused`` trains but no gradient reaches it. Computes in ``dtype``,
    takes and returns float32 (the rollout's latents)."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(2, 2, dtype=dtype)
        self.second = torch.nn.Linear(2, 2, dtype=dtype)
        self.unused = torch.nn.Linear(2, 2, dtype=dtype)
        self.frozen = torch.nn.Linear(2, 2, dtype=dtype).requires_grad_(False)

    def forward(self, x):
        inputs = x.to(self.first.weight.dtype)
        return (self.second(self.first(inputs)) + self.frozen(inputs)).float()


@pytest.fixture(scope="module", autouse=True)
def process_group():
    with world_of_one():
        yield


def _update(
    deepspeed_config: str, *, one_micro_step_per_update: bool = False, bf16: bool = False, **update
) -> dict[str, float]:
    """One rollout's updates on a fresh DeepSpeed engine over ``Parts``; the metrics of ``Updater.update``."""
    adapter = LinearAdapter()
    adapter.transformer = Parts(torch.bfloat16 if bf16 else torch.float32)
    with torch.no_grad():
        rollout = generate(adapter, PROMPTS, GROUP, SDE, seed=0, batch_size=GROUP, decode=False, progress=False)
    if one_micro_step_per_update:
        pairs = len(rollout.batches) * int(rollout.trained_steps.sum())
        update["transitions_per_micro_step"] = pairs // update.get("updates_per_rollout", 1)
    config = UpdateConfig(micro_batch_size=GROUP, **update)
    engine = build_engine(
        adapter.transformer,
        config,
        accumulation_steps=config.accumulation_steps(len(REWARDS), int(rollout.trained_steps.sum())),
        deepspeed_config_name=deepspeed_config,
        bf16=bf16,
    )
    adapter.transformer = engine.module
    updater = Updater(engine, adapter, config, TrustRegionConfig(strategy="none"))
    return updater.update(rollout, group_advantages(REWARDS, rollout.group_ids))


@pytest.mark.parametrize("deepspeed_config", ["zero3", "zero2"])
def test_adams_first_step_moves_every_coordinate_with_a_gradient_by_the_learning_rate(deepspeed_config):
    metrics = _update(deepspeed_config, learning_rate=1e-2)

    # Adam's first step is lr x g / (|g| + eps): lr on the 12 coordinates of first and second (|g| >> 1e-8), 0 on the
    # 6 of unused. The RMS over the 18 trained is lr x sqrt(12 / 18); the frozen child is not trained.
    assert metrics["step_rms_per_lr"] == pytest.approx(math.sqrt(12 / 18), rel=1e-4)
    # Each child has 6 coordinates; the step is lr x |g| / (|g| + 1e-8), so the smallest gradients leave ~1e-5.
    shares = {key: value for key, value in metrics.items() if key.startswith("update_share/")}
    expected = {"update_share/first": 0.5, "update_share/second": 0.5, "update_share/unused": 0}
    assert shares == pytest.approx(expected, rel=1e-4, abs=1e-12)
    assert metrics["grad_rms"] > 0 and metrics["grad_rms_over_eps"] > 1e4
    assert metrics["grad_rms"] == pytest.approx(metrics["grad_norm"] / math.sqrt(18))
    assert metrics["zero_variance_groups"] == pytest.approx(1 / 3)
    # One update per rollout, float32 on the CPU: its first micro-step scores with the rollout's own weights.
    assert metrics["first_micro_step/max_abs_ratio_minus_1"] == 0.0
    assert metrics["first_micro_step/clip_fraction"] == 0.0


def test_the_step_is_measured_on_the_float32_master_weights_not_the_bf16_ones():
    metrics = _update("zero2", learning_rate=1e-2, bf16=True)

    # bf16 spaces weights of ~0.5 by 2^-8, so the model's own weights move by 0.0078 or 0.0117 for a step of 0.01
    # (their RMS change per unit of learning rate is 0.84 here); the optimizer's fp32 copy moves by the step.
    assert metrics["step_rms_per_lr"] == pytest.approx(math.sqrt(12 / 18), rel=1e-4)


def test_an_eps_above_the_gradient_shrinks_the_step_as_the_gradient_over_eps_says():
    metrics = _update("zero3", learning_rate=1.0, adam_eps=1e3, max_grad_norm=1e6)

    # lr x g / (|g| + eps) with eps >> |g|: the step per unit of learning rate is the gradient's RMS over eps, two
    # measurements that share nothing (the master weights before and after, DeepSpeed's gradient norm).
    assert metrics["step_rms_per_lr"] < 1e-2
    assert metrics["step_rms_per_lr"] == pytest.approx(metrics["grad_rms_over_eps"], rel=1e-2)


def test_later_updates_of_a_rollout_start_where_the_earlier_ones_moved_the_policy():
    # One micro-step per update: its first micro-step is the whole update, so what the first micro-steps say must be
    # what the rollout's ratio range and clip fraction (over every micro-step) say.
    metrics = _update("zero3", learning_rate=1e-2, updates_per_rollout=3, one_micro_step_per_update=True)

    assert metrics["updates_done"] == 3
    # The second and third updates score with weights the first update moved: well past the clip range of 1e-4.
    farthest = max(1 - metrics["ratio_min"], metrics["ratio_max"] - 1)
    assert metrics["first_micro_step/max_abs_ratio_minus_1"] == pytest.approx(farthest) and farthest > 1e-3
    assert metrics["first_micro_step/clip_fraction"] == pytest.approx(metrics["clip_fraction"])
    assert metrics["clip_fraction"] > 0
    # Averaged over the three updates, each update's shares summing to 1.
    assert sum(v for k, v in metrics.items() if k.startswith("update_share/")) == pytest.approx(1.0)
