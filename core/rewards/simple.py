"""Cheap pixel-statistics rewards: CPU-fast, deterministic, and with a meaning a tiny model can learn.

They exist for tests and the demo (a random tiny video model can visibly raise mean brightness within a few
updates) and as sanity signals next to learned rewards; none of them judges prompt alignment.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, validate_call

from sage_grpo.core.lazy import lazy_module

from .base import Scores, VideoBatch

torch = lazy_module("torch", globals())

# ITU-R BT.601 luma weights: perceived brightness of an RGB pixel.
LUMA_WEIGHTS = (0.299, 0.587, 0.114)


def _unit_float(video: torch.Tensor) -> torch.Tensor:
    return video.float() / 255.0


class Brightness:
    """Closeness of the mean luma (in [0, 1]) to ``target``: ``-|mean luma - target|``, at best 0.

    With the default target 1.0 this is "brighter is better", the demo's reward: an easy, monotone direction for a
    randomly initialised video model to find.
    """

    # The range is in the signature, so a config's kwargs are checked against it when the config is read (the
    # reward registry validates kwargs by their annotations), before DeepSpeed or a model loads; validate_call holds
    # direct construction to the same range.
    @validate_call
    def __init__(self, target: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0):
        self.target = target
        self.luma = torch.tensor(LUMA_WEIGHTS)

    def __call__(self, videos: VideoBatch, prompts: list[str]) -> Scores:
        scores = []
        for video in videos:
            mean_luma = (_unit_float(video) @ self.luma.to(video.device)).mean().item()
            scores.append(-abs(mean_luma - self.target))
        return {"brightness": scores}


class TemporalSmoothness:
    """Negative mean absolute change between consecutive frames (pixels in [0, 1]); 0 for a still video.

    Rewards flicker-free video; on its own it also rewards no motion at all, so pair it with a motion-aware reward.
    """

    def __call__(self, videos: VideoBatch, prompts: list[str]) -> Scores:
        scores: list[float | None] = []
        for video in videos:
            if video.shape[0] < 2:
                scores.append(None)  # a single frame has no frame-to-frame change to judge
                continue
            frames = _unit_float(video)
            scores.append(-(frames[1:] - frames[:-1]).abs().mean().item())
        return {"temporal_smoothness": scores}


class Colorfulness:
    """Hasler and Suesstrunk's colourfulness (2003), averaged over frames, on pixels in [0, 1].

    Opponent channels rg = R - G and yb = (R + G) / 2 - B; per frame ``sqrt(std_rg^2 + std_yb^2) +
    0.3 * sqrt(mean_rg^2 + mean_yb^2)``. Grey is 0; saturated, varied colour scores higher.
    """

    def __call__(self, videos: VideoBatch, prompts: list[str]) -> Scores:
        scores = []
        for video in videos:
            red, green, blue = _unit_float(video).unbind(-1)
            rg = (red - green).flatten(1)
            yb = (0.5 * (red + green) - blue).flatten(1)
            spread = (rg.var(dim=1, unbiased=False) + yb.var(dim=1, unbiased=False)).sqrt()
            offset = (rg.mean(dim=1) ** 2 + yb.mean(dim=1) ** 2).sqrt()
            scores.append((spread + 0.3 * offset).mean().item())
        return {"colorfulness": scores}
