"""Two-expert Wan 2.2 (the A14B layout) on a tiny model of the real diffusers classes: every step runs the expert and
the guidance scale WanPipeline runs, the rollout records the expert of each step, and recomputing a transition uses
that expert (the on-policy ratio is exactly 1)."""

import numpy as np
import pytest
import torch

from sage_grpo.core.models import ModelConfig
from sage_grpo.core.models.tiny import tiny_wan, tiny_wan22, tiny_wan_pipeline
from sage_grpo.core.models.wan import WanAdapter
from sage_grpo.stages.rollout import (
    SDEConfig,
    check_every_trained_expert_trains,
    generate,
    recompute_log_probs,
    score_transition,
    trained_steps,
)

pytestmark = pytest.mark.unit

PROMPTS = ["a red fox runs through snow", "a lighthouse at dusk"]
# shift 5: sigmas 1, .96, .91, .83, .71, .5, 0 with 6 steps; timesteps >= 875 (steps 0-2) go to the high expert.
SDE = SDEConfig(variant="sage", eta=0.5, steps=6, shift=5.0)
HIGH_STEPS = [0, 1, 2]


@pytest.fixture(scope="module")
def wan22():
    return tiny_wan22(guidance_scale=3.0, guidance_scale_2=2.0)


@pytest.fixture(scope="module")
def rollout(wan22):
    return generate(wan22, PROMPTS, 2, SDE, seed=5, batch_size=2, decode=False)


def test_each_step_is_made_by_the_expert_of_its_timestep_and_recorded(wan22, rollout):
    timesteps = rollout.sigmas[:-1] * 1000
    assert rollout.experts.tolist() == [0 if t >= 875 else 1 for t in timesteps.tolist()]
    assert [i for i, e in enumerate(rollout.experts.tolist()) if e == 0] == HIGH_STEPS
    assert wan22.expert_names == ("high", "low")


def test_ode_rollout_reproduces_wan_pipeline_with_both_experts_and_scales(wan22, monkeypatch):
    """WanPipeline's own loop (its expert switch, guidance_scale and guidance_scale_2) from our initial noise."""
    ode = generate(wan22, PROMPTS, 1, SDEConfig(variant="ode", steps=6), seed=0, batch_size=2, decode=False)
    scheduler = wan22.pipeline.scheduler
    set_timesteps = scheduler.set_timesteps
    custom_sigmas = lambda n, device=None: set_timesteps(sigmas=np.linspace(1.0, 0.0, n + 1)[:-1], device=device)
    monkeypatch.setattr(scheduler, "set_timesteps", custom_sigmas)
    wan22.pipeline.set_progress_bar_config(disable=True)
    expected = wan22.pipeline(
        prompt_embeds=ode.embeddings.tensors["prompt_embeds"],
        negative_prompt_embeds=ode.embeddings.negative["prompt_embeds"],
        guidance_scale=3.0,
        guidance_scale_2=2.0,
        latents=ode.latents[:, 0],
        num_inference_steps=6,
        height=wan22.height,
        width=wan22.width,
        num_frames=wan22.num_frames,
        output_type="latent",
    ).frames
    torch.testing.assert_close(ode.latents[:, -1], expected, rtol=1e-5, atol=1e-5)
    # The low-noise scale matters: with guidance_scale_2 = guidance_scale the pipeline ends elsewhere.
    other = wan22.pipeline(
        prompt_embeds=ode.embeddings.tensors["prompt_embeds"],
        negative_prompt_embeds=ode.embeddings.negative["prompt_embeds"],
        guidance_scale=3.0,
        latents=ode.latents[:, 0],
        num_inference_steps=6,
        height=wan22.height,
        width=wan22.width,
        num_frames=wan22.num_frames,
        output_type="latent",
    ).frames
    assert (other - expected).abs().max() > 1e-3


def test_recomputed_log_probs_are_exact_with_the_recorded_experts(wan22, rollout):
    assert torch.equal(recompute_log_probs(wan22, rollout, range(SDE.steps)).log_probs, rollout.log_probs)


def test_a_batch_mixing_both_experts_scores_each_sample_with_its_own(wan22, rollout):
    """A forward batching several timesteps (transitions_per_micro_step > 1) splits by expert."""
    samples = torch.tensor([0, 1, 2, 3])
    steps = torch.tensor([1, 4, 2, 5])  # high, low, high, low
    batched = score_transition(wan22, rollout, samples, steps)
    for i, (sample, step) in enumerate(zip(samples.tolist(), steps.tolist())):
        torch.testing.assert_close(batched.log_prob[i], rollout.log_probs[sample, step], rtol=1e-5, atol=1e-4)


