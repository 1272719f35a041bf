"""A tiny HunyuanVideo 1.5 transformer (the real diffusers class) behind the adapter interface, for ToyWorld.

Two stand-ins replace the pretrained encoders, both fixed and free of learning: the caption's colour and direction are
one-hot vectors projected to the text width by a fixed random matrix (two text tokens), and the VAE is the fixed
orthogonal latent map of ``world.py``. Everything the stages see (``predict_velocity``, ``decode``, prompt
embeddings) goes through the same interface as the real model.

The transformer predicts the clean latents x0 and ``predict_velocity`` turns them into the velocity the stages expect,
v = (x - x0_hat) / sigma. A pretraining study on this machine found v-prediction stalled (the tiny model spends its
capacity predicting the noise, and its direction-of-motion accuracy stayed near chance) where x0-prediction reached
colour 0.99 / direction 0.41 in the same five minutes. The GRPO maths is unchanged: the policy is still a Gaussian
around the SDE mean of that velocity.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

import torch
from diffusers import HunyuanVideo15Transformer3DModel

from sage_grpo.core.models.base import PromptEmbeddings, VideoModelAdapter, frames_to_uint8

from . import world

TEXT_DIM, GLYPH_DIM, IMAGE_DIM = 16, 8, 8
TRANSFORMER_CONFIG = dict(
    # t2v only, so no condition-latent or mask channels (the released model's 65 = 32 + 32 + 1): latents in and out.
    in_channels=world.LATENT_CHANNELS,
    out_channels=world.LATENT_CHANNELS,
    # The hidden width must exceed the 96 latent channels: through a narrower linear patch embedding and output
    # projection the model cannot even represent the noise it has to predict (a 64-wide first try plateaued there).
    num_attention_heads=4,
    attention_head_dim=32,
    num_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    patch_size=1,
    patch_size_t=1,
    text_embed_dim=TEXT_DIM,
    text_embed_2_dim=GLYPH_DIM,
    image_embed_dim=IMAGE_DIM,
    rope_axes_dim=(8, 12, 12),
    target_size=world.SIZE,
    task_type="t2v",
)
# Branches that only ever see masked-out or all-zero inputs here (ByT5 glyphs, image conditioning): their gradient is
# zero, and the ByT5 projection alone holds 4.3M of the model's 5.8M weights, so training them would only cost time.
UNUSED_BRANCHES = ("context_embedder_2", "image_embedder")
PREDICTION = "x0"  # what the transformer outputs (part of the weights' cache key)
_CAPTION_PROJECTION_SEED = 99


def build_transformer(seed: int = 0) -> HunyuanVideo15Transformer3DModel:
    torch.manual_seed(seed)
    return HunyuanVideo15Transformer3DModel(**TRANSFORMER_CONFIG)


def train_used_weights(transformer: torch.nn.Module) -> torch.nn.Module:
    """Make every weight the toy task reaches trainable (everything but the unused branches), for pretraining and
    for full fine-tuning with GRPO."""
    transformer.requires_grad_(True)
    for name in UNUSED_BRANCHES:
        getattr(transformer, name).requires_grad_(False)
    return transformer


@lru_cache(maxsize=1)
def _caption_projection() -> torch.Tensor:
    generator = torch.Generator().manual_seed(_CAPTION_PROJECTION_SEED)
    return torch.randn(len(world.COLOURS) + len(world.DIRECTIONS), TEXT_DIM, generator=generator)


def caption_tokens(captions: list[str]) -> torch.Tensor:
    """[B, 2, TEXT_DIM]: a colour token and a direction token, each a projected one-hot vector."""
    colours, directions = list(world.COLOURS), list(world.DIRECTIONS)
    one_hot = torch.zeros(len(captions), 2, len(colours) + len(directions))
    for i, caption in enumerate(captions):
        colour, direction = world.parse_caption(caption)
        one_hot[i, 0, colours.index(colour)] = 1.0
        one_hot[i, 1, len(colours) + directions.index(direction)] = 1.0
    return one_hot @ _caption_projection()


class ToyWorldAdapter(VideoModelAdapter):
    """ToyWorld text-to-video without CFG: latents [96, 4, 4, 4], videos of 8 frames at 16x16."""

    encoder_identity = "toyworld:onehot-projection-v1"

    def __init__(self, transformer: torch.nn.Module):
        self.transformer = transformer

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def fps(self) -> int:
        return 8

    def trainable_modules(self) -> list[torch.nn.Module]:
        """What ``train_used_weights`` trains, for a recipe run: every part but the unused branches."""
        return [module for name, module in self.transformer.named_children() if name not in UNUSED_BRANCHES]

    def latent_shape(self) -> tuple[int, ...]:
        return world.LATENT_SHAPE

    def enable_sequence_parallel(self, parallel) -> None:
        """64 video tokens on one process: the ToyWorld never splits them (the recipe asks every adapter)."""
        from sage_grpo.core.errors import UserError

        if parallel.sequence_parallel_size != 1:
            raise UserError("the ToyWorld model does not split its tokens: parallel.sequence_parallel_size must be 1")

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeddings:
        b = len(prompts)
        return PromptEmbeddings(
            {
                "encoder_hidden_states": caption_tokens(prompts),
                "encoder_attention_mask": torch.ones(b, 2, dtype=torch.long),
                # One glyph token, masked out: the transformer requires the ByT5 stream, the captions have no glyphs.
                "encoder_hidden_states_2": torch.zeros(b, 1, GLYPH_DIM),
                "encoder_attention_mask_2": torch.zeros(b, 1, dtype=torch.long),
            }
        )

    def predict_clean(self, latents, sigma, embeddings, *, module=None) -> torch.Tensor:
        """The transformer's own output: the clean latents x0_hat at noise level ``sigma`` ([B])."""
        model = self.transformer if module is None else module
        text = embeddings.to(self.device, torch.float32)
        batch = latents.shape[0]
        return model(
            hidden_states=latents.to(self.device, torch.float32),
            timestep=sigma.to(self.device, torch.float32) * self.num_train_timesteps,
            # All-zero image embeddings: the transformer reads them as text-to-video and masks those tokens out.
            image_embeds=torch.zeros(batch, 1, IMAGE_DIM, device=self.device),
            return_dict=False,
            **text.tensors,
        )[0].float()

    def predict_velocity(self, latents, sigma, embeddings, *, module=None) -> torch.Tensor:
        x = latents.to(self.device, torch.float32)
        x0 = self.predict_clean(x, sigma, embeddings, module=module)
        # x = (1 - sigma) x0 + sigma noise and v = noise - x0 give v = (x - x0) / sigma; every sigma a step evaluates
        # the model at is > 0 (the schedule's last sigma, 0, is only ever a step's target).
        sigma = sigma.to(self.device, torch.float32).reshape(-1, *([1] * (x.ndim - 1)))
        return (x - x0) / sigma

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return frames_to_uint8(world.decode(latents.cpu()))


