"""The one interface the stages use to talk to a text-to-video model; nothing model-specific lives outside it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy as np

from sage_grpo.core.distributed import ParallelLayout
from sage_grpo.core.errors import UserError
from sage_grpo.core.lazy import lazy_module

torch = lazy_module("torch", globals())


@dataclass
class PromptEmbeddings:
    """Text conditioning for a batch of prompts. Tensors are batch-first; ``negative`` holds the CFG branch or None.

    Each model family stores what its transformer needs in ``tensors`` (for HunyuanVideo 1.5: the Qwen2.5-VL and
    ByT5 embeddings and their masks); stages only select, move and concatenate them.
    """

    tensors: dict[str, torch.Tensor]
    negative: dict[str, torch.Tensor] | None = None

    def select(self, index: torch.Tensor | list[int]) -> PromptEmbeddings:
        index = torch.as_tensor(index, dtype=torch.long)
        pick = lambda group: None if group is None else {k: v[index.to(v.device)] for k, v in group.items()}
        return PromptEmbeddings(pick(self.tensors), pick(self.negative))

    def to(self, device=None, dtype=None) -> PromptEmbeddings:
        def move(group):
            if group is None:
                return None
            return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else None) for k, v in group.items()}

        return PromptEmbeddings(move(self.tensors), move(self.negative))


class VideoModelAdapter(ABC):
    """What rollout, update and evaluation need from a video diffusion model.

    ``transformer`` is the trainable module (possibly wrapped by peft or partitioned by DeepSpeed ZeRO-3: calling it
    gathers parameters). ``predict_velocity`` accepts another module with the same signature, which is how the
    KL anchor is evaluated on exactly the policy's conditioning and guidance.
    """

    transformer: torch.nn.Module
    guidance_scale: float = 1.0
    # Config of the FlowMatchEulerDiscreteScheduler whose sigmas the rollout uses; {} means its defaults.
    scheduler_config: dict[str, Any] = {}

    @property
    @abstractmethod
    def encoder_identity(self) -> str:
        """A stable string naming the text encoders and their weights: half of the embedding-cache key."""

    @abstractmethod
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeddings:
        """Embeddings for ``prompts`` (and for the negative prompt when guidance_scale > 1)."""

    @abstractmethod
    def latent_shape(self) -> tuple[int, ...]:
        """Shape of one sample's latents without the batch dimension: [C, F, H, W]."""

    @abstractmethod
    def predict_velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        embeddings: PromptEmbeddings,
        *,
        module: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        """Velocity v at noise level ``sigma`` ([B]), with CFG combined as the model's diffusers pipeline does."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents to uint8 videos [B, F, H, W, 3]."""

    # The transformers ("experts") the model denoises with, numbered as ``expert_index`` numbers them, and those the
    # update trains. One for every model but two-expert Wan 2.2 (``core.models.wan``).
    expert_names: tuple[str, ...] = ("transformer",)
    trained_experts: tuple[str, ...] = ("transformer",)

    def expert_index(self, sigma: torch.Tensor) -> torch.Tensor:
        """The expert that denoises at each noise level of ``sigma`` (any shape; a CPU long tensor alike)."""
        return torch.zeros(sigma.shape, dtype=torch.long)

    def trained_expert_steps(self, sigmas: torch.Tensor) -> torch.Tensor:
        """[T] bool for the steps of ``sigmas`` ([T+1]) whose expert the update trains."""
        trained = torch.tensor([name in self.trained_experts for name in self.expert_names])
        return trained[self.expert_index(sigmas[:-1])]

    def trainable_modules(self) -> list[torch.nn.Module]:
        """The modules whose weights train (LoRA is added to each): the trained experts, parts of ``transformer``."""
        return [self.transformer]

    def enable_sequence_parallel(self, parallel: ParallelLayout) -> None:
        """Split each sample's video tokens over the K ranks of this rank's sequence-parallel group; the recipe asks
        every adapter. Nothing to do at K = 1; a model that cannot split its tokens refuses K > 1."""
        if parallel.sequence_parallel_size > 1:
            raise UserError(
                f"{type(self).__name__} does not split its video tokens: parallel.sequence_parallel_size must be 1"
            )

    @property
    def fps(self) -> int:
        return 24

    def sigma_schedule(self, steps: int, shift: float) -> torch.Tensor:
        """T+1 float32 sigmas from 1 to 0, computed by diffusers' scheduler exactly as HunyuanVideo 1.5's pipeline does.

        Going through the scheduler (not our own formula) keeps our ODE loop bit-compatible with the pipeline's.
        """
        # Imported here: importing diffusers takes seconds, which code that only needs this interface should not pay.
        from diffusers import FlowMatchEulerDiscreteScheduler

        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        # The rollout's fixed shift replaces any resolution-dependent one (which the pipeline would need a mu for).
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            {**self.scheduler_config, "use_dynamic_shifting": False}, shift=shift
        )
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])
        return scheduler.sigmas

    @property
    def num_train_timesteps(self) -> int:
        """The transformer's timestep input is sigma times this (1000 for every flow-matching scheduler we know)."""
        return int(self.scheduler_config.get("num_train_timesteps", 1000))


