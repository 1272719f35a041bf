"""Wan 2.1 / Wan 2.2 (TI2V-5B) text-to-video behind the adapter interface, built on diffusers' ``WanPipeline``.

Two-expert Wan 2.2 checkpoints (A14B: ``transformer_2`` with a noise boundary) are refused: training them would mean
two policies, one per noise range, which the rest of the pipeline does not model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sage_grpo.core.lazy import lazy_module, no_grad

from .base import DiffusersAdapter, PromptEmbeddings, frames_to_uint8

if TYPE_CHECKING:
    from diffusers import WanPipeline

torch = lazy_module("torch", globals())


class WanAdapter(DiffusersAdapter):
    """Text-to-video with Wan. CFG as in ``WanPipeline``: ``uncond + scale * (cond - uncond)`` when scale > 1."""

    def __init__(
        self,
        pipeline: WanPipeline,
        *,
        guidance_scale: float = 5.0,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        negative_prompt: str = "",
        max_sequence_length: int = 512,
        fps: int = 16,
        identity: str | None = None,
    ):
        from diffusers import FlowMatchEulerDiscreteScheduler

        if pipeline.transformer_2 is not None:
            raise ValueError("two-expert Wan 2.2 (transformer_2) is not supported; use Wan 2.1 or Wan 2.2 TI2V-5B")
        source = identity or pipeline.config.get("_name_or_path")
        if not source:
            raise ValueError("a pipeline built in code needs identity=...: it names the text encoder in cache keys")
        self.pipeline = pipeline
        self.transformer = pipeline.transformer
        self.guidance_scale = float(guidance_scale)
        # Wan ships a UniPC scheduler; only a flow-matching Euler config carries over to our sigma schedule.
        if isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler):
            self.scheduler_config = dict(pipeline.scheduler.config)
        self.height, self.width, self.num_frames = height, width, num_frames
        self.negative_prompt = negative_prompt
        self.max_sequence_length = max_sequence_length
        self._fps = fps  # Wan 2.1 renders 16 frames per second, Wan 2.2 TI2V-5B 24
        self._identity = f"wan:{source}:{pipeline.text_encoder.dtype}:{max_sequence_length}"

    @classmethod
    def from_pretrained(
        cls,
        path_or_hub_id: str,
        *,
        dtype: torch.dtype | None = None,  # None: bfloat16
        device: str | torch.device = "cuda",
        guidance_scale: float = 5.0,
        **kwargs,
    ) -> WanAdapter:
        """Load a diffusers-format checkpoint, e.g. ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``."""
        from diffusers import AutoencoderKLWan, WanPipeline

        dtype = torch.bfloat16 if dtype is None else dtype
        # Wan's VAE is meant to run in float32 (its model card's recommendation); everything else in ``dtype``.
        vae = AutoencoderKLWan.from_pretrained(path_or_hub_id, subfolder="vae", torch_dtype=torch.float32)
        pipeline = WanPipeline.from_pretrained(path_or_hub_id, vae=vae, torch_dtype=dtype).to(device)
        return cls(pipeline, guidance_scale=guidance_scale, **kwargs)

    @property
    def fps(self) -> int:
        return self._fps

    def latent_channels(self) -> int:
        return self.pipeline.transformer.config.in_channels

    def patch_size(self) -> tuple[int, int, int]:
        return tuple(self.pipeline.transformer.config.patch_size)

    @no_grad
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeddings:
        positive, _ = self._encode(prompts)
        negative = None
        if self.cfg_enabled:
            # Every prompt shares the negative prompt: encode it once.
            single, _ = self._encode([self.negative_prompt])
            negative = single.expand(len(prompts), *single.shape[1:]).clone()
        return PromptEmbeddings({"prompt_embeds": positive}, None if negative is None else {"prompt_embeds": negative})

    def _encode(self, prompts: list[str]):
        return self.pipeline.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
            dtype=self.dtype,
        )

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
        hidden_states = latents.to(device, dtype).repeat(branches, 1, 1, 1, 1)
        prediction = model(
            hidden_states=hidden_states,
            timestep=self._timestep(sigma, hidden_states),
            encoder_hidden_states=torch.cat([c["prompt_embeds"] for c in conditions]),
            return_dict=False,
        )[0].float()
        if branches == 1:
            return prediction
        cond, uncond = prediction.split(batch)
        return uncond + self.guidance_scale * (cond - uncond)

    def _timestep(self, sigma: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """sigma * 1000 per sample, repeated for every CFG branch; per token for Wan 2.2 TI2V (expand_timesteps)."""
        # The pipeline keeps timesteps in float32 (the scheduler's dtype) whatever the transformer's dtype.
        branches = hidden_states.shape[0] // sigma.shape[0]
        t = (sigma.to(hidden_states.device, torch.float32) * self.num_train_timesteps).repeat(branches)
        if not self.pipeline.config.expand_timesteps:
            return t
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.pipeline.transformer.config.patch_size
        tokens = (frames // p_t) * (height // p_h) * (width // p_w)
        return t[:, None].expand(-1, tokens)

    @no_grad
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = latents.to(vae.device, vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=latents.device, dtype=latents.dtype).view(shape)
        std = torch.tensor(vae.config.latents_std, device=latents.device, dtype=latents.dtype).view(shape)
        video = vae.decode(latents * std + mean, return_dict=False)[0]
        return frames_to_uint8(self.pipeline.video_processor.postprocess_video(video, output_type="pt"))
