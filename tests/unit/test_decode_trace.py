"""The VAE decode traced on fake tensors (``memory_trace.trace_*_decode``) against the same decode measured on real
ones: the model adapter's own ``decode``, diffusers' tiling included."""

import pytest
import torch

from benchmarks.traced_block_check import profiled_cpu_peak
from sage_grpo.core import memory_trace

pytestmark = pytest.mark.unit

# Narrow VAEs of the real classes. HunyuanVideo 1.5's compresses 32x in space so that diffusers' default tiles (256 x
# 256 pixels, 8 x 8 latents) split a 10 x 10 latent grid into 2 x 2 tiles that overlap. Each in its adapter's dtype:
# in float32 the CPU runs a 3-D convolution of one sample through an im2col buffer 27x its input, which a GPU's
# kernels do not allocate and the trace does not count (bf16 convolutions here run without one).
TINY_HUNYUAN15_VAE = {
    "latent_channels": 4,
    "block_out_channels": (8, 8, 8, 8, 8),
    "layers_per_block": 1,
    "spatial_compression_ratio": 32,
    "temporal_compression_ratio": 2,
    "downsample_match_channel": False,
    "upsample_match_channel": False,
}
TINY_WAN_VAE = {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1}


def _hunyuanvideo15():
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Pipeline

    from sage_grpo.core.models.hunyuan15 import HunyuanVideo15Adapter

    return AutoencoderKLHunyuanVideo15, HunyuanVideo15Pipeline, HunyuanVideo15Adapter


def _wan():
    from diffusers import AutoencoderKLWan, WanPipeline

    from sage_grpo.core.models.wan import WanAdapter

    return AutoencoderKLWan, WanPipeline, WanAdapter


# (classes, config, latent channels, the call, the trace, the adapter's VAE dtype)
CASES = {
    "hunyuan15 tiled": (
        _hunyuanvideo15,
        TINY_HUNYUAN15_VAE,
        4,
        memory_trace.DecodeCall(1, (2, 10, 10), tiling=True),
        memory_trace.trace_hunyuanvideo15_decode,
        torch.bfloat16,
    ),
    "wan": (
        _wan,
        TINY_WAN_VAE,
        16,
        memory_trace.DecodeCall(2, (3, 8, 12)),
        memory_trace.trace_wan_decode,
        torch.float32,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_traced_decode_peak_of_a_tiny_vae_is_the_measured_one(case):
    classes, config, channels, call, trace, dtype = CASES[case]
    vae_class, pipeline_class, adapter_class = classes()
    torch.manual_seed(0)
    with memory_trace.default_dtype(dtype):
        vae = vae_class(**config).eval()
    if call.tiling:
        vae.enable_tiling()
        assert vae.tile_latent_min_width < call.latent_grid[2]  # the decode is tiled
    latents = torch.randn(call.batch, channels, *call.latent_grid)  # float32, as the rollout keeps them
    decode = memory_trace.adapter_decode(adapter_class, pipeline_class, vae)
    measured = profiled_cpu_peak(lambda: decode(latents))
    traced = trace(config, call, dtype=dtype)
    assert traced.peak == pytest.approx(measured, rel=0.15)


def test_tiling_bounds_the_decode_activations_by_a_tiles():
    # Tiled, a twice wider video adds its decoded tiles and its output, not activations of twice the width.
    grid, wider = (3, 10, 10), (3, 10, 20)
    tiled, tiled_wider, untiled_wider = (
        memory_trace.trace_hunyuanvideo15_decode(TINY_HUNYUAN15_VAE, memory_trace.DecodeCall(1, g, tiling=on)).peak
        for g, on in ((grid, True), (wider, True), (wider, False))
    )
    assert tiled < tiled_wider < 1.5 * tiled < untiled_wider


@pytest.mark.parametrize(("frames", "tokens_per_frame", "batch"), [(3, 4, 2), (1, 5, None), (4, 1, 1)])
def test_the_causal_mask_built_by_frame_is_diffusers_mask(frames, tokens_per_frame, batch):
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock

    arguments = (frames, tokens_per_frame, torch.float32, "cpu", batch)
    expected = HunyuanVideo15AttnBlock.prepare_causal_attention_mask(*arguments)
    built = memory_trace.causal_mask_by_frame(*arguments)
    assert built.shape == expected.shape and torch.equal(built, expected)
