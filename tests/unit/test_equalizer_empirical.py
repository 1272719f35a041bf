"""The paper's equalizer claim, measured on the tiny HunyuanVideo 1.5: per-timestep gradient norms of log pi span
more than 5x across the schedule, and within a small factor once each step is weighted by S_t."""

import pytest
import torch

from sage_grpo.core.models.tiny import tiny_hunyuan15
from sage_grpo.stages.rollout import SDEConfig, generate, score_transition
from sage_grpo.stages.update import timestep_weights

pytestmark = pytest.mark.unit


def timestep_gradient_norms(adapter, rollout, *, equalize: bool) -> dict[int, float]:
    """The norm of grad log pi summed over samples, per trained timestep, times S_t when ``equalize``: the quantity
    the temporal gradient equalizer balances, weighted as the updater weights it (``timestep_weights``)."""
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    weights = timestep_weights(rollout, equalize=equalize)
    every_sample = torch.arange(rollout.num_samples)
    norms = {}
    for t in torch.nonzero(rollout.trained_steps.cpu()).flatten().tolist():
        step = score_transition(adapter, rollout, every_sample, t)
        grads = torch.autograd.grad(step.log_prob.sum() * float(weights[t]), params, allow_unused=True)
        norms[t] = float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None)))
    return norms


@pytest.mark.parametrize("variant", ["sage", "flow"])
def test_equalizer_brings_per_timestep_gradient_norms_within_a_small_factor(variant):
    adapter = tiny_hunyuan15(seed=0)
    adapter.transformer.requires_grad_(True)
    rollout = generate(
        adapter,
        ["a red ball", "a blue car"],
        2,
        SDEConfig(variant=variant, eta=0.5, steps=20, shift=5.0),
        seed=0,
        progress=False,
    )
    raw = list(timestep_gradient_norms(adapter, rollout, equalize=False).values())
    equalized = list(timestep_gradient_norms(adapter, rollout, equalize=True).values())
    assert len(raw) == 20  # every step, the last one (to sigma 0) included
    assert max(raw) / min(raw) > 5
    assert max(equalized) / min(equalized) < 2.5
