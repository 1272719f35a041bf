"""The run report's plots (``pipeline/report.py``) and the data they draw: S_t per step, rewards per group."""

import math

import pytest
import torch
from PIL import Image

from sage_grpo.core import sde
from sage_grpo.pipeline import report
from sage_grpo.stages.rollout import SDEConfig

pytestmark = pytest.mark.unit


def test_step_weights_are_the_equalizers_and_zero_off_the_window():
    config = SDEConfig(variant="sage", steps=10, shift=5.0, eta=0.5, window=(2, 7))
    weights, trained = config.step_weights(), config.trained_steps_mask()
    sigmas = sde.flow_match_sigmas(10, 5.0)
    assert trained.tolist() == [2 <= t < 7 for t in range(10)]
    torch.testing.assert_close(weights, sde.balance_factors("sage", sigmas, 0.5, trained=trained).float())
    assert (weights[~trained] == 0).all() and weights[trained].median() == pytest.approx(1.0, rel=1e-6)


def test_rewards_by_group_drops_unscored_samples_and_keeps_empty_groups():
    groups = report.rewards_by_group([0.1, None, 0.3, math.nan, None, 0.9], [5, 5, 2, 2, 7, 5])
    assert groups == {5: [0.1, 0.9], 2: [0.3], 7: []}


def test_plots_are_png_files(tmp_path):
    history = [
        {"iteration": i, "update/kl": 1e-3 * i, "update/lambda_kl": 0.1 * i, "reward/mean": 0.1} for i in range(1, 5)
    ]
    videos = torch.randint(0, 256, (6, 2, 16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    paths = [
        report.plot_step_weights(SDEConfig(steps=6), tmp_path / "st.png"),
        report.plot_kl_and_lambda(history, tmp_path / "kl.png", kl_target=1e-3),
        report.plot_group_rewards([0.1, 0.2, None, 0.5], [0, 0, 1, 1], tmp_path / "groups.png", iteration=4),
        report.plot_sample_grid(
            videos, [0, 0, 0, 1, 1, 1], [0.1] * 6, [0.5, -0.5, 0, 1, -1, 0], tmp_path / "samples.png"
        ),
        report.plot_reward_curves(history, tmp_path / "curves.png"),
    ]
    for path in paths:
        with Image.open(path) as image:
            assert image.format == "PNG" and min(image.size) > 100
