"""The rollout stage on tiny models: our ODE loop is the diffusers pipeline's, samples are reproducible per seed and
independent of batching, and recomputed log-probs equal the recorded ones bit for bit before any update."""

import copy

import numpy as np
import pytest
import torch

from sage_grpo.core.models.tiny import tiny_hunyuan15, tiny_wan
from sage_grpo.core.sde import flow_match_sigmas
from sage_grpo.stages.rollout import SDEConfig, generate, recompute_log_probs

pytestmark = pytest.mark.unit

PROMPTS = ["a red fox runs through snow", 'a neon sign that says "open"']
SDE = SDEConfig(variant="sage", eta=0.5, steps=4, shift=5.0)


@pytest.fixture(scope="module")
def hunyuan():
    return tiny_hunyuan15(guidance_scale=1.0)


@pytest.fixture(scope="module")
def hunyuan_cfg():
    return tiny_hunyuan15(guidance_scale=3.0)


@pytest.fixture(scope="module")
def wan():
    return tiny_wan(guidance_scale=3.0)


@pytest.fixture(scope="module")
def rollout(hunyuan_cfg):
    return generate(hunyuan_cfg, PROMPTS, 3, SDE, seed=7, batch_size=4)


# ---------------------------------------------------------------------------------------------------------------------
# Shapes and the correctness anchor
# ---------------------------------------------------------------------------------------------------------------------


def test_rollout_records_every_step_of_every_sample(rollout, hunyuan_cfg):
    n, t = 6, SDE.steps
    assert rollout.latents.shape == (n, t + 1, *hunyuan_cfg.latent_shape())
    assert rollout.log_probs.shape == (n, t) and rollout.stds.shape == (t,)
    assert rollout.latents.dtype == rollout.log_probs.dtype == torch.float32
    assert rollout.videos.shape == (n, 5, 32, 32, 3) and rollout.videos.dtype == torch.uint8
    assert rollout.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert rollout.member_index.tolist() == [0, 1, 2, 0, 1, 2]
    assert rollout.sample_prompts[3] == PROMPTS[1] and rollout.group_size == 3
    torch.testing.assert_close(rollout.sigmas, flow_match_sigmas(t, 5.0).float())
    # Every step is stochastic and trained, the last one (to sigma 0) included.
    assert rollout.trained_steps.tolist() == [True, True, True, True]
    assert torch.all(rollout.log_probs != 0) and torch.all(rollout.stds > 0)


def test_a_deterministic_final_step_neither_injects_noise_nor_trains(hunyuan_cfg):
    config = SDE.model_copy(update={"final_step": "deterministic"})
    rollout = generate(hunyuan_cfg, PROMPTS, 2, config, seed=1, batch_size=2, decode=False)
    assert rollout.trained_steps.tolist() == [True, True, True, False]
    assert torch.all(rollout.log_probs[:, :-1] != 0) and torch.all(rollout.log_probs[:, -1] == 0)
    means = recompute_log_probs(hunyuan_cfg, rollout, [SDE.steps - 1]).means
    assert torch.equal(means[:, -1], rollout.latents[:, -1])  # the recorded video is its mean


def pipeline_final_latents_hunyuan(adapter, rollout):
    """HunyuanVideo15Pipeline's own sampling loop from the rollout's initial noise and prompt embeddings."""
    names = {
        "encoder_hidden_states": "prompt_embeds",
        "encoder_attention_mask": "prompt_embeds_mask",
        "encoder_hidden_states_2": "prompt_embeds_2",
        "encoder_attention_mask_2": "prompt_embeds_mask_2",
    }
    embeddings = rollout.embeddings
    kwargs = {names[k]: v for k, v in embeddings.tensors.items()}
    if embeddings.negative is not None:
        kwargs.update({f"negative_{names[k]}": v for k, v in embeddings.negative.items()})
    adapter.pipeline.set_progress_bar_config(disable=True)
    return adapter.pipeline(
        **kwargs,
        latents=rollout.latents[:, 0],
        num_inference_steps=rollout.sde_config.steps,
        height=adapter.height,
        width=adapter.width,
        num_frames=adapter.num_frames,
        output_type="latent",
    ).frames


