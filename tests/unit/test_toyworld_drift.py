"""KL from the start (benchmarks/toyworld/drift.py), the x-axis of the sweep's gold-against-drift frontier."""

from __future__ import annotations

import copy

import pytest
import torch

from sage_grpo.stages.rollout import SDEConfig, generate, score_transition

pytestmark = pytest.mark.unit

SDE = SDEConfig(variant="sage", eta=0.5, steps=4, shift=3.0, window=(0, 2))
PROMPTS = ["a red square moving right", "a blue square moving up"]


@pytest.fixture()
def models():
    from benchmarks.toyworld.model import ToyWorldAdapter, build_transformer

    adapter = ToyWorldAdapter(build_transformer(0).eval())
    start = copy.deepcopy(adapter.transformer).requires_grad_(False)
    return adapter, start


def perturb(module: torch.nn.Module, scale: float) -> None:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        weight = module.proj_out.weight
        weight.add_(scale * torch.randn(weight.shape, generator=generator))


def test_the_start_itself_has_no_drift(models):
    from benchmarks.toyworld.drift import kl_from_start

    adapter, start = models
    assert abs(kl_from_start(adapter, start, PROMPTS, SDE)) < 1e-9  # the rollout's and a rescoring's float rounding


def test_drift_is_the_expected_log_ratio_of_the_sampled_transitions(models):
    """Independent of the closed form: the KL is E_policy[log p_policy - log p_start] over the stochastic steps, the
    mean log-ratio of the transitions the policy sampled (recorded log-probs against the start's). The log-probs are
    means over a latent's elements; the KL is per video, a sum over them."""
    from benchmarks.toyworld.drift import SAMPLES_PER_CAPTION, SEED, kl_from_start

    adapter, start = models
    perturb(adapter.transformer, 0.05)
    kl = kl_from_start(adapter, start, PROMPTS, SDE)

    rollout = generate(adapter, PROMPTS, SAMPLES_PER_CAPTION, SDE, SEED, decode=False, progress=False)
    everyone = torch.arange(rollout.num_samples)
    elements = rollout.latents[0, 0].numel()
    with torch.no_grad():
        ratio = elements * sum(
            rollout.log_probs[:, t].double() - score_transition(adapter, rollout, everyone, t, module=start).log_prob
            for t in range(SDE.steps)
            if float(rollout.stds[t]) > 0
        )
    # log-ratio = KL + a zero-mean term of variance 2 KL per sample: its mean over the samples is within 3 sigma
    assert kl > 5.0
    assert abs(float(ratio.mean()) - kl) < 3 * (2 * kl / rollout.num_samples) ** 0.5


def test_drift_grows_with_the_distance_from_the_start(models):
    from benchmarks.toyworld.drift import kl_from_start

    adapter, start = models
    perturb(adapter.transformer, 0.01)
    near = kl_from_start(adapter, start, PROMPTS, SDE)
    perturb(adapter.transformer, 0.01)
    far = kl_from_start(adapter, start, PROMPTS, SDE)
    assert 0 < near < far
