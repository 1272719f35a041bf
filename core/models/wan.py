"""Wan 2.1 / Wan 2.2 text-to-video behind the adapter interface, built on diffusers' ``WanPipeline``.

Wan 2.2 A14B denoises with two transformers ("experts"): ``transformer`` (``high``) on the timesteps at or above
``boundary_ratio * num_train_timesteps``, ``transformer_2`` (``low``) below, each with its own CFG scale
(``guidance_scale``, ``guidance_scale_2``). The adapter picks the expert of every step by the pipeline's own rule
(``WanPipeline.__call__``, diffusers 0.42), and trains them as one module (``core.models.wan_experts.WanExperts``),
so one DeepSpeed engine partitions both under ZeRO-3 and one optimizer step per update applies both. Wan 2.1 and
Wan 2.2 TI2V-5B have one transformer and train it alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from sage_grpo.core.lazy import lazy_module, no_grad

from .base import DiffusersAdapter, PromptEmbeddings, frames_to_uint8

if TYPE_CHECKING:
    from diffusers import WanPipeline

# The experts by the names the config uses, in the order the adapter numbers them (``expert_index``); the pipeline's
# component of each.
Expert = Literal["high", "low"]
EXPERTS: tuple[Expert, ...] = ("high", "low")
PIPELINE_COMPONENTS: dict[Expert, str] = {"high": "transformer", "low": "transformer_2"}

torch = lazy_module("torch", globals())


class WanAdapter(DiffusersAdapter):
    """Text-to-video with Wan. CFG as in ``WanPipeline``: ``uncond + scale * (cond - uncond)``, on for both experts
    when ``guidance_scale`` > 1 (the pipeline decides by the high-noise scale alone); ``guidance_scale_2`` is the
    low-noise expert's scale (None: ``guidance_scale``, as in the pipeline). ``train_experts`` names the experts the
    update trains (None: all of them); the others stay frozen and their steps are not trained."""

    def __init__(
        self,
        pipeline: WanPipeline,
        *,
        guidance_scale: float = 5.0,
        guidance_scale_2: float | None = None,
        train_experts: Sequence[Expert] | None = None,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        negative_prompt: str = "",
        max_sequence_length: int = 512,
        fps: int = 16,
        identity: str | None = None,
    ):
        from diffusers import FlowMatchEulerDiscreteScheduler

        source = identity or pipeline.config.get("_name_or_path")
        if not source:
            raise ValueError("a pipeline built in code needs identity=...: it names the text encoder in cache keys")
        self.pipeline = pipeline
        self.boundary_ratio = pipeline.config.get("boundary_ratio")
        two_experts = _check_experts(pipeline, guidance_scale, guidance_scale_2, train_experts)
        self.expert_names = EXPERTS if two_experts else ("transformer",)
        self.trained_experts = tuple(train_experts or self.expert_names)
        if two_experts:
            from .wan_experts import WanExperts

            self.transformer = WanExperts(pipeline.transformer, pipeline.transformer_2)
        else:
            self.transformer = pipeline.transformer
        self.guidance_scale = float(guidance_scale)
        self.guidance_scale_2 = float(guidance_scale if guidance_scale_2 is None else guidance_scale_2)
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
        """Load a diffusers-format checkpoint, e.g. ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` or
        ``Wan-AI/Wan2.2-T2V-A14B-Diffusers`` (two experts)."""
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

    def denoisers(self) -> list[torch.nn.Module]:
        return [self.pipeline.transformer] + ([self.pipeline.transformer_2] if len(self.expert_names) > 1 else [])

    def trainable_modules(self) -> list[torch.nn.Module]:
        if len(self.expert_names) == 1:
            return [self.transformer]
        return [self.transformer.expert(name) for name in self.trained_experts]

    def expert_index(self, sigma: torch.Tensor) -> torch.Tensor:
        """``WanPipeline``'s rule: ``transformer`` where the timestep (float32 sigma x num_train_timesteps, the
        scheduler's) is >= boundary_ratio x num_train_timesteps, ``transformer_2`` below."""
        if len(self.expert_names) == 1:
            return super().expert_index(sigma)
        train_timesteps = self.pipeline.scheduler.config.num_train_timesteps
        timestep = sigma.to(torch.float32) * train_timesteps
        return (timestep < self.boundary_ratio * train_timesteps).long().cpu()

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
        """With two experts, each sample goes through the expert of its own sigma: the rollout's batches share one
        sigma (one expert call); a forward batching several timesteps (``transitions_per_micro_step``) may call
        both, high then low, the same order on every rank (ZeRO-3's gathers are collectives)."""
        model = self.transformer if module is None else module
        if len(self.expert_names) == 1:
            return self._guided_velocity(model, latents, sigma, embeddings, self.guidance_scale, {})
        experts = self.expert_index(sigma)
        velocity = None
        for index, name in enumerate(self.expert_names):
            chosen = torch.nonzero(experts == index).flatten()
            if len(chosen) == 0:
                continue
            scale = self.guidance_scale if name == "high" else self.guidance_scale_2
            if len(chosen) == len(experts):  # the whole batch: no gather, no scatter
                return self._guided_velocity(model, latents, sigma, embeddings, scale, {"expert": name})
            part = self._guided_velocity(
                model, latents[chosen.to(latents.device)], sigma[chosen.to(sigma.device)],
                embeddings.select(chosen), scale, {"expert": name},
            )  # fmt: skip
            velocity = part.new_empty((len(experts), *part.shape[1:])) if velocity is None else velocity
            velocity[chosen.to(part.device)] = part
        return velocity

    def _guided_velocity(self, model, latents, sigma, embeddings, scale: float, expert: dict) -> torch.Tensor:
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
            **expert,
        )[0].float()
        if branches == 1:
            return prediction
        cond, uncond = prediction.split(batch)
        return uncond + scale * (cond - uncond)

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


def _check_experts(
    pipeline: WanPipeline,
    guidance_scale: float,
    guidance_scale_2: float | None,
    train_experts: Sequence[str] | None,
) -> bool:
    """Whether the pipeline denoises with two experts; ValueError for a combination WanPipeline would not run as
    configured (a setting it would silently ignore)."""
    two_experts = pipeline.transformer_2 is not None
    if two_experts and pipeline.config.get("boundary_ratio") is None:
        raise ValueError("the pipeline has a transformer_2 but no boundary_ratio: WanPipeline would never run it")
    if pipeline.transformer is None:
        raise ValueError("the pipeline has no transformer (a Wan 2.2 low-noise expert alone is not supported)")
    if not two_experts and (guidance_scale_2 is not None or train_experts is not None):
        raise ValueError(
            "guidance_scale_2 and train_experts apply to two-expert Wan 2.2 (A14B) only; this checkpoint has one "
            "transformer"
        )
    if guidance_scale_2 is not None and guidance_scale_2 > 1.0 and guidance_scale <= 1.0:
        raise ValueError(
            f"guidance_scale_2={guidance_scale_2} with guidance_scale={guidance_scale}: WanPipeline turns CFG on "
            "for both experts by guidance_scale > 1 alone, so the low-noise scale would be ignored"
        )
    if train_experts is not None:
        if not train_experts or set(train_experts) - set(EXPERTS):
            raise ValueError(f"train_experts must name some of {list(EXPERTS)}, got {list(train_experts)}")
        if len(set(train_experts)) != len(train_experts):
            raise ValueError(f"train_experts names an expert twice: {list(train_experts)}")
    return two_experts
