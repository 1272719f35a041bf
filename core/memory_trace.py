"""Memory and FLOPs of one model step, traced on fake tensors: the real modules at their real size, run without
allocating anything (torch's ``FakeTensorMode``, as torchtitan's memory estimation does), every tensor storage they
create counted while it lives and every FLOP by ``torch.utils.flop_counter``'s formulas.

What a trace measures is what one step adds to the memory that was alive when it began (the weights and the step's
inputs): activations, the tensors kept for backward, temporaries, gradients as they arise. Under ZeRO-3 a gradient
leaves the GPU as soon as it is reduced, so a training step drops each gradient once it has accumulated (the
bucket DeepSpeed reduces it in is counted with the model states). Model states, optimizer state and whatever else
lives across steps are counted by the caller.

Deep models are traced at two and at three blocks and extrapolated to their depth (``over_depth``): every block adds
the same tensors (its input kept for a checkpointed backward, or its whole activations without checkpointing), so
memory and FLOPs are affine in the number of blocks, and tracing 54 blocks would take a minute where two take a
second. ``tests/unit/test_memory_trace.py`` checks the extrapolation against a trace at full depth.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from sage_grpo.core.lazy import lazy_module

torch = lazy_module("torch", globals())


@dataclass(frozen=True)
class StepTrace:
    """``peak``: the most bytes alive at once during the step beyond those alive when it began; ``flops``: the
    step's FLOPs as ``torch.utils.flop_counter`` counts them (matmuls, convolutions, attention; forward and, for a
    training step, backward); ``gathered``: the bytes of the module's parameters the step read, which ZeRO-3
    gathers for it (block by block, each released after use)."""

    peak: int
    flops: int
    gathered: int = 0

    def __add__(self, other: StepTrace) -> StepTrace:
        return StepTrace(self.peak + other.peak, self.flops + other.flops, self.gathered + other.gathered)

    def __sub__(self, other: StepTrace) -> StepTrace:
        return StepTrace(self.peak - other.peak, self.flops - other.flops, self.gathered - other.gathered)

    def __mul__(self, factor: int) -> StepTrace:
        return StepTrace(self.peak * factor, self.flops * factor, self.gathered * factor)


def fake_mode():
    """A ``FakeTensorMode`` in which modules built and run allocate nothing. Tensors made outside it (Python
    scalars, small constants) are accepted and treated as fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def default_dtype(dtype):
    """Modules built inside get parameters of ``dtype``: how a fake module is built in bf16 (``module.to`` cannot
    swap fake parameters)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class _Tally:
    """Bytes of the tensor storages alive, and their most at once: each storage counted when an op returns it new
    (not a view of one of its inputs) and uncounted when it is freed; and the ops' FLOPs, by
    ``torch.utils.flop_counter``'s formulas (its ``FlopCounterMode`` hooks every module to attribute FLOPs, and
    those hooks keep the activations of checkpointed blocks alive). torch's ``MemTracker`` counts storages the same
    way and attributes every byte to a module, which costs a walk over all modules per op: a minute per trace of a
    real-size model. ``parameters``: the bytes of each parameter storage (by id), of which the ops' inputs mark
    those read."""

    def __init__(self, parameters: dict[int, int]):
        self.current = 0
        self.peak = 0
        self.flops = 0
        self.parameters = parameters
        self.read: set[int] = set()
        self._seen: set[int] = set()

    @property
    def gathered(self) -> int:
        return sum(self.parameters[key] for key in self.read)

    def add(self, tensor, inputs: set[int]) -> None:
        """Count ``tensor``'s storage unless it is one of the op's ``inputs`` (storage ids) or already counted."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._seen or key in inputs:
            return
        size = storage.nbytes()
        self._seen.add(key)
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.current -= size