class DiffusersAdapter(VideoModelAdapter):
    """What every adapter built on a diffusers pipeline object shares: identity, CFG switch, placement, latent shape.

    Subclasses set ``pipeline``, ``transformer``, ``guidance_scale``, ``height``, ``width``, ``num_frames`` and
    ``_identity``, and say how many latent channels the model has.
    """

    pipeline: Any
    _identity: str
    height: int
    width: int
    num_frames: int

    @property
    def encoder_identity(self) -> str:
        return self._identity

    @property
    def cfg_enabled(self) -> bool:
        return self.guidance_scale > 1.0

    # From one parameter: diffusers' ModelMixin.device/.dtype walk every parameter, a millisecond per velocity call.
    @property
    def device(self) -> torch.device:
        return next(self.pipeline.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.pipeline.transformer.parameters()).dtype

    def cfg_conditions(self, embeddings: PromptEmbeddings) -> list[dict[str, torch.Tensor]]:
        """The text conditioning of each transformer branch, on the model's device and dtype: [cond], or
        [cond, uncond] with CFG (the two branches then run as one batch)."""
        text = embeddings.to(self.device, self.dtype)
        return [text.tensors] + ([text.negative] if self.cfg_enabled else [])

    @abstractmethod
    def latent_channels(self) -> int:
        """Channels of the denoised latents (not of the transformer's input, which may carry conditioning)."""

    @abstractmethod
    def patch_size(self) -> tuple[int, int, int]:
        """The transformer's (frames, height, width) patch: latents per video token."""

    def attention_layout(self) -> tuple[int, int]:
        """(attention heads, video tokens of one sample): what a sequence-parallel size must divide."""
        _, frames, height, width = self.latent_shape()
        p_t, p_h, p_w = self.patch_size()
        return self.pipeline.transformer.config.num_attention_heads, (frames // p_t) * (height // p_h) * (width // p_w)

    def context_parallel_plan(self) -> dict | None:
        """Where diffusers' context parallelism splits and gathers the tokens; None: the model's own ``_cp_plan``."""
        return None

    def enable_sequence_parallel(self, parallel: ParallelLayout) -> None:
        """Split every transformer forward's video tokens over the K ranks of this rank's sequence-parallel group
        (``parallel``, from ``ParallelLayout.build``): diffusers' context parallelism with Ulysses attention, forward
        and backward. Each rank computes its share of the tokens; the output is gathered, so every rank of the group
        gets the whole velocity. Call it after LoRA is added (the hooks sit on the modules LoRA may wrap). Nothing to
        do at K = 1."""
        from diffusers import ContextParallelConfig

        size = parallel.sequence_parallel_size
        if size == 1:
            return
        check_sequence_split(*self.attention_layout(), size)
        config = ContextParallelConfig(ulysses_degree=size, mesh=parallel.mesh)
        with _cpu_counts_as_a_device():
            for transformer in self.denoisers():
                transformer.enable_parallelism(config=config, cp_plan=self.context_parallel_plan())

    def denoisers(self) -> list[torch.nn.Module]:
        """The pipeline's transformers (two for two-expert Wan 2.2): what sequence parallelism splits."""
        return [self.pipeline.transformer]

    def latent_shape(self) -> tuple[int, ...]:
        p = self.pipeline
        frames = (self.num_frames - 1) // p.vae_scale_factor_temporal + 1
        return (
            self.latent_channels(),
            frames,
            self.height // p.vae_scale_factor_spatial,
            self.width // p.vae_scale_factor_spatial,
        )


def check_sequence_split(heads: int, tokens: int, size: int) -> None:
    """Ulysses gives each of ``size`` ranks all tokens of heads/size heads, and each an equal share of the tokens."""
    if heads % size:
        raise UserError(f"parallel.sequence_parallel_size={size} does not divide the model's {heads} attention heads")
    if tokens % size:
        raise UserError(
            f"parallel.sequence_parallel_size={size} does not divide the {tokens} video tokens of a sample "
            "(set by the model's height, width and num_frames)"
        )


@contextmanager
def _cpu_counts_as_a_device():
    """diffusers 0.42 places each rank on device ``rank % torch.accelerator.device_count()``
    (``ModelMixin._resolve_parallel_config``), a division by zero without an accelerator: there, count the CPU as one
    device (the CPU is the device every rank uses then)."""
    if torch.accelerator.device_count():
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", return_value=1):
        yield


def frames_to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """Videos in [0, 1] shaped [B, F, 3, H, W], as diffusers' ``postprocess_video(output_type="pt")`` returns them,
    to uint8 [B, F, H, W, 3] on the CPU."""
    return (frames.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 1, 3, 4, 2).contiguous().cpu()
