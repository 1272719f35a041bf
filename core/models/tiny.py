"""Tiny, randomly initialised HunyuanVideo 1.5 and Wan models for the demo, tests and benchmarks.

They are the real diffusers/transformers classes with toy configs, built offline in about a second: no downloads,
tokenizers constructed in code. The same ``seed`` always gives the same weights. Latents are 3 frames of 8x8, so one
transformer call takes a few milliseconds on a CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenizers import pre_tokenizers

from sage_grpo.core.lazy import lazy_module

from .hunyuan15 import HunyuanVideo15Adapter
from .wan import WanAdapter

if TYPE_CHECKING:
    from diffusers import HunyuanVideo15Pipeline, WanPipeline
    from transformers import Qwen2Tokenizer

torch = lazy_module("torch", globals())

# Qwen2's chat template, text-only: what HunyuanVideo 1.5's prompt template is applied through.
_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ByT5's vocabulary: 3 special tokens, 256 bytes, 125 sentinel ids. Both tiny models use a byte tokenizer.
_BYT5_VOCAB = 384


TINY_HUNYUAN15_TRANSFORMER = {
    "in_channels": 9,  # 4 latent + 4 condition latent + 1 mask channels
    "out_channels": 4,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "num_layers": 1,
    "num_refiner_layers": 1,
    "mlp_ratio": 2.0,
    "text_embed_dim": 16,
    "text_embed_2_dim": 32,
    "image_embed_dim": 12,
    "rope_axes_dim": (2, 2, 4),
    "target_size": 16,
    "task_type": "t2v",
}
TINY_WAN_TRANSFORMER = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 256,
    "ffn_dim": 32,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}
# Latent frames and pixels per latent of the tiny VAEs: (spatial, temporal) compression.
TINY_HUNYUAN15_VAE = {"spatial_compression_ratio": 4, "temporal_compression_ratio": 2}
TINY_WAN_VAE = {"scale_factor_spatial": 8, "scale_factor_temporal": 4}
# The tiny Wan 2.1 VAE squeezes 16 latent channels through 3: the mean brightness of its videos varies by 7e-5 across
# the samples of a rollout, which no reward on brightness can move. The two-expert model's VAE is wider and its output
# layer's random weights 10x larger: 1.9e-3, as the tiny HunyuanVideo 1.5's (1.9e-3), so the demo's reward can rise.
# (Std of the mean luma over 8 videos, 2 prompts x 4, of one rollout: sde sage, eta 0.7, 8 steps, shift 3.)
TINY_WAN22_VAE_DIM = 8
TINY_WAN22_VAE_GAIN = 10.0


def tiny_qwen2_tokenizer() -> Qwen2Tokenizer:
    """A byte-level Qwen2 tokenizer without merges: one token per byte, plus the chat special tokens."""
    from transformers import Qwen2Tokenizer

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for byte_char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[byte_char] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = _QWEN_CHAT_TEMPLATE
    return tokenizer


def tiny_hunyuan15_pipeline(
    seed: int = 0,
    *,
    prompt_tokens: int = 32,
    glyph_tokens: int = 8,
    image_tokens: int = 4,
    transformer: dict[str, Any] | None = None,
) -> HunyuanVideo15Pipeline:
    """HunyuanVideo15Pipeline with toy components and sequences shortened to the given token counts.

    ``transformer`` overrides entries of the transformer's config, by diffusers' names (``num_attention_heads``,
    ``attention_head_dim``, ``num_layers``, ``mlp_ratio``, ``rope_axes_dim`` summing to the head dim): a transformer
    as wide and deep as a benchmark needs, between the same cheap encoders and VAE."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = TINY_HUNYUAN15_TRANSFORMER | (transformer or {})
    config["rope_axes_dim"] = tuple(config["rope_axes_dim"])  # a YAML list
    transformer = HunyuanVideo15Transformer3DModel(**config)
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=4,
        block_out_channels=(16, 16),
        layers_per_block=1,
        **TINY_HUNYUAN15_VAE,
        downsample_match_channel=False,
        upsample_match_channel=False,
    )
    qwen = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=300,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            rope_theta=1000000.0,
            bos_token_id=0,
            eos_token_id=2,
        )
    )
    byt5 = T5EncoderModel(
        T5Config(
            vocab_size=_BYT5_VOCAB, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2, is_encoder_decoder=False
        )
    )
    pipeline = HunyuanVideo15Pipeline(
        text_encoder=qwen.eval(),
        tokenizer=tiny_qwen2_tokenizer(),
        transformer=transformer.eval(),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=byt5.eval(),
        tokenizer_2=ByT5Tokenizer(),
        guider=ClassifierFreeGuidance(guidance_scale=1.0),
    )
    # The real template's system prompt is 108 Qwen tokens long; with a byte tokenizer it is longer, so crop at its
    # true length. Short text windows and few (masked-out, t2v) image tokens keep every call cheap.
    pipeline.prompt_template_encode_start_idx = _template_prefix_tokens(pipeline)
    pipeline.tokenizer_max_length = prompt_tokens
    pipeline.tokenizer_2_max_length = glyph_tokens
    pipeline.vision_num_semantic_tokens = image_tokens
    return pipeline


