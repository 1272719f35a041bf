"""The world: captions, the video generator, the full manifold, and a fixed linear map between pixels and latents.

A video is 8 frames of 16x16 RGB in [0, 1]: a 4x4 square of one palette colour, moving one pixel per frame in one of
four directions, on black. Given (colour, direction, start position) the video is fixed; a seed picks all three.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from functools import lru_cache

import torch

FRAMES, SIZE, SQUARE, SPEED = 8, 16, 4, 1
COLOURS = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0), "yellow": (1.0, 1.0, 0.0)}
# (dy, dx) per frame, in pixels: image rows grow downwards.
DIRECTIONS = {"left": (0, -SPEED), "right": (0, SPEED), "up": (-SPEED, 0), "down": (SPEED, 0)}
CAPTIONS = [f"a {colour} square moving {direction}" for colour in COLOURS for direction in DIRECTIONS]
# Held out of GRPO training, evaluated for generalisation: one colour x direction combination per colour and per
# direction (a Latin square), so every colour and every direction is trained with three others and never in these
# pairs. Pretraining saw them (it fits the whole world, as a pretrained video model has seen the words before); GRPO
# never rolls them out, so a gain on them is the fine-tuning generalising, not memorising its prompts.
HELD_OUT_CAPTIONS = [
    f"a {colour} square moving {direction}" for colour, direction in zip(COLOURS, ("left", "right", "up", "down"))
]
TRAIN_CAPTIONS = [caption for caption in CAPTIONS if caption not in HELD_OUT_CAPTIONS]

# Latents: 2 frames x 4x4 pixels x 3 channels per token, mixed by a fixed orthogonal matrix (a stand-in for a VAE that
# is linear, exactly invertible and costs nothing). 8x16x16 videos become latents [96, 4, 4, 4].
PATCH_T, PATCH_S = 2, 4
LATENT_CHANNELS = 3 * PATCH_T * PATCH_S * PATCH_S
LATENT_SHAPE = (LATENT_CHANNELS, FRAMES // PATCH_T, SIZE // PATCH_S, SIZE // PATCH_S)
_LATENT_MAP_SEED = 1234


@dataclass(frozen=True)
class Scene:
    colour: str
    direction: str
    y: int  # top-left corner of the square in the first frame
    x: int

    @property
    def caption(self) -> str:
        return f"a {self.colour} square moving {self.direction}"


# An evaluation file repeats a caption as "<caption> (sample N)": the recipe's evaluation samples each distinct prompt
# once (from noise of its position), so the repeats are how a held-out caption gets many evaluation videos.
_SAMPLE_TAG = re.compile(r" \(sample \d+\)$")


def parse_caption(caption: str) -> tuple[str, str]:
    words = _SAMPLE_TAG.sub("", caption).split()
    if len(words) != 5 or words[2:4] != ["square", "moving"] or words[1] not in COLOURS or words[4] not in DIRECTIONS:
        raise ValueError(f"not a ToyWorld caption: {caption!r} (expected e.g. {CAPTIONS[0]!r})")
    return words[1], words[4]


def sample_tagged(captions: list[str], samples: int) -> list[str]:
    """Each caption ``samples`` times as distinct prompts: "<caption> (sample 0)", ... (see ``parse_caption``)."""
    return [f"{caption} (sample {i})" for caption in captions for i in range(samples)]


def start_range(step: int) -> range:
    """Start coordinates along one axis that keep the square inside the frame for the whole video."""
    travel = step * (FRAMES - 1)
    low = max(0, -travel)
    high = SIZE - SQUARE - max(0, travel)
    return range(low, high + 1)


def random_scene(seed: int, caption: str | None = None) -> Scene:
    """A scene drawn from the seed alone; ``caption`` fixes colour and direction and leaves only the position random."""
    generator = torch.Generator().manual_seed(seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=generator))]
    colour, direction = parse_caption(caption) if caption else parse_caption(pick(CAPTIONS))
    dy, dx = DIRECTIONS[direction]
    return Scene(colour, direction, pick(list(start_range(dy))), pick(list(start_range(dx))))


def render(scene: Scene) -> torch.Tensor:
    """The scene's video as float [F, 3, H, W] in [0, 1]."""
    video = torch.zeros(FRAMES, 3, SIZE, SIZE)
    dy, dx = DIRECTIONS[scene.direction]
    colour = torch.tensor(COLOURS[scene.colour]).view(3, 1, 1)
    for frame in range(FRAMES):
        y, x = scene.y + dy * frame, scene.x + dx * frame
        video[frame, :, y : y + SQUARE, x : x + SQUARE] = colour
    return video


def batch(seeds: list[int], captions: list[str] | None = None) -> tuple[torch.Tensor, list[str]]:
    """Videos [B, F, 3, H, W] and their captions for ``seeds`` (optionally with fixed captions)."""
    captions = captions or [None] * len(seeds)
    scenes = [random_scene(seed, caption) for seed, caption in zip(seeds, captions)]
    return torch.stack([render(scene) for scene in scenes]), [scene.caption for scene in scenes]


@lru_cache(maxsize=1)
def manifold() -> tuple[torch.Tensor, list[Scene]]:
    """Every valid video of the world (about 1,250) as float [N, F, 3, H, W], with its scene."""
    scenes = []
    for colour, direction in itertools.product(COLOURS, DIRECTIONS):
        dy, dx = DIRECTIONS[direction]
        scenes += [Scene(colour, direction, y, x) for y in start_range(dy) for x in start_range(dx)]
    return torch.stack([render(scene) for scene in scenes]), scenes


# ----------------------------------------------------------------------------------------------------------------
# The fixed linear latent map
# ----------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _mixing_matrix() -> torch.Tensor:
    generator = torch.Generator().manual_seed(_LATENT_MAP_SEED)
    q, _ = torch.linalg.qr(torch.randn(LATENT_CHANNELS, LATENT_CHANNELS, generator=generator, dtype=torch.float64))
    return q.float()


def encode(videos: torch.Tensor) -> torch.Tensor:
    """Videos [B, F, 3, H, W] in [0, 1] to latents [B, C, F', H', W'] (pixels scaled to [-1, 1], then mixed)."""
    b = videos.shape[0]
    t, h, w = FRAMES // PATCH_T, SIZE // PATCH_S, SIZE // PATCH_S
    pixels = (videos * 2 - 1).reshape(b, t, PATCH_T, 3, h, PATCH_S, w, PATCH_S)
    tokens = pixels.permute(0, 1, 4, 6, 2, 3, 5, 7).reshape(b, t, h, w, LATENT_CHANNELS)
    return (tokens @ _mixing_matrix().T).permute(0, 4, 1, 2, 3).contiguous()


def decode(latents: torch.Tensor) -> torch.Tensor:
    """The exact inverse of ``encode``: latents to videos [B, F, 3, H, W], unclamped."""
    b = latents.shape[0]
    t, h, w = LATENT_SHAPE[1:]
    tokens = latents.float().permute(0, 2, 3, 4, 1) @ _mixing_matrix().to(latents.device)
    pixels = tokens.reshape(b, t, h, w, PATCH_T, 3, PATCH_S, PATCH_S).permute(0, 1, 4, 5, 2, 6, 3, 7)
    return (pixels.reshape(b, FRAMES, 3, SIZE, SIZE) + 1) / 2
