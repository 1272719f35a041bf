"""Memory traced on fake tensors against memory measured on real ones, and the attention that makes no [S, S]
tensor at any K."""

import json
import subprocess
import sys

import pytest
import torch

from benchmarks.traced_block_check import profiled_cpu_peak
from sage_grpo.core import memory_trace
from sage_grpo.core.models.hunyuan15 import KeyPaddingAttnProcessor, fake_tensor_forward, use_key_padding_attention
from sage_grpo.core.models.tiny import TINY_HUNYUAN15_TRANSFORMER, tiny_hunyuan15
from tests.helpers import REPO, worker_environment

pytestmark = pytest.mark.unit

# A real-width HunyuanVideo 1.5 block (16 heads of 128, MLP ratio 4, the released text widths) at a token count
# a CPU runs in seconds.
REAL_WIDTH_ONE_BLOCK = {"num_layers": 1, "num_refiner_layers": 1}


def _model(config: dict, dtype=torch.float32):
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(0)
    with memory_trace.default_dtype(dtype):
        model = HunyuanVideo15Transformer3DModel.from_config(config)
    use_key_padding_attention(model)
    return model


def _real_inputs(config, call: memory_trace.TransformerCall, dtype):
    """The inputs ``_hunyuanvideo15_inputs`` fakes, with values: random latents and text, some text masked."""
    inputs = memory_trace._hunyuanvideo15_inputs(config, call, dtype)
    generator = torch.Generator().manual_seed(1)
    for group in (inputs, inputs["text"]):
        for name, tensor in group.items():
            if name.startswith("encoder_attention_mask"):
                mask = torch.ones_like(tensor)
                mask[:, tensor.shape[1] // 2 :] = 0
                group[name] = mask
            elif isinstance(tensor, torch.Tensor) and name != "image_embeds":
                group[name] = torch.randn(tensor.shape, generator=generator).to(dtype)
    inputs["timestep"] = torch.full_like(inputs["timestep"], 500.0)
    return inputs


def test_the_fake_tensor_forward_is_the_models_forward():
    model = _model(TINY_HUNYUAN15_TRANSFORMER)
    call = memory_trace.TransformerCall(2, (3, 8, 8), text_tokens=(12, 6, 4))
    inputs = _real_inputs(model.config, call, torch.float32)
    with torch.no_grad():
        expected = model(**inputs["text"], **{k: v for k, v in inputs.items() if k != "text"}, return_dict=False)[0]
        traced = fake_tensor_forward(model, **inputs)
    torch.testing.assert_close(traced, expected, rtol=1e-5, atol=1e-5)


def _measured_peak(model, inputs, *, train: bool) -> int:
    """The most bytes the CPU allocator held at once during one step beyond what it held before, from torch's
    profiler's record of every allocation and free (``benchmarks.traced_block_check.profiled_cpu_peak``)."""

    def step():
        with torch.set_grad_enabled(train):
            out = fake_tensor_forward(model, **inputs)
            if train:
                out.float().sum().backward()

    drops = [p.register_post_accumulate_grad_hook(memory_trace._drop_grad) for p in model.parameters()]
    try:
        return profiled_cpu_peak(step)
    finally:
        for handle in drops:
            handle.remove()


def _traced_peak(config, call, dtype) -> int:
    mode = memory_trace.fake_mode()
    with mode, memory_trace.default_dtype(dtype):
        model = _model(config, dtype)
        if call.checkpointing:
            model.enable_gradient_checkpointing()
        inputs = memory_trace._hunyuanvideo15_inputs(model.config, call, dtype)
    step = lambda: fake_tensor_forward(model, **inputs)  # noqa: E731
    return memory_trace.trace_step(mode, model, step, train=call.train).peak


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_traced_peak_of_the_tiny_model_is_the_measured_one(checkpointing):
    # The tiny model's config on a latent grid large enough that activations, not the allocator's small blocks, make
    # the peak: 5 x 32 x 32 video tokens, two blocks, forward and backward.
    config = TINY_HUNYUAN15_TRANSFORMER | {"num_layers": 2}
    call = memory_trace.TransformerCall(2, (5, 32, 32), train=True, checkpointing=checkpointing, text_tokens=(32, 8, 4))
    model = _model(config)
    if checkpointing:
        model.enable_gradient_checkpointing()
    measured = _measured_peak(model, _real_inputs(model.config, call, torch.float32), train=True)
    traced = _traced_peak(config, call, torch.float32)
    assert traced == pytest.approx(measured, rel=0.15)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_traced_peak_of_a_real_width_block_in_bf16_is_the_measured_one(checkpointing):
    call = memory_trace.TransformerCall(1, (2, 8, 16), train=True, checkpointing=checkpointing, text_tokens=(64, 16, 8))
    model = _model(REAL_WIDTH_ONE_BLOCK, torch.bfloat16)
    if checkpointing:
        model.enable_gradient_checkpointing()
    assert model.config.num_attention_heads * model.config.attention_head_dim == 2048
    measured = _measured_peak(model, _real_inputs(model.config, call, torch.bfloat16), train=True)
    traced = _traced_peak(REAL_WIDTH_ONE_BLOCK, call, torch.bfloat16)
    assert traced == pytest.approx(measured, rel=0.15)


_DEPTH_PEAKS = """
import json, torch
from sage_grpo.core import memory_trace
from sage_grpo.core.models.tiny import TINY_HUNYUAN15_TRANSFORMER
from tests.unit.test_memory_trace import _traced_peak

config = TINY_HUNYUAN15_TRANSFORMER | {"num_layers": 6}
peaks = []
for checkpointing in (False, True):
    call = memory_trace.TransformerCall(2, (3, 16, 16), train=True, checkpointing=checkpointing)
    extrapolated = memory_trace.trace_hunyuanvideo15(config, call, dtype=torch.float32).peak
    peaks.append((_traced_peak(config, call, torch.float32), extrapolated))
print(json.dumps(peaks))
"""


def test_depth_is_extrapolated_from_two_and_three_blocks():
    # In a fresh process, as `sagegrpo plan` runs: in a suite worker that earlier test files had used, the
    # extrapolated peak came out 4.3% under the direct one (76872472 vs 80287588, the same numbers twice), from some
    # process-wide state those files leave that is not yet identified (issue 40's note).
    done = subprocess.run(
        [sys.executable, "-c", _DEPTH_PEAKS],
        cwd=REPO,
        env=worker_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for direct, extrapolated in json.loads(done.stdout.strip().splitlines()[-1]):
        assert extrapolated == pytest.approx(direct, rel=0.02)


class SquareWatch(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shape of every tensor an op creates with two dimensions of at least ``length``."""

    def __init__(self, length: int):
        super().__init__()
        self.length = length
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and sum(size >= self.length for size in tensor.shape) >= 2:
                self.found.append(tuple(tensor.shape))
        return out


def _watched_480p_block(processor=None) -> list:
    """The shapes of [S, S] tensors one real-size block makes at 480p (81 x 480 x 848: 33,390 video + 1,985 text
    tokens) with CFG, forward and backward, on fake tensors."""
    call = memory_trace.TransformerCall(2, (21, 30, 53), train=True)
    length = 21 * 30 * 53 + sum(call.text_tokens)
    mode = memory_trace.fake_mode()
    with mode, memory_trace.default_dtype(torch.bfloat16):
        model = _model({"num_layers": 1}, torch.bfloat16)
        if processor is not None:
            model.transformer_blocks[0].attn.set_processor(processor)
        inputs = memory_trace._hunyuanvideo15_inputs(model.config, call, torch.bfloat16)
    watch = SquareWatch(length)
    with mode, watch:
        fake_tensor_forward(model, **inputs).float().sum().backward()
    return watch.found


def test_no_attention_tensor_is_sequence_by_sequence_at_480p():
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    assert _watched_480p_block() == []
    # The watch sees diffusers' own processor build its [B, 1, S, S] mask.
    assert (2, 1, 35375, 35375) in _watched_480p_block(HunyuanVideo15AttnProcessor2_0())


def test_key_padding_attention_gives_diffusers_velocity_at_k_1():
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    from sage_grpo.core.models.base import PromptEmbeddings

    adapter = tiny_hunyuan15(guidance_scale=4.0)
    assert all(isinstance(b.attn.processor, KeyPaddingAttnProcessor) for b in adapter.transformer.transformer_blocks)
    embeddings = adapter.encode_prompts(["a red ball", "a long prompt about a cat on a mat"])
    assert isinstance(embeddings, PromptEmbeddings)
    latents = torch.randn(2, *adapter.latent_shape(), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        ours = adapter.predict_velocity(latents, sigma, embeddings)
        for block in adapter.transformer.transformer_blocks:
            block.attn.set_processor(HunyuanVideo15AttnProcessor2_0())
        theirs = adapter.predict_velocity(latents, sigma, embeddings)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


class _Attention(torch.nn.Module):
    """SDPA on a scaled query: a parameter for the training step to reach, and no other FLOPs."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, query):
        return torch.nn.functional.scaled_dot_product_attention(query * self.scale, query, query)


def test_attention_flops_are_counted_on_fake_cpu_tensors():
    # On fake CPU tensors SDPA runs the CPU flash kernel, which torch's flop registry leaves out: without a formula
    # for it, attention (about half a 480p video transformer's FLOPs) would count 0.
    batch, heads, tokens, head_dim = 2, 4, 96, 32
    mode = memory_trace.fake_mode()
    with mode:
        module, query = _Attention(), torch.empty(batch, heads, tokens, head_dim)
    forward = memory_trace.trace_step(mode, module, lambda: module(query), train=False).flops
    # Two matmuls of [S, D] x [D, S] and [S, S] x [S, D] per head, 2 FLOPs a multiply-add.
    assert forward == 4 * batch * heads * tokens**2 * head_dim
    # The backward: torch's own SDPA formula, 2.5 times the forward.
    assert memory_trace.trace_step(mode, module, lambda: module(query), train=True).flops == 3.5 * forward
