"""HunyuanVideo 1.5 text-to-video behind the adapter interface, built on diffusers' ``HunyuanVideo15Pipeline``.

Everything model-specific is borrowed from the pipeline object rather than re-implemented: prompt templates and both
text encoders (``pipeline.encode_prompt``), the t2v conditioning layout, the guider's CFG settings, the VAE and its
post-processing. The one deliberate difference: the conditional and unconditional CFG branches run as one batched
transformer call (the pipeline makes two), which is faster and does not change the maths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sage_grpo.core.lazy import lazy_module, no_grad

from .base import DiffusersAdapter, PromptEmbeddings, frames_to_uint8

if TYPE_CHECKING:
    from diffusers import HunyuanVideo15Pipeline

    from sage_grpo.core.distributed import ParallelLayout

torch = lazy_module("torch", globals())
F = lazy_module("torch.nn.functional", globals())

# Keyword names of HunyuanVideo15Transformer3DModel.forward, which are also the keys of our PromptEmbeddings.
_TEXT_INPUTS = (
    "encoder_hidden_states",
    "encoder_attention_mask",
    "encoder_hidden_states_2",
    "encoder_attention_mask_2",
)


class KeyPaddingAttnProcessor:
    """HunyuanVideo15AttnProcessor2_0 (diffusers 0.42) with a key-padding mask [B, 1, 1, S] instead of its query x key
    mask [B, 1, S, S]. Used at every K: the [S, S] mask and the float bias SDPA makes of it are 2.3 + 4.7 GiB at 480p
    and 24 + 48 GiB at 720p, and Ulysses attention cannot gather it (it all-gathers masks of the local key length
    only). The outputs of real tokens are the same: a padded text token is masked as a key in every block, so its own
    (query) row is never read by a real token, and the output projection keeps only the video tokens."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        query, key, value = (_heads(attn, proj(hidden_states)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        query, key = attn.norm_q(query), attn.norm_k(key)
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        text = [
            _heads(attn, proj(encoder_hidden_states)) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        ]
        text[0], text[1] = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
        query, key, value = (torch.cat(pair, dim=1) for pair in zip((query, key, value), text))
        batch, length = query.shape[:2]
        keys_kept = F.pad(attention_mask.bool(), (length - attention_mask.shape[1], 0), value=True)
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=keys_kept.view(batch, 1, 1, length),
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(query.dtype)
        video, text_out = out[:, : hidden_states.shape[1]], out[:, hidden_states.shape[1] :]
        return attn.to_out[1](attn.to_out[0](video)), attn.to_add_out(text_out)


def use_key_padding_attention(transformer) -> None:
    """Every dual-stream block of a ``HunyuanVideo15Transformer3DModel`` attends with ``KeyPaddingAttnProcessor``
    (the text refiner's attention, over the text tokens alone, keeps diffusers' own)."""
    for block in transformer.transformer_blocks:
        block.attn.set_processor(KeyPaddingAttnProcessor())


def _heads(attn, projected: torch.Tensor) -> torch.Tensor:
    return projected.unflatten(2, (attn.heads, -1))