def _template_prefix_tokens(pipeline: HunyuanVideo15Pipeline) -> int:
    """Number of tokens before the user's prompt in HunyuanVideo 1.5's chat template."""
    prefix = f"<|im_start|>system\n{pipeline.system_message}<|im_end|>\n<|im_start|>user\n"
    return len(pipeline.tokenizer(prefix).input_ids)


def tiny_hunyuan15(
    guidance_scale: float = 1.0,
    seed: int = 0,
    *,
    height: int = 32,
    width: int = 32,
    num_frames: int = 5,
    dtype: torch.dtype | None = None,  # None: float32
    device: str | torch.device = "cpu",
    transformer: dict[str, Any] | None = None,
) -> HunyuanVideo15Adapter:
    """Tiny HunyuanVideo 1.5: latents [4, 3, 8, 8], videos of 5 frames at 32x32 by default; ``transformer``
    overrides the transformer's config (``tiny_hunyuan15_pipeline``)."""
    dtype = torch.float32 if dtype is None else dtype
    pipeline = tiny_hunyuan15_pipeline(seed, transformer=transformer).to(device=device, dtype=dtype)
    return HunyuanVideo15Adapter(
        pipeline,
        guidance_scale=guidance_scale,
        height=height,
        width=width,
        num_frames=num_frames,
        identity=f"tiny-hunyuan15-seed{seed}",
    )


def tiny_wan_pipeline(seed: int = 0, *, boundary_ratio: float | None = None) -> WanPipeline:
    """WanPipeline (Wan 2.1 layout) with toy components and a byte-level T5 tokenizer; with ``boundary_ratio``, the
    Wan 2.2 A14B layout: a second transformer of the same shape, other random weights, as ``transformer_2``."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(**TINY_WAN_TRANSFORMER)
    vae = AutoencoderKLWan(
        base_dim=3 if boundary_ratio is None else TINY_WAN22_VAE_DIM,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )
    if boundary_ratio is not None:
        with torch.no_grad():
            vae.decoder.conv_out.weight.mul_(TINY_WAN22_VAE_GAIN)
    umt5 = UMT5EncoderModel(
        UMT5Config(
            vocab_size=_BYT5_VOCAB, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2, is_encoder_decoder=False
        )
    )
    transformer_2 = None if boundary_ratio is None else WanTransformer3DModel(**TINY_WAN_TRANSFORMER).eval()
    return WanPipeline(
        tokenizer=ByT5Tokenizer(),
        text_encoder=umt5.eval(),
        transformer=transformer.eval(),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        transformer_2=transformer_2,
        boundary_ratio=boundary_ratio,
    )


def tiny_wan(
    guidance_scale: float = 1.0,
    seed: int = 0,
    *,
    height: int = 64,
    width: int = 64,
    num_frames: int = 9,
    dtype: torch.dtype | None = None,  # None: float32
    device: str | torch.device = "cpu",
) -> WanAdapter:
    """Tiny Wan: latents [16, 3, 8, 8], videos of 9 frames at 64x64 by default."""
    return _tiny_wan_adapter(
        tiny_wan_pipeline(seed),
        f"tiny-wan-seed{seed}",
        dtype,
        device,
        guidance_scale=guidance_scale,
        height=height,
        width=width,
        num_frames=num_frames,
    )


def tiny_wan22(
    guidance_scale: float = 1.0,
    seed: int = 0,
    *,
    guidance_scale_2: float | None = None,
    train_experts: list[str] | None = None,
    boundary_ratio: float = 0.875,
    height: int = 64,
    width: int = 64,
    num_frames: int = 9,
    dtype: torch.dtype | None = None,  # None: float32
    device: str | torch.device = "cpu",
) -> WanAdapter:
    """Tiny two-expert Wan 2.2 (the A14B layout, A14B's boundary 0.875 by default): latents as ``tiny_wan``'s."""
    return _tiny_wan_adapter(
        tiny_wan_pipeline(seed, boundary_ratio=boundary_ratio),
        f"tiny-wan22-seed{seed}",
        dtype,
        device,
        guidance_scale=guidance_scale,
        guidance_scale_2=guidance_scale_2,
        train_experts=train_experts,
        height=height,
        width=width,
        num_frames=num_frames,
    )


def _tiny_wan_adapter(pipeline, identity: str, dtype: torch.dtype | None, device, **adapter_options) -> WanAdapter:
    """``pipeline`` in ``dtype`` (None: float32) on ``device``, adapted with the tiny text encoder's 16 tokens."""
    pipeline = pipeline.to(device=device, dtype=torch.float32 if dtype is None else dtype)
    return WanAdapter(pipeline, max_sequence_length=16, identity=identity, **adapter_options)