@pytest.mark.parametrize("adapter_fixture", ["hunyuan", "hunyuan_cfg"])
def test_ode_rollout_reproduces_the_hunyuan_pipeline(adapter_fixture, request):
    adapter = request.getfixturevalue(adapter_fixture)
    ode = generate(adapter, PROMPTS, 1, SDEConfig(variant="ode", steps=4), seed=0, batch_size=2, decode=False)
    expected = pipeline_final_latents_hunyuan(adapter, ode)
    # Identical without CFG; with CFG the pipeline runs the two branches as separate calls, we batch them.
    tolerance = 0.0 if adapter.guidance_scale == 1.0 else 1e-5
    torch.testing.assert_close(ode.latents[:, -1], expected, rtol=tolerance, atol=tolerance)
    assert torch.all(ode.log_probs == 0) and not torch.any(ode.trained_steps)


def test_ode_rollout_reproduces_the_wan_pipeline(wan, monkeypatch):
    ode = generate(wan, PROMPTS, 1, SDEConfig(variant="ode", steps=4), seed=0, batch_size=2, decode=False)
    # WanPipeline cannot take custom sigmas; give its scheduler the schedule HunyuanVideo 1.5's pipeline uses.
    scheduler = wan.pipeline.scheduler
    set_timesteps = scheduler.set_timesteps
    custom_sigmas = lambda n, device=None: set_timesteps(sigmas=np.linspace(1.0, 0.0, n + 1)[:-1], device=device)
    monkeypatch.setattr(scheduler, "set_timesteps", custom_sigmas)
    wan.pipeline.set_progress_bar_config(disable=True)
    expected = wan.pipeline(
        prompt_embeds=ode.embeddings.tensors["prompt_embeds"],
        negative_prompt_embeds=ode.embeddings.negative["prompt_embeds"],
        guidance_scale=wan.guidance_scale,
        latents=ode.latents[:, 0],
        num_inference_steps=4,
        height=wan.height,
        width=wan.width,
        num_frames=wan.num_frames,
        output_type="latent",
    ).frames
    torch.testing.assert_close(ode.latents[:, -1], expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Reproducibility
# ---------------------------------------------------------------------------------------------------------------------


def test_same_seed_gives_identical_rollouts(rollout, hunyuan_cfg):
    again = generate(hunyuan_cfg, PROMPTS, 3, SDE, seed=7, batch_size=4)
    for field in ("latents", "log_probs", "videos"):
        assert torch.equal(getattr(again, field), getattr(rollout, field)), field


def test_members_of_a_group_and_different_seeds_differ(rollout, hunyuan_cfg):
    first, second = rollout.latents[0], rollout.latents[1]
    assert not torch.allclose(first[0], second[0]) and not torch.allclose(first[-1], second[-1])
    other_seed = generate(hunyuan_cfg, PROMPTS[:1], 1, SDE, seed=8, decode=False)
    assert not torch.allclose(other_seed.latents[0, 0], first[0])


def test_samples_do_not_depend_on_batch_size_or_on_other_prompts(rollout, hunyuan_cfg):
    # The rollout ran batches of 4; here batches of 1, and each group alone (as on another rank, same group id).
    one_at_a_time = generate(hunyuan_cfg, PROMPTS[:1], 3, SDE, seed=7, batch_size=1, decode=False)
    second_group = generate(hunyuan_cfg, PROMPTS[1:], 3, SDE, seed=7, prompt_ids=[1], batch_size=2, decode=False)
    assert torch.equal(one_at_a_time.latents[:, 0], rollout.latents[:3, 0])  # the noise itself is identical
    # The rest agrees to float precision: a batch of 1 takes other CPU kernels than a batch of 4.
    torch.testing.assert_close(one_at_a_time.latents, rollout.latents[:3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second_group.latents, rollout.latents[3:], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Recomputed log-probs
# ---------------------------------------------------------------------------------------------------------------------


def test_recomputed_log_probs_equal_the_recorded_ones_exactly(rollout, hunyuan_cfg):
    steps = range(SDE.steps)
    scores = recompute_log_probs(hunyuan_cfg, rollout, steps)
    assert torch.equal(scores.log_probs, rollout.log_probs)
    # The last step is noisy too: the recorded video is a draw around its mean, and scored like any other step.
    assert not torch.allclose(scores.means[:, -1], rollout.latents[:, -1])
    with torch.enable_grad():  # as in training: the same numbers, now with a gradient
        trained = recompute_log_probs(hunyuan_cfg, rollout, [1], sample_index=rollout.batches[1])
    assert trained.log_probs.requires_grad
    ratio = torch.exp(trained.log_probs.detach() - rollout.log_probs[rollout.batches[1], 1:2])
    assert torch.equal(ratio, torch.ones(2, 1))


def test_recomputed_log_probs_move_when_the_weights_move(rollout, hunyuan_cfg):
    perturbed = copy.deepcopy(hunyuan_cfg.transformer)
    with torch.no_grad():
        for parameter in perturbed.parameters():
            parameter.add_(torch.randn_like(parameter), alpha=0.01)
    scores = recompute_log_probs(hunyuan_cfg, rollout, [0, 2], module=perturbed)
    assert not torch.any(scores.log_probs == rollout.log_probs[:, [0, 2]])
    assert torch.equal(recompute_log_probs(hunyuan_cfg, rollout, [0, 2]).log_probs, rollout.log_probs[:, [0, 2]])


def test_wan_recomputed_log_probs_are_exact_too(wan):
    recorded = generate(wan, PROMPTS, 2, SDE, seed=1, batch_size=2, decode=False)
    assert torch.equal(recompute_log_probs(wan, recorded, range(SDE.steps)).log_probs, recorded.log_probs)


# ---------------------------------------------------------------------------------------------------------------------
# The SDE window
# ---------------------------------------------------------------------------------------------------------------------


def test_steps_outside_the_window_are_deterministic_and_untrained(hunyuan):
    config = SDEConfig(variant="flow", eta=0.7, steps=6, window=(1, 3))
    windowed = generate(hunyuan, PROMPTS[:1], 2, config, seed=3, decode=False)
    outside = [0, 3, 4, 5]
    assert windowed.trained_steps.tolist() == [False, True, True, False, False, False]
    assert torch.all(windowed.stds[outside] == 0) and torch.all(windowed.stds[[1, 2]] > 0)
    assert torch.all(windowed.log_probs[:, outside] == 0)
    means = recompute_log_probs(hunyuan, windowed, outside).means
    assert torch.equal(windowed.latents[:, [t + 1 for t in outside]], means)
    # Noise on deterministic steps is drawn anyway, so the window's first step sees the same latents as an SDE run.
    full = generate(hunyuan, PROMPTS[:1], 2, config.model_copy(update={"window": None}), seed=3, decode=False)
    assert torch.equal(windowed.latents[:, 0], full.latents[:, 0])


@pytest.mark.parametrize("window", [(0, 0), (2, 1), (0, 21)])
def test_window_must_lie_inside_the_schedule(window):
    with pytest.raises(ValueError, match="window"):
        SDEConfig(steps=20, window=window)


def test_trained_steps_are_the_configs_rule_on_the_rollouts_own_schedule(rollout):
    assert torch.equal(rollout.trained_steps, rollout.sde_config.trained_steps_mask(rollout.sigmas.cpu()))
    assert torch.equal(rollout.sde_config.trained_steps_mask(), rollout.trained_steps)  # config time agrees


@pytest.mark.parametrize("steps", [20, 68, 200, 1000])
def test_long_sage_schedules_validate_and_never_train_a_step_without_noise(steps):
    config = SDEConfig(variant="sage", eta=0.5, steps=steps, shift=5.0)
    trained = config.trained_steps_mask()
    stds = config.noise_stds()
    assert torch.isfinite(stds).all() and torch.equal(trained, stds > 0) and trained[-1]
    assert trained.sum() >= steps * 0.95


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(variant="cps", eta=1.5), "eta"),
        (dict(eta=float("nan")), "eta"),
        (dict(variant="sage", steps=1000, window=(0, 3)), "injects noise"),
    ],
)
def test_schedules_that_cannot_train_are_refused_at_config_time(bad, match):
    with pytest.raises(ValueError, match=match):
        SDEConfig(**({"shift": 5.0} | bad))