def test_scoring_with_another_boundary_than_the_rollouts_is_refused(wan22, rollout):
    boundary = wan22.boundary_ratio
    wan22.boundary_ratio = 0.5
    try:
        with pytest.raises(ValueError, match="boundary changed"):
            recompute_log_probs(wan22, rollout, [3])
    finally:
        wan22.boundary_ratio = boundary


def test_each_expert_moves_only_its_own_steps(wan22, rollout):
    """Perturbing the low-noise expert changes the log-probs of low-noise steps only."""
    low = wan22.transformer.low
    saved = {k: v.clone() for k, v in low.state_dict().items()}
    try:
        with torch.no_grad():
            for p in low.parameters():
                p.add_(0.05 * torch.randn_like(p))
        moved = recompute_log_probs(wan22, rollout, range(SDE.steps)).log_probs
    finally:
        low.load_state_dict(saved)
    trained = torch.nonzero(rollout.trained_steps).flatten().tolist()
    for t in trained:
        same = torch.equal(moved[:, t], rollout.log_probs[:, t])
        assert same == (t in HIGH_STEPS), t


def test_train_experts_leaves_the_other_experts_steps_untrained():
    low_only = tiny_wan22(train_experts=["low"])
    sigmas = low_only.sigma_schedule(SDE.steps, SDE.shift)
    mask = trained_steps(SDE, low_only, sigmas)
    assert [t for t in range(SDE.steps) if mask[t]] == [3, 4, 5]  # the last step (to sigma 0) trains too
    assert [m is low_only.transformer.low for m in low_only.trainable_modules()] == [True]
    both = tiny_wan22()
    assert trained_steps(SDE, both, sigmas).sum() == 6
    check_every_trained_expert_trains(SDE, both, sigmas)
    with pytest.raises(ValueError, match="'high' expert is trained"):
        check_every_trained_expert_trains(SDE.model_copy(update={"window": (3, 5)}), both, sigmas)


def test_single_expert_wan_is_unchanged():
    wan = tiny_wan()
    assert wan.expert_names == ("transformer",) and wan.trainable_modules() == [wan.transformer]
    recorded = generate(wan, PROMPTS[:1], 2, SDE, seed=1, batch_size=2, decode=False)
    assert recorded.experts.tolist() == [0] * SDE.steps


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"boundary_ratio": None}, "no boundary_ratio"),
        ({"guidance_scale": 1.0, "guidance_scale_2": 3.0}, "ignored"),
        ({"train_experts": ["middle"]}, "train_experts must name"),
        ({"train_experts": ["low", "low"]}, "twice"),
    ],
)
def test_settings_wan_pipeline_would_not_honour_are_refused(kwargs, match):
    pipeline = tiny_wan_pipeline(boundary_ratio=0.875)
    if "boundary_ratio" in kwargs:  # a transformer_2 without a boundary
        pipeline.register_to_config(boundary_ratio=kwargs.pop("boundary_ratio"))
    with pytest.raises(ValueError, match=match):
        WanAdapter(pipeline, identity="t", **kwargs)


def test_expert_keys_are_refused_for_single_expert_models():
    with pytest.raises(ValueError, match="two-expert"):
        WanAdapter(tiny_wan_pipeline(), identity="t", train_experts=["low"])
    with pytest.raises(ValueError, match="train_experts"):
        ModelConfig(name="tiny-hunyuan15", train_experts=["low"])
    config = ModelConfig(name="tiny-wan22", guidance_scale=4.0, guidance_scale_2=3.0, train_experts=["high"])
    assert config.expert_arguments() == {"guidance_scale_2": 3.0, "train_experts": ["high"]}


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_shipped_a14b_configs_hold_wan22s_own_sampling_settings(kind):
    from pathlib import Path

    from sage_grpo.pipeline.config import load_run_config

    config = load_run_config(Path(__file__).parents[2] / "configs" / f"wan22_a14b_sage_{kind}.yaml")
    model = config.model
    assert (model.name, model.guidance_scale, model.guidance_scale_2, model.train_experts) == (
        "wan", 4.0, 3.0, ["high", "low"]
    )  # fmt: skip
    assert (model.kwargs["height"], model.kwargs["width"], model.kwargs["num_frames"]) == (480, 832, 81)
    assert (config.sde.steps, config.sde.shift) == (20, 12.0) and config.lora.enabled == (kind == "lora")


def test_forward_flops_count_one_expert():
    """What the MFU is computed from: one expert runs per forward; Wan's patch is a (frames, height, width) tuple."""
    from sage_grpo.stages.update import model_forward_flops

    two, one = tiny_wan22(), tiny_wan()
    assert model_forward_flops(two.transformer, two) == model_forward_flops(one.transformer, one) > 0