class HunyuanVideo15Adapter(DiffusersAdapter):
    """Text-to-video with HunyuanVideo 1.5.

    ``guidance_scale=None`` keeps the scale configured in the pipeline's guider. Scales <= 1 skip the unconditional
    branch entirely. The pipeline's guider is replaced by one with the adapter's scale, so that calling the pipeline
    itself (benchmarks, the correctness tests) samples the same distribution as our rollout.

    ``offload_text_encoder``: the two text encoders (Qwen2.5-VL-7B's text model and ByT5, ~13 GiB in bf16) live in
    host memory and visit the GPU only to encode prompts the embedding cache has not seen (``stages.ingest``), so
    the GPU holds them during no training phase (``sagegrpo plan`` shows the difference).
    """

    sequence_parallel_size = 1  # K, set by enable_sequence_parallel

    def __init__(
        self,
        pipeline: HunyuanVideo15Pipeline,
        *,
        guidance_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        num_frames: int = 81,
        negative_prompt: str = "",
        identity: str | None = None,
        offload_text_encoder: bool = False,
    ):
        from diffusers import FlowMatchEulerDiscreteScheduler

        guider = pipeline.guider
        if guider.config.start != 0.0 or guider.config.stop != 1.0:
            raise ValueError("CFG limited to a range of steps (guider start/stop) is not supported")
        if not isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler):
            raise ValueError(f"expected a FlowMatchEulerDiscreteScheduler, got {type(pipeline.scheduler).__name__}")
        source = identity or pipeline.config.get("_name_or_path")
        if not source:
            raise ValueError("a pipeline built in code needs identity=...: it names the text encoders in cache keys")
        if guidance_scale is not None:
            pipeline.guider = guider = guider.new(guidance_scale=guidance_scale)

        use_key_padding_attention(pipeline.transformer)
        self.pipeline = pipeline
        self.transformer = pipeline.transformer
        self.guidance_scale = float(guider.guidance_scale)
        self.scheduler_config = dict(pipeline.scheduler.config)
        self.negative_prompt = negative_prompt
        self.num_frames = num_frames
        if height is None or width is None:
            # The pipeline's own default: a 16:9 bucket of the transformer's target size.
            height, width = pipeline.video_processor.calculate_default_height_width(
                pipeline.default_aspect_ratio[1], pipeline.default_aspect_ratio[0], pipeline.target_size
            )
        self.height, self.width = height, width
        self._identity = f"hunyuan15:{source}:{pipeline.text_encoder.dtype}"
        self.offload_text_encoder = offload_text_encoder
        if offload_text_encoder:
            self._move_text_encoders("cpu")

    @classmethod
    def from_pretrained(
        cls,
        path_or_hub_id: str,
        *,
        dtype: torch.dtype | None = None,  # None: bfloat16
        device: str | torch.device = "cuda",
        guidance_scale: float | None = None,
        vae_tiling: bool = True,
        **kwargs,
    ) -> HunyuanVideo15Adapter:
        """Load a diffusers-format checkpoint, e.g. ``hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v``."""
        from diffusers import HunyuanVideo15Pipeline

        dtype = torch.bfloat16 if dtype is None else dtype
        pipeline = HunyuanVideo15Pipeline.from_pretrained(path_or_hub_id, torch_dtype=dtype).to(device)
        if vae_tiling:
            # Decoding 81 frames at 480p in one piece needs tens of GB of activations.
            pipeline.vae.enable_tiling()
        return cls(pipeline, guidance_scale=guidance_scale, **kwargs)

    def latent_channels(self) -> int:
        return self.pipeline.num_channels_latents

    def patch_size(self) -> tuple[int, int, int]:
        config = self.pipeline.transformer.config
        return config.patch_size_t, config.patch_size, config.patch_size

    def context_parallel_plan(self) -> dict:
        """Where diffusers' context parallelism splits HunyuanVideo 1.5's tokens (diffusers 0.42 ships no ``_cp_plan``
        for it): the dual-stream blocks attend over [video tokens, text tokens] jointly, so both streams are split K
        ways at the first block (with the text's padding mask), RoPE's per-video-token tables alike; the output
        projection gathers the video."""
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        return {
            "rope": {
                0: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
                1: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
            },
            "transformer_blocks.0": {
                "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
                "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
                "attention_mask": ContextParallelInput(split_dim=1, expected_dims=2),
            },
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }

    def enable_sequence_parallel(self, parallel: ParallelLayout) -> None:
        super().enable_sequence_parallel(parallel)
        self.sequence_parallel_size = parallel.sequence_parallel_size

    @no_grad
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeddings:
        positive = self._encode(prompts)
        negative = None
        if self.cfg_enabled:
            # Every prompt shares the negative prompt: encode it once.
            single = self._encode([self.negative_prompt])
            negative = {k: v.expand(len(prompts), *v.shape[1:]).clone() for k, v in single.items()}
        return PromptEmbeddings(positive, negative)

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        device = self.device
        if self.offload_text_encoder:
            self._move_text_encoders(device)
        try:
            tensors = self.pipeline.encode_prompt(
                prompt=prompts, device=device, dtype=self.dtype, batch_size=len(prompts)
            )
        finally:
            if self.offload_text_encoder:
                self._move_text_encoders("cpu")
        return dict(zip(_TEXT_INPUTS, tensors))

    def _move_text_encoders(self, device) -> None:
        self.pipeline.text_encoder.to(device)
        self.pipeline.text_encoder_2.to(device)

    def predict_velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        embeddings: PromptEmbeddings,
        *,
        module: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        model = self.transformer if module is None else module
        device, dtype = self.device, self.dtype
        batch = latents.shape[0]
        conditions = self.cfg_conditions(embeddings)
        branches = len(conditions)

        hidden_states = self._t2v_model_input(latents.to(device, dtype)).repeat(branches, 1, 1, 1, 1)
        # Exactly the pipeline's timestep: float32 sigma times num_train_timesteps, then cast to the model dtype.
        timestep = (sigma.to(device, torch.float32) * self.num_train_timesteps).to(dtype).repeat(branches)
        text_inputs = self._split_evenly({k: torch.cat([c[k] for c in conditions]) for k in _TEXT_INPUTS})
        prediction = model(
            hidden_states=hidden_states,
            timestep=timestep,
            image_embeds=self._zero_image_embeds(hidden_states),
            return_dict=False,
            **text_inputs,
        )[0]
        return self._guide(*prediction.float().split(batch))

    def _split_evenly(self, text: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Under sequence parallelism the text tokens (image, ByT5 and Qwen tokens together) are split K ways too:
        pad the Qwen tokens with masked zeros to a multiple of K. Masked tokens are inert: keys no token attends to."""
        size = self.sequence_parallel_size
        tokens = (
            self.pipeline.vision_num_semantic_tokens
            + text["encoder_hidden_states"].shape[1]
            + text["encoder_hidden_states_2"].shape[1]
        )
        missing = -tokens % size
        if not missing:
            return text
        padded = dict(text)
        padded["encoder_hidden_states"] = F.pad(text["encoder_hidden_states"], (0, 0, 0, missing))
        padded["encoder_attention_mask"] = F.pad(text["encoder_attention_mask"], (0, missing))
        return padded

    def _t2v_model_input(self, latents: torch.Tensor) -> torch.Tensor:
        """[latents, zero condition latents, zero mask] on channels: how the pipeline tells the model 'no image'."""
        cond_latents, mask = self.pipeline.prepare_cond_latents_and_mask(latents, latents.dtype, latents.device)
        return torch.cat([latents, cond_latents, mask], dim=1)

    def _zero_image_embeds(self, like: torch.Tensor) -> torch.Tensor:
        """All-zero image embeddings, which the transformer reads as text-to-video (it masks those tokens out)."""
        p = self.pipeline
        shape = (like.shape[0], p.vision_num_semantic_tokens, p.vision_states_dim)
        return torch.zeros(shape, dtype=like.dtype, device=like.device)

    def _guide(self, cond: torch.Tensor, uncond: torch.Tensor | None = None) -> torch.Tensor:
        """ClassifierFreeGuidance.forward, in float32 (bf16 cannot resolve GRPO's 1e-4 policy ratios)."""
        from diffusers.guiders.guider_utils import rescale_noise_cfg

        guider = self.pipeline.guider
        if uncond is None:
            guided = cond
        else:
            base = cond if guider.use_original_formulation else uncond
            guided = base + self.guidance_scale * (cond - uncond)
        if guider.guidance_rescale > 0.0:
            guided = rescale_noise_cfg(guided, cond, guider.guidance_rescale)
        return guided

    @no_grad
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor
        # One sample per VAE call: the VAE's causal attention mask breaks on batches > 1 (diffusers PR #13133).
        video = torch.cat([vae.decode(sample[None], return_dict=False)[0] for sample in latents])
        return frames_to_uint8(self.pipeline.video_processor.postprocess_video(video, output_type="pt"))


def fake_tensor_forward(
    model, hidden_states, timestep, text: dict[str, torch.Tensor], image_embeds, sequence_parallel: int = 1
) -> torch.Tensor:
    """``HunyuanVideo15Transformer3DModel.forward`` (diffusers 0.42, text-to-video) written so that it runs on fake
    tensors, for ``core.memory_trace``: the same modules, in the same order, on tensors of the same shapes.

    Written by hand because the model's forward cannot run without values: it tests ``image_embeds == 0`` in an
    ``if`` and moves the valid text tokens first by boolean indexing, whose output length depends on the masks.
    Here the text streams are concatenated in place and the masked tokens zeroed where they stand; attention is
    blind to the order of its keys and the masked tokens are masked as keys, so the video output is the model's
    (``tests/unit/test_memory_trace.py`` compares them on real tensors).

    ``sequence_parallel`` K: what one rank of a Ulysses group holds, as ``context_parallel_plan`` splits it: the
    blocks run on 1/K of the video and of the (padded) text tokens, and the output is gathered whole. (Ulysses
    attends over all tokens of 1/K of the heads: the same bytes as all heads of 1/K of the tokens.)"""
    config = model.config
    batch, _, frames, height, width = hidden_states.shape
    p_t, p = config.patch_size_t, config.patch_size
    rotary = model.rope(hidden_states)
    temb = model.time_embed(timestep, timestep_r=None)
    hidden_states = model.x_embedder(hidden_states)
    mask, mask_2 = text["encoder_attention_mask"].bool(), text["encoder_attention_mask_2"].bool()
    qwen = model.context_embedder(text["encoder_hidden_states"], timestep, text["encoder_attention_mask"])
    qwen = qwen + model.cond_type_embed(torch.zeros_like(qwen[:, :, 0], dtype=torch.long))
    byt5 = model.context_embedder_2(text["encoder_hidden_states_2"])
    byt5 = byt5 + model.cond_type_embed(torch.ones_like(byt5[:, :, 0], dtype=torch.long))
    image = model.image_embedder(image_embeds) * 0.0  # text-to-video: the image tokens are zeroed and masked
    image = image + model.cond_type_embed(2 * torch.ones_like(image[:, :, 0], dtype=torch.long))
    image_mask = torch.zeros(image.shape[:2], dtype=torch.bool, device=image.device)
    encoder_hidden_states = torch.cat([image, byt5 * mask_2[..., None], qwen * mask[..., None]], dim=1)
    encoder_attention_mask = torch.cat([image_mask, mask_2, mask], dim=1)
    if sequence_parallel > 1:
        k, missing = sequence_parallel, -encoder_hidden_states.shape[1] % sequence_parallel
        encoder_hidden_states = F.pad(encoder_hidden_states, (0, 0, 0, missing))
        encoder_attention_mask = F.pad(encoder_attention_mask, (0, missing))
        share = lambda t, dim: t.narrow(dim, 0, t.shape[dim] // k)  # noqa: E731
        hidden_states, encoder_hidden_states = share(hidden_states, 1), share(encoder_hidden_states, 1)
        encoder_attention_mask, rotary = share(encoder_attention_mask, 1), tuple(share(r, 0) for r in rotary)
    for block in model.transformer_blocks:
        args = (hidden_states, encoder_hidden_states, temb, encoder_attention_mask, rotary)
        if torch.is_grad_enabled() and model.gradient_checkpointing:
            hidden_states, encoder_hidden_states = model._gradient_checkpointing_func(block, *args)
        else:
            hidden_states, encoder_hidden_states = block(*args)
    hidden_states = model.proj_out(model.norm_out(hidden_states, temb))
    if sequence_parallel > 1:
        hidden_states = torch.cat([hidden_states] * sequence_parallel, dim=1)  # the gather
    hidden_states = hidden_states.reshape(batch, frames // p_t, height // p, width // p, -1, p_t, p, p)
    return hidden_states.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)
