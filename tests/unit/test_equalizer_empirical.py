"""The paper's equalizer claim, measured on the tiny HunyuanVideo 1.5: per-timestep gradient norms of log pi span
more than 5x across the schedule, and within a small factor once each step is weighted by S_t."""

import pytest

from sage_grpo.core.models.tiny import tiny_hunyuan15
from sage_grpo.stages.rollout import SDEConfig, generate
from sage_grpo.stages.update import timestep_gradient_norms

pytestmark = pytest.mark.unit


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
    assert len(raw) == 19
    assert max(raw) / min(raw) > 5
    assert max(equalized) / min(equalized) < 2.5