def _tallying(tally: _Tally):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import flop_registry

    formulas = {**flop_registry, **_cpu_attention_formulas()}

    class Tallying(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensors = lambda tree: [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]  # noqa: E731
            inputs = {id(t.untyped_storage()) for t in tensors((args, kwargs))}
            tally.read |= inputs & tally.parameters.keys()
            out = func(*args, **kwargs)
            for tensor in tensors(out):
                tally.add(tensor, inputs)
            formula = formulas.get(func._overloadpacket)
            if formula is not None:
                tally.flops += formula(*args, **kwargs, out_val=out)
            return out

    return Tallying()


def _cpu_attention_formulas() -> dict:
    """FLOPs of the CPU flash attention that SDPA dispatches to on fake CPU tensors, which ``flop_registry`` leaves
    out (it counts the CUDA kernels the same call runs on a GPU): the registry's own SDPA counts, forward and
    backward."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def forward(query, key, value, *args, **kwargs) -> int:
        return sdpa_flop_count(query.shape, key.shape, value.shape)

    def backward(grad_out, query, key, value, *args, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)

    return {
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }


def trace_step(mode, module: torch.nn.Module, call: Callable[[], object], *, train: bool) -> StepTrace:
    """Run ``call()`` (which calls ``module``) once under ``mode`` (``fake_mode()``, in which ``module`` and the
    call's inputs were made) and count it. ``train``: ``call`` returns a tensor whose sum is backpropagated, and each
    parameter's gradient is dropped once it has accumulated, as ZeRO-3 reduces it away."""
    drops = [p.register_post_accumulate_grad_hook(_drop_grad) for p in module.parameters() if train and p.requires_grad]
    tally = _Tally({id(p.untyped_storage()): p.untyped_storage().nbytes() for p in module.parameters()})
    try:
        with mode, _tallying(tally):
            with contextlib.nullcontext() if train else torch.no_grad():
                out = call()
                if train:
                    out.float().sum().backward()
            del out
    finally:
        for handle in drops:
            handle.remove()
    return StepTrace(peak=tally.peak, flops=tally.flops, gathered=tally.gathered)


def _drop_grad(param) -> None:
    param.grad = None


def over_depth(trace_at: Callable[[int], StepTrace], depth: int) -> StepTrace:
    """The trace of a ``depth``-block model from traces at two and three blocks (``trace_at(blocks)``), each further
    block adding what the third added. (The second can differ: where the peak falls moves from the first block's
    backward to a later one's.)"""
    if depth <= 3:
        return trace_at(depth)
    two, three = trace_at(2), trace_at(3)
    return two + (three - two) * (depth - 2)


def parameter_count(build: Callable[[], torch.nn.Module]) -> int:
    """Parameters of the module ``build()`` makes, built on the meta device: nothing is allocated or read."""
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


# HunyuanVideo 1.5's text-side inputs of the released pipeline: 1000 Qwen2.5-VL positions, 256 ByT5 positions and
# 729 SigLIP image slots (zeroed for text-to-video, but still in the sequence).
HUNYUANVIDEO15_TEXT_TOKENS = {"qwen": 1000, "byt5": 256, "image": 729}


@dataclass(frozen=True)
class TransformerCall:
    """One HunyuanVideo 1.5 transformer call as a phase makes it: ``batch`` sequences (samples x CFG branches) of
    latents [frames, height, width], a forward alone or a forward and backward (``train``), on 1/K of the tokens."""

    batch: int
    latent_grid: tuple[int, int, int]
    train: bool = False
    checkpointing: bool = False
    sequence_parallel: int = 1
    text_tokens: tuple[int, int, int] = tuple(HUNYUANVIDEO15_TEXT_TOKENS.values())


def trace_hunyuanvideo15(transformer_config: dict, call: TransformerCall, *, lora_config=None, dtype=None) -> StepTrace:
    """One call of ``HunyuanVideo15Transformer3DModel`` built from ``transformer_config`` in ``dtype`` (bf16 by
    default) with the run's attention (``core.models.hunyuan15.KeyPaddingAttnProcessor``), LoRA adapter
    (``lora_config``, a ``core.lora.LoraConfig``) and gradient checkpointing, traced at two and three blocks and
    extrapolated to the config's depth."""
    from diffusers import HunyuanVideo15Transformer3DModel

    from sage_grpo.core.lora import add_lora
    from sage_grpo.core.models.hunyuan15 import fake_tensor_forward, use_key_padding_attention

    dtype = torch.bfloat16 if dtype is None else dtype
    depth = {**init_defaults(HunyuanVideo15Transformer3DModel), **transformer_config}["num_layers"]

    def at(blocks: int) -> StepTrace:
        mode = fake_mode()
        with mode, default_dtype(dtype):
            model = HunyuanVideo15Transformer3DModel.from_config({**transformer_config, "num_layers": blocks})
            use_key_padding_attention(model)
            if lora_config is not None and lora_config.enabled:
                with _adapters_made_in_place():
                    add_lora(model, lora_config)
            if call.checkpointing:
                model.enable_gradient_checkpointing()
            inputs = _hunyuanvideo15_inputs(model.config, call, dtype)
        return trace_step(
            mode,
            model,
            lambda: fake_tensor_forward(model, **inputs, sequence_parallel=call.sequence_parallel),
            train=call.train,
        )

    return over_depth(at, depth)


# Wan's text side: UMT5 prompt embeddings padded to the pipeline's max_sequence_length (512), which every block
# attends to by cross-attention; they do not join the video tokens' self-attention.
WAN_TEXT_TOKENS = 512


def trace_wan(
    expert_configs: dict[str, dict], call: TransformerCall, *, expert: str, lora_config=None, dtype=None
) -> StepTrace:
    """One call of Wan's transformer built from ``expert_configs`` (an expert's name -> its transformer config) in
    ``dtype`` (bf16 by default), as the run makes it: with two experts (``high`` and ``low``, Wan 2.2 A14B) both are
    built, as one ``core.models.wan_experts.WanExperts``, and ``expert`` runs (its gradient checkpointing and LoRA
    adapter as configured; the other stays frozen); with one (``transformer``), that one. ``call.latent_grid`` is the
    latent grid (frames, height, width) before patching; ``call.text_tokens`` one entry, the prompt's tokens. Traced
    at two and three blocks and extrapolated to the expert's depth."""
    from diffusers import WanTransformer3DModel

    dtype = torch.bfloat16 if dtype is None else dtype
    depth = {**init_defaults(WanTransformer3DModel), **expert_configs[expert]}["num_layers"]

    def at(blocks: int) -> StepTrace:
        mode = fake_mode()
        with mode, default_dtype(dtype):
            experts = {
                name: WanTransformer3DModel.from_config({**config, "num_layers": blocks}).requires_grad_(False)
                for name, config in expert_configs.items()
            }
            running = experts[expert]
            if call.train:
                _make_trainable(running, lora_config)
            if call.checkpointing:
                running.enable_gradient_checkpointing()
            inputs = _wan_inputs(running.config, call, dtype)
        if len(experts) == 1:
            model, forward = running, lambda: running(**inputs, return_dict=False)[0]
        else:
            from sage_grpo.core.models.wan_experts import WanExperts

            model = WanExperts(experts["high"], experts["low"])
            forward = lambda: model(expert=expert, **inputs, return_dict=False)[0]  # noqa: E731
        with _wan_sequence_share(running, call.sequence_parallel, inputs["hidden_states"]):
            return trace_step(mode, model, forward, train=call.train)

    return over_depth(at, depth)


def _make_trainable(transformer, lora_config) -> None:
    """Train ``transformer`` as the run does: its LoRA adapter (``lora_config`` enabled), or all of it."""
    from sage_grpo.core.lora import add_lora

    if lora_config is not None and lora_config.enabled:
        with _adapters_made_in_place():
            add_lora(transformer, lora_config)
    else:
        transformer.requires_grad_(True)


def _wan_inputs(config, call: TransformerCall, dtype) -> dict:
    """Fake inputs of one call, shaped as ``WanAdapter.predict_velocity`` makes them (text-to-video)."""
    (text,) = call.text_tokens
    return {
        "hidden_states": torch.empty(call.batch, config.in_channels, *call.latent_grid, dtype=dtype),
        "timestep": torch.empty(call.batch, dtype=torch.float32),  # the pipeline's timesteps stay float32
        "encoder_hidden_states": torch.empty(call.batch, text, config.text_dim, dtype=dtype),
    }


@contextlib.contextmanager
def _wan_sequence_share(transformer, k: int, hidden_states):
    """What one rank of a Ulysses group of K holds, as diffusers' Wan ``_cp_plan`` splits it: the rotary tables and
    the first block's input narrowed to 1/K of the tokens (once: a checkpointed block's recomputation gets its saved,
    already split input), the output projection's tokens gathered whole. (Ulysses attends over all tokens of 1/K of
    the heads: the same bytes as all heads of 1/K of the tokens.)"""
    if k == 1:
        yield
        return
    p_t, p_h, p_w = transformer.config.patch_size
    _, _, frames, height, width = hidden_states.shape
    tokens = (frames // p_t) * (height // p_h) * (width // p_w)
    share = lambda t: t.narrow(1, 0, t.shape[1] // k) if t.shape[1] == tokens else t  # noqa: E731
    handles = [
        transformer.rope.register_forward_hook(lambda module, args, out: tuple(share(t) for t in out)),
        transformer.blocks[0].register_forward_pre_hook(lambda module, args: (share(args[0]), *args[1:])),
        transformer.proj_out.register_forward_hook(lambda module, args, out: torch.cat([out] * k, dim=1)),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _adapters_made_in_place():
    """peft moves each new adapter to its base layer's device and dtype with ``Module.to``, which cannot swap fake
    parameters (``_apply`` swaps tensors of a wrapper subclass); built inside ``default_dtype`` under the fake mode,
    they are already where they belong, so ``to`` leaves the module as it is meanwhile."""
    from unittest import mock

    with mock.patch.object(torch.nn.Module, "to", lambda module, *args, **kwargs: module):
        yield


def init_defaults(cls) -> dict:
    """The keyword defaults of a diffusers model's ``__init__``: its config where a config file says nothing."""
    import inspect

    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def _hunyuanvideo15_inputs(config, call: TransformerCall, dtype) -> dict:
    """Fake inputs of one call, shaped as ``HunyuanVideo15Adapter.predict_velocity`` makes them."""
    batch, (frames, height, width) = call.batch, call.latent_grid
    qwen, byt5, image = call.text_tokens
    return {
        "hidden_states": torch.empty(batch, config.in_channels, frames, height, width, dtype=dtype),
        "timestep": torch.empty(batch, dtype=dtype),
        "text": {
            "encoder_hidden_states": torch.empty(batch, qwen, config.text_embed_dim, dtype=dtype),
            "encoder_attention_mask": torch.ones(batch, qwen, dtype=torch.long),
            "encoder_hidden_states_2": torch.empty(batch, byt5, config.text_embed_2_dim, dtype=dtype),
            "encoder_attention_mask_2": torch.ones(batch, byt5, dtype=torch.long),
        },
        "image_embeds": torch.zeros(batch, image, config.image_embed_dim, dtype=dtype),
    }


@dataclass(frozen=True)
class DecodeCall:
    """One ``decode`` of a model adapter as the rollout makes it after each micro-batch: the float32 final latents of
    ``batch`` samples, [channels, frames, height, width] each (``latent_grid``: frames, height, width), decoded by the
    adapter's VAE with diffusers' tiling on or off (``tiling``) as the adapter sets it up."""

    batch: int
    latent_grid: tuple[int, int, int]
    tiling: bool = False


def trace_hunyuanvideo15_decode(vae_config: dict, call: DecodeCall, *, dtype=None) -> StepTrace:
    """``HunyuanVideo15Adapter.decode`` with ``AutoencoderKLHunyuanVideo15`` built from ``vae_config`` in ``dtype``
    (bf16 by default, the pipeline's): one sample per VAE call; tiled, diffusers' tiles are 256 x 256 pixels of every
    frame, decoded one after another and all kept until they are blended into the video."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Pipeline

    from sage_grpo.core.models.hunyuan15 import HunyuanVideo15Adapter

    dtype = torch.bfloat16 if dtype is None else dtype
    vae = (AutoencoderKLHunyuanVideo15, vae_config, "latent_channels")
    with _causal_masks_built_by_frame():
        return _trace_decode(HunyuanVideo15Adapter, HunyuanVideo15Pipeline, vae, call, dtype)


def trace_wan_decode(vae_config: dict, call: DecodeCall, *, dtype=None) -> StepTrace:
    """``WanAdapter.decode`` with ``AutoencoderKLWan`` built from ``vae_config`` in ``dtype`` (float32 by default, as
    the adapter loads it): the micro-batch in one VAE call, one latent frame after another (its causal cache)."""
    from diffusers import AutoencoderKLWan, WanPipeline

    from sage_grpo.core.models.wan import WanAdapter

    dtype = torch.float32 if dtype is None else dtype
    return _trace_decode(WanAdapter, WanPipeline, (AutoencoderKLWan, vae_config, "z_dim"), call, dtype)


def _trace_decode(adapter_class, pipeline_class, vae: tuple[type, dict, str], call: DecodeCall, dtype) -> StepTrace:
    """``adapter_class.decode`` on ``call``'s latents (``vae``: the VAE's class, its config and the config's key for
    the latent channels)."""
    vae_class, vae_config, channels = vae
    mode = fake_mode()
    with mode, default_dtype(dtype):
        model = vae_class.from_config(vae_config).eval()
        if call.tiling:
            model.enable_tiling()
        latents = torch.empty(call.batch, model.config[channels], *call.latent_grid, dtype=torch.float32)
    decode = adapter_decode(adapter_class, pipeline_class, model)
    return trace_step(mode, model, lambda: decode(latents), train=False)


def adapter_decode(adapter_class, pipeline_class, vae) -> Callable[[torch.Tensor], torch.Tensor]:
    """``adapter_class.decode`` (latents to uint8 videos) with a pipeline of ``pipeline_class`` that holds only
    ``vae``: the method reads nothing of its adapter but the pipeline's VAE and video processor."""
    import inspect
    from types import SimpleNamespace

    components = [name for name in inspect.signature(pipeline_class.__init__).parameters if name != "self"]
    adapter = SimpleNamespace(pipeline=pipeline_class(**dict.fromkeys(components) | {"vae": vae}))
    return lambda latents: adapter_class.decode(adapter, latents)


@contextlib.contextmanager
def _causal_masks_built_by_frame():
    """diffusers' HunyuanVideo 1.5 VAE builds its attention's frame-causal mask one token row at a time (5,376 rows
    for one 16 x 16 latent tile of 21 frames), each row an op that takes ~1 ms on fake tensors; the rows of a frame
    are alike, so this builds the same mask one frame at a time, allocating the same [S, S] tensor."""
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock

    by_row = HunyuanVideo15AttnBlock.__dict__["prepare_causal_attention_mask"]
    HunyuanVideo15AttnBlock.prepare_causal_attention_mask = staticmethod(causal_mask_by_frame)
    try:
        yield
    finally:
        HunyuanVideo15AttnBlock.prepare_causal_attention_mask = by_row


def causal_mask_by_frame(n_frame: int, n_hw: int, dtype, device, batch_size: int | None = None):
    """``HunyuanVideo15AttnBlock.prepare_causal_attention_mask``'s mask, built a frame at a time: every token attends
    to the tokens of its own frame and the frames before it."""
    seq_len = n_frame * n_hw
    mask = torch.full((seq_len, seq_len), float("-inf"), dtype=dtype, device=device)
    for frame in range(n_frame):
        mask[frame * n_hw : (frame + 1) * n_hw, : (frame + 1) * n_hw] = 0
    return mask if batch_size is None else mask.unsqueeze(0).expand(batch_size, -1, -1)


@dataclass(frozen=True)
class ScoringCall:
    """One VideoAlign call as the scorer makes it: ``batch`` videos, each ``frames`` sampled frames resized to
    ``height`` x ``width`` pixels (multiples of 28), behind ``text_tokens`` tokens of chat template and prompt."""

    batch: int
    frames: int
    height: int
    width: int
    text_tokens: int


def videoalign_call(batch: int, video: tuple[int, int, int], fps: float, reward_kwargs: dict) -> ScoringCall:
    """The ``ScoringCall`` of ``batch`` videos of ``video`` (frames, height, width) at ``fps``, sampled and resized by
    VideoAlign's rules with the reward's kwargs (``sample_fps``, ``max_pixels``). The text is the chat template's,
    counted by the word-level tokenizer of ``videoalign.tiny_tokenizer`` (Qwen2's BPE splits a few words further)."""
    from sage_grpo.core.rewards import videoalign

    frames, height, width = video
    sampled = videoalign.sampled_frame_count(frames, fps, reward_kwargs.get("sample_fps", videoalign.SAMPLE_FPS))
    side = videoalign.PATCH_SIZE * videoalign.MERGE_SIZE
    max_pixels = reward_kwargs.get("max_pixels", videoalign.MAX_PIXELS)
    resized = videoalign.smart_resize(height, width, side, videoalign.MIN_PIXELS, max_pixels)
    text = len(videoalign.tiny_tokenizer()(videoalign.chat_text(""))["input_ids"])
    return ScoringCall(batch, sampled, *resized, text_tokens=text)


def trace_videoalign(vlm_config: dict, call: ScoringCall, *, dtype=None) -> StepTrace:
    """One no-grad forward of ``videoalign.VideoRewardModel`` (Qwen2-VL built from ``vlm_config`` and the reward
    head) in ``dtype`` (bf16 by default, as released) on inputs shaped as ``VideoAlign.prepare_inputs`` makes them
    (float32 patches), through ``videoalign_forward``."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from sage_grpo.core.rewards.videoalign import MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE, VideoRewardModel

    dtype = torch.bfloat16 if dtype is None else dtype
    grid = (call.frames // TEMPORAL_PATCH_SIZE, call.height // PATCH_SIZE, call.width // PATCH_SIZE)
    patches = grid[0] * grid[1] * grid[2]
    tokens = call.text_tokens + patches // MERGE_SIZE**2
    mode = fake_mode()
    with mode, default_dtype(dtype):
        vlm = Qwen2VLForConditionalGeneration(Qwen2VLConfig(**vlm_config, attn_implementation="sdpa"))
        model = VideoRewardModel(vlm, reward_token_ids=[]).eval()
        input_ids = torch.zeros(call.batch, tokens, dtype=torch.long)
        attention_mask = torch.ones(call.batch, tokens, dtype=torch.long)
        pixels = torch.empty(call.batch * patches, 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE**2, dtype=torch.float32)
    vision = videoalign_vision_inputs(grid, call.batch, MERGE_SIZE)
    step = lambda: videoalign_forward(model, input_ids, attention_mask, pixels, vision)  # noqa: E731
    return trace_step(mode, model, step, train=False)


def videoalign_vision_inputs(grid: tuple[int, int, int], batch: int, merge_size: int) -> dict:
    """What Qwen2-VL's vision tower computes from the patch grids' values, computed here from ``batch`` videos of
    ``grid`` (t, h, w) patches, as transformers' ``vision_utils`` lets a caller precompute them: the rotary
    positions, and the frame boundaries its attention splits at (a NumPy array, whose ``tolist`` needs no values
    on fake tensors)."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

    grids = torch.tensor([grid] * batch)
    return {
        "cu_seqlens": get_vision_cu_seqlens(grids).numpy(),
        "position_ids": get_vision_position_ids(grids, merge_size),
    }


def videoalign_forward(model, input_ids, attention_mask, pixel_values_videos, vision: dict) -> torch.Tensor:
    """``VideoRewardModel.forward`` written so that it runs on fake tensors, up to the head's value at every token
    [B, L] (the forward reads three of them): the same modules in the same order on tensors of the same shapes.

    Written by hand because Qwen2-VL's forward reads values: the vision tower's positions and attention splits from
    the grids (``vision``: ``videoalign_vision_inputs``), and a count of the video placeholders, checked against the
    features, before they are scattered in. The scatter here is the model's; the reward tokens are found by value
    (a boolean index) after the head, which adds [B, 3]. ``tests/unit/test_scoring_trace.py`` compares the two on
    real tensors."""
    inner = model.vlm.model
    video = inner.visual(pixel_values_videos, grid_thw=None, **vision).pooler_output
    embeds = inner.get_input_embeddings()(input_ids)
    placeholders = (input_ids == inner.config.video_token_id).unsqueeze(-1).expand_as(embeds)
    embeds = embeds.masked_scatter(placeholders, video.to(embeds.dtype))
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
    hidden = inner.language_model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions)
    return model.rm_head(hidden.last_hidden_state).squeeze(-1).float()
