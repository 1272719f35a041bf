"""``ColorMatch``: how close a video's colours are to the colour its prompt asks for.

The target comes from a per-prompt metadata column (``target_color``, a ``#rrggbb`` string) of the prompt file:
sage-grpo passes every column a reward's ``__call__`` names as a keyword argument, one value per video, None where
a prompt has no such column. A prompt without a target gets no score (None), which drops its video from its GRPO
group instead of counting it as 0.
"""

from __future__ import annotations

import math

import torch

# The largest RGB distance, between black and white: scores are 1 - distance / MAX_DISTANCE, in [0, 1].
MAX_DISTANCE = math.sqrt(3.0)


def parse_hex_color(text: str) -> torch.Tensor:
    """``"#ff8800"`` -> tensor([1.0, 0.533, 0.0]); a malformed colour is a ValueError naming it."""
    digits = text.strip().removeprefix("#")
    if len(digits) != 6:
        raise ValueError(f"target_color {text!r} is not of the form #rrggbb")
    try:
        return torch.tensor([int(digits[i : i + 2], 16) / 255.0 for i in (0, 2, 4)])
    except ValueError:
        raise ValueError(f"target_color {text!r} is not of the form #rrggbb") from None


class ColorMatch:
    """Per video: 1 - (distance between its mean RGB colour and the prompt's ``target_color``) / sqrt(3).

    Also reports ``saturation`` (mean HSV saturation), a diagnostic: ``default_weights`` leaves it out of the
    total, so it is logged but never trained on. ``frames``: how many frames, evenly spaced, are averaged.
    """

    default_weights = {"color_match": 1.0}

    def __init__(self, frames: int = 8):
        if frames < 1:
            raise ValueError(f"frames must be >= 1, got {frames}")
        self.frames = frames

    def __call__(self, videos, prompts: list[str], target_color: list[str | None]) -> dict[str, list[float | None]]:
        matches: list[float | None] = []
        saturations: list[float] = []
        for video, target in zip(videos, target_color):
            pixels = self._sampled(video).float() / 255.0  # [frames, H, W, 3] in [0, 1]
            saturations.append(self._saturation(pixels))
            if target is None:
                matches.append(None)
                continue
            mean = pixels.mean(dim=(0, 1, 2)).cpu()
            matches.append(1.0 - torch.linalg.vector_norm(mean - parse_hex_color(target)).item() / MAX_DISTANCE)
        return {"color_match": matches, "saturation": saturations}

    def _sampled(self, video: torch.Tensor) -> torch.Tensor:
        indices = torch.linspace(0, video.shape[0] - 1, min(self.frames, video.shape[0])).round().long()
        return video[indices.to(video.device)]

    @staticmethod
    def _saturation(pixels: torch.Tensor) -> float:
        high, low = pixels.amax(dim=-1), pixels.amin(dim=-1)
        return torch.where(high > 0, (high - low) / high.clamp_min(1e-8), torch.zeros_like(high)).mean().item()
