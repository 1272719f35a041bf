"""The model adapters on tiny HunyuanVideo 1.5 and Wan: offline construction, shapes, CFG, the ``module`` switch."""

import copy

import pytest
import torch

from sage_grpo.core.errors import UserError
from sage_grpo.core.models import PromptEmbeddings, build_adapter
from sage_grpo.core.models.hunyuan15 import HunyuanVideo15Adapter
from sage_grpo.core.models.tiny import tiny_hunyuan15, tiny_hunyuan15_pipeline, tiny_wan, tiny_wan_pipeline
from sage_grpo.core.models.wan import WanAdapter

pytestmark = pytest.mark.unit

PROMPTS = ["a red fox runs through snow", 'a neon sign that says "open"']
TINY = {"tiny-hunyuan15": tiny_hunyuan15, "tiny-wan": tiny_wan}


def transformer_batch_sizes(adapter):
    """Record the batch size of every transformer call; returns the list and the hook handle."""
    sizes = []
    handle = adapter.transformer.register_forward_hook(
        lambda module, args, kwargs, output: sizes.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    return sizes, handle


def test_a_sized_tiny_hunyuan_keeps_its_encoders_and_takes_the_transformer_config_from_the_model_section():
    # What the GPU check and the compute-bound benchmark run: model.kwargs.transformer, as YAML gives it (a list).
    sized = {"num_attention_heads": 4, "attention_head_dim": 16, "num_layers": 3, "rope_axes_dim": [4, 6, 6]}
    adapter = build_adapter("tiny-hunyuan15", guidance_scale=1.0, height=64, width=64, transformer=sized)
    tiny = tiny_hunyuan15()
    config = adapter.transformer.config

    assert (config.num_attention_heads, config.attention_head_dim, config.num_layers) == (4, 16, 3)
    assert len(adapter.transformer.transformer_blocks) == 3 and tuple(config.rope_axes_dim) == (4, 6, 6)
    assert adapter.encoder_identity == tiny.encoder_identity  # same encoders: embedding caches stay valid
    latents = torch.randn(1, *adapter.latent_shape())
    velocity = adapter.predict_velocity(latents, torch.full((1,), 0.5), adapter.encode_prompts(PROMPTS[:1]))
    assert velocity.shape == latents.shape == (1, 4, 3, 16, 16) and torch.isfinite(velocity).all()


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_models_build_offline_and_round_trip_shapes(name):
    adapter = build_adapter(name, guidance_scale=1.0)
    embeddings = adapter.encode_prompts(PROMPTS)
    latents = torch.randn(2, *adapter.latent_shape())
    velocity = adapter.predict_velocity(latents, torch.full((2,), 0.7), embeddings)
    video = adapter.decode(latents)

    assert velocity.shape == latents.shape and velocity.dtype == torch.float32
    assert video.dtype == torch.uint8
    assert video.shape == (2, adapter.num_frames, adapter.height, adapter.width, 3)
    assert embeddings.negative is None


def test_tiny_latent_shapes():
    assert tiny_hunyuan15().latent_shape() == (4, 3, 8, 8)
    assert tiny_wan().latent_shape() == (16, 3, 8, 8)


def test_same_seed_same_weights_and_different_seed_different_weights():
    weights = lambda adapter: torch.cat([p.flatten() for p in adapter.transformer.parameters()])
    assert torch.equal(weights(tiny_wan(seed=3)), weights(tiny_wan(seed=3)))
    assert not torch.equal(weights(tiny_wan(seed=3)), weights(tiny_wan(seed=4)))


def test_registry_accepts_a_dotted_factory_path_and_rejects_unknown_names():
    adapter = build_adapter("sage_grpo.core.models.tiny:tiny_wan", seed=1)
    assert isinstance(adapter, WanAdapter)
    with pytest.raises(UserError, match="unknown model"):
        build_adapter("no-such-model")


@pytest.mark.parametrize("name", sorted(TINY))
def test_guidance_scale_one_never_computes_the_unconditional_branch(name):
    adapter = TINY[name](guidance_scale=1.0)
    sizes, handle = transformer_batch_sizes(adapter)
    latents = torch.randn(3, *adapter.latent_shape())
    adapter.predict_velocity(latents, torch.full((3,), 0.5), adapter.encode_prompts(PROMPTS + ["x"]))
    handle.remove()
    assert sizes == [3]


@pytest.mark.parametrize("name", sorted(TINY))
def test_cfg_is_uncond_plus_scale_times_difference_in_one_batched_call(name):
    adapter = TINY[name](guidance_scale=4.0)
    embeddings = adapter.encode_prompts(PROMPTS)
    latents, sigma = torch.randn(2, *adapter.latent_shape()), torch.full((2,), 0.6)
    sizes, handle = transformer_batch_sizes(adapter)
    guided = adapter.predict_velocity(latents, sigma, embeddings)
    handle.remove()

    adapter.guidance_scale = 1.0  # now each branch alone
    cond = adapter.predict_velocity(latents, sigma, PromptEmbeddings(embeddings.tensors))
    uncond = adapter.predict_velocity(latents, sigma, PromptEmbeddings(embeddings.negative))
    assert sizes == [4]
    torch.testing.assert_close(guided, uncond + 4.0 * (cond - uncond), rtol=1e-5, atol=1e-5)


def test_hunyuan_takes_its_default_scale_from_the_pipeline_guider_and_installs_its_own():
    pipeline = tiny_hunyuan15_pipeline()
    pipeline.guider = pipeline.guider.new(guidance_scale=6.0)
    assert HunyuanVideo15Adapter(pipeline, identity="t").guidance_scale == 6.0
    HunyuanVideo15Adapter(pipeline, guidance_scale=2.5, identity="t")
    assert pipeline.guider.guidance_scale == 2.5


@pytest.mark.parametrize("name", sorted(TINY))
def test_module_argument_replaces_the_transformer(name):
    adapter = TINY[name](guidance_scale=3.0)
    embeddings = adapter.encode_prompts(PROMPTS)
    latents, sigma = torch.randn(2, *adapter.latent_shape()), torch.full((2,), 0.4)
    anchor = copy.deepcopy(adapter.transformer)
    own = adapter.predict_velocity(latents, sigma, embeddings)
    torch.testing.assert_close(adapter.predict_velocity(latents, sigma, embeddings, module=anchor), own, rtol=0, atol=0)

    with torch.no_grad():
        for parameter in anchor.parameters():
            parameter.add_(0.05)
    sizes, handle = transformer_batch_sizes(adapter)
    moved = adapter.predict_velocity(latents, sigma, embeddings, module=anchor)
    handle.remove()
    assert sizes == [] and not torch.allclose(moved, own)


def test_pipelines_built_in_code_need_an_identity_for_the_embedding_cache():
    with pytest.raises(ValueError, match="identity"):
        HunyuanVideo15Adapter(tiny_hunyuan15_pipeline())
    with pytest.raises(ValueError, match="identity"):
        WanAdapter(tiny_wan_pipeline())
    assert tiny_hunyuan15(seed=2).encoder_identity != tiny_hunyuan15(seed=3).encoder_identity


def test_wan_two_expert_checkpoints_are_refused():
    pipeline = tiny_wan_pipeline()
    pipeline.register_modules(transformer_2=copy.deepcopy(pipeline.transformer))
    with pytest.raises(ValueError, match="transformer_2"):
        WanAdapter(pipeline, identity="t")


def test_hunyuan_from_pretrained_loads_a_saved_pipeline(tmp_path):
    tiny_hunyuan15_pipeline().save_pretrained(tmp_path)
    adapter = HunyuanVideo15Adapter.from_pretrained(
        str(tmp_path), dtype=torch.float32, device="cpu", guidance_scale=2.0, height=32, width=32, num_frames=5
    )
    assert adapter.guidance_scale == 2.0
    assert adapter.latent_shape() == (4, 3, 8, 8)
    assert str(tmp_path) in adapter.encoder_identity


def test_wan_from_pretrained_loads_a_saved_pipeline(tmp_path):
    tiny_wan_pipeline().save_pretrained(tmp_path)
    adapter = build_adapter("wan", path_or_hub_id=str(tmp_path), dtype=torch.float32, device="cpu", height=64, width=64)
    assert adapter.pipeline.vae.dtype == torch.float32
    assert adapter.latent_shape() == (16, 21, 8, 8)
