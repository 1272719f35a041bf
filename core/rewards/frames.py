"""Frame sampling and resizing on tensors, as the released reward models' preprocessing does it.

VideoAlign was trained on frames read by ``qwen_vl_utils`` (uniform sampling at a target fps, then a bicubic,
antialiased torchvision resize to sides that are multiples of 28). These functions reproduce those rules on
in-memory uint8 tensors, so rollouts are scored without writing and re-decoding video files, and without
torchvision: ``torch.nn.functional.interpolate`` is the kernel torchvision's tensor resize calls.
"""

from __future__ import annotations

import math

from sage_grpo.core.lazy import lazy_module

torch = lazy_module("torch", globals())
F = lazy_module("torch.nn.functional", globals())

FRAME_FACTOR = 2  # Qwen2-VL's temporal patch: frames are consumed in pairs
MIN_SAMPLED_FRAMES = 4
MAX_SAMPLED_FRAMES = 768
MAX_ASPECT_RATIO = 200


def sampled_frame_count(total_frames: int, video_fps: float, sample_fps: float) -> int:
    """How many frames ``qwen_vl_utils`` samples at ``sample_fps``: an even count in [4, total] when possible."""
    min_frames = math.ceil(MIN_SAMPLED_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
    max_frames = math.floor(min(MAX_SAMPLED_FRAMES, total_frames) / FRAME_FACTOR) * FRAME_FACTOR
    wanted = total_frames / video_fps * sample_fps
    count = round(min(max(wanted, min_frames), max_frames) / FRAME_FACTOR) * FRAME_FACTOR
    count = min(count, total_frames)
    if count < FRAME_FACTOR:
        raise ValueError(f"a video of {total_frames} frame(s) is too short: at least {FRAME_FACTOR} are needed")
    return count


def uniform_frame_indices(total_frames: int, count: int) -> list[int]:
    """``count`` indices spread evenly from the first to the last frame, both included."""
    return torch.linspace(0, total_frames - 1, count).round().long().tolist()


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Sides that are multiples of ``factor``, near the original aspect ratio, with area in [min, max] pixels.

    This is ``qwen_vl_utils.smart_resize`` (the rule the released VideoAlign preprocessing used).
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio must be below {MAX_ASPECT_RATIO}, got {height}x{width}")
    resized_height = max(factor, round(height / factor) * factor)
    resized_width = max(factor, round(width / factor) * factor)
    if resized_height * resized_width > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        resized_height = math.floor(height / beta / factor) * factor
        resized_width = math.floor(width / beta / factor) * factor
    elif resized_height * resized_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        resized_height = math.ceil(height * beta / factor) * factor
        resized_width = math.ceil(width * beta / factor) * factor
    return resized_height, resized_width


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [F, H, W, 3] to uint8 [F, 3, height, width]: bicubic with antialias, rounded and clamped.

    Same arithmetic as ``torchvision.transforms.functional.resize(..., BICUBIC, antialias=True)`` on uint8.
    """
    channels_first = frames.permute(0, 3, 1, 2).float()
    resized = F.interpolate(channels_first, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return resized.round().clamp(0, 255).to(torch.uint8)