class PretrainedFinalStepAdapter(ToyWorldAdapter):
    """A measurement, not a product: the sampler's last step (to sigma 0) runs on a frozen copy of the pretrained
    weights, in rollouts and evaluations alike, while every other step runs on the policy. It shows what the last
    step's own weights do to learning (docs/algorithm.md, "Every model-dependent step trains"); an export of it would
    need two transformers, so the pipeline never ships it."""

    def __init__(self, transformer: torch.nn.Module):
        super().__init__(transformer)
        self.pretrained = copy.deepcopy(transformer).requires_grad_(False)
        self._final_sigma: float | None = None

    def sigma_schedule(self, steps: int, shift: float) -> torch.Tensor:
        sigmas = super().sigma_schedule(steps, shift)
        self._final_sigma = float(sigmas[-2])
        return sigmas

    def predict_velocity(self, latents, sigma, embeddings, *, module=None) -> torch.Tensor:
        final = module is None and self._final_sigma is not None and bool(torch.all(sigma == self._final_sigma))
        return super().predict_velocity(latents, sigma, embeddings, module=self.pretrained if final else module)


# ----------------------------------------------------------------------------------------------------------------
# Weights cached by the hash of everything that determines them
# ----------------------------------------------------------------------------------------------------------------

# TOYWORLD_CACHE moves it (a test's throw-away weights stay out of the machine's cache).
CACHE_DIR = Path(os.environ.get("TOYWORLD_CACHE", Path.home() / ".cache" / "sage-grpo" / "toyworld"))


def weights_key(pretrain_settings: dict) -> str:
    """A short hash of the model, the world and the pretraining settings: any change gives new weights."""
    identity = {
        "transformer": TRANSFORMER_CONFIG,
        "world": [world.FRAMES, world.SIZE, world.SQUARE, world.SPEED, world.PATCH_T, world.PATCH_S],
        "captions": ToyWorldAdapter.encoder_identity,
        "prediction": PREDICTION,
        "pretrain": pretrain_settings,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def toyworld_adapter(
    guidance_scale: float = 1.0,
    dtype: str | torch.dtype = "float32",
    *,
    sha256: str | None = None,
    pretrain_steps: int | None = None,
    final_step_weights: str = "policy",
) -> ToyWorldAdapter:
    """``model.name: benchmarks.toyworld.model:toyworld_adapter``: the pretrained ToyWorld model for a recipe run
    (``sagegrpo run``), its used weights trainable. It loads the weights ``python -m benchmarks.toyworld.pretrain``
    cached and never fits them here; ``sha256`` (the weights file's, which ``pretrain`` prints) makes a run on other
    weights (pretraining elsewhere gives other weights) refuse to start; ``pretrain_steps`` picks the weights of a
    shorter or longer fit (a test's); ``final_step_weights="pretrained"`` runs the last step on the pretrained
    weights (``PretrainedFinalStepAdapter``, a measurement). The ToyWorld has no CFG and runs in float32."""
    from safetensors.torch import load_file

    from sage_grpo.core.errors import UserError

    from .pretrain import cached_weights, pretrain_config

    if guidance_scale != 1.0 or dtype not in ("float32", torch.float32):
        raise UserError("the ToyWorld model has no CFG and runs in float32: model.guidance_scale 1, dtype float32")
    config = pretrain_config(pretrain_steps)
    path = cached_weights(config)
    if not path.exists():
        raise UserError(f"no pretrained ToyWorld weights at {path}: run python -m benchmarks.toyworld.pretrain first")
    found = weights_sha256(path)
    if sha256 is not None and found != sha256:
        raise UserError(f"the ToyWorld weights at {path} have sha256 {found}, not model.kwargs.sha256 {sha256}")
    transformer = build_transformer(config.seed)
    transformer.load_state_dict(load_file(str(path)), strict=True)
    if final_step_weights not in ("policy", "pretrained"):
        raise UserError(f"final_step_weights must be policy or pretrained, got {final_step_weights!r}")
    adapter = PretrainedFinalStepAdapter if final_step_weights == "pretrained" else ToyWorldAdapter
    return adapter(train_used_weights(transformer.eval()))


def weights_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
