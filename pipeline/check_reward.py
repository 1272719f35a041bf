"""``sagegrpo check-reward SPEC|CONFIG``: try a reward before a run does.

Builds the reward(s) a config names (or one spec: a built-in name or ``package.module:Class`` with ``kwargs.x=...``
overrides), scores synthetic videos of the configured size (``model.kwargs`` num_frames/height/width/fps, else
small defaults) with real prompts from the data source and their metadata columns, through the same ``Scorer`` a
run uses, so the output is checked by the same contract (one list per named dimension, one float or None per video)
and weighted the same way. Any failure of a call is fatal here (no retries, no failed-sample allowance): a check
passes only if every sample is scored. Prints the dimensions with their effective weights, score ranges, seconds per
video (the second call; the first, with warm-up, beside it) and peak memory.

Then the reward's sensitivity: the same videos perturbed in what a generator can change without making a better
video (the known VideoAlign hacks: more frames, another frame rate, resolution, over-exposure, oversaturation), and
the mean change of the total and of each dimension per perturbation. A reward that rises under one of them can be
gamed by it; the largest such rise of the total is named.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from sage_grpo.core import config_loading
from sage_grpo.core.errors import UserError
from sage_grpo.core.rewards import RewardSpec, VideoBatch
from sage_grpo.core.rewards.simple import LUMA_WEIGHTS
from sage_grpo.core.s3 import S3Config
from sage_grpo.pipeline.config import load_run_config
from sage_grpo.stages.ingest import DataConfig, ingest
from sage_grpo.stages.score import ScoredBatch, Scorer, ScoringConfig

# Used when neither the config nor the caller says: small enough for a laptop CPU, long enough for temporal rewards.
DEFAULT_FRAMES, DEFAULT_HEIGHT, DEFAULT_WIDTH, DEFAULT_FPS = 9, 64, 64, 24.0
# Without a data source: prompts of the kinds rewards judge (objects, motion, style).
FALLBACK_PROMPTS = [
    "a red car driving along a coastal road at sunset",
    "a cat jumping onto a wooden table",
    "an anime-style city street in the rain at night",
    "a slow pan across snowy mountains",
]


@dataclass(frozen=True)
class VideoSize:
    num_frames: int = DEFAULT_FRAMES
    height: int = DEFAULT_HEIGHT
    width: int = DEFAULT_WIDTH
    fps: float = DEFAULT_FPS

    def __post_init__(self):
        if min(self.num_frames, self.height, self.width) < 1 or not self.fps > 0:
            raise UserError(
                f"video size must be positive, got {self.num_frames} frames of {self.height}x{self.width}"
                f" at {self.fps} fps"
            )

    @classmethod
    def from_model_kwargs(cls, kwargs: dict) -> VideoSize:
        known = {name: kwargs[name] for name in ("num_frames", "height", "width", "fps") if kwargs.get(name)}
        return cls(**known)


def parse_size(text: str, fps: float = DEFAULT_FPS) -> VideoSize:
    """``"9x64x64"`` (frames x height x width), as the command line gives it, into a VideoSize."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        raise UserError(f"video size {text!r} is not FRAMESxHEIGHTxWIDTH, e.g. 9x64x64")
    frames, height, width = map(int, parts)
    return VideoSize(frames, height, width, fps)


class _RewardsFile(BaseModel):
    # A rewards-only YAML (what serve-reward takes): the rest of a run config may be absent.
    model_config = ConfigDict(extra="ignore")

    rewards: list[RewardSpec] = Field(min_length=1)
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    data: DataConfig | None = None
    s3: S3Config = Field(default_factory=S3Config)


@dataclass
class _Target:
    specs: list[RewardSpec]
    size: VideoSize
    data: DataConfig | None
    timeout_s: float | None
    s3: S3Config  # how an s3:// data source is read


def check_reward(
    target: str,
    overrides: list[str] = (),
    *,
    data: str | None = None,
    num_videos: int = 4,
    size: VideoSize | None = None,
    device: str | None = None,
    seed: int = 0,
    out: Callable[[str], None] = print,
    sensitivity: bool = True,
) -> int:
    """Check every reward of ``target`` (a config YAML, or one reward spec) and print what was found; returns 0.

    ``overrides``: ``key.sub=value`` for the config, or for the spec (``kwargs.banned=blood``, ``weights.safety=2``).
    ``data``: a prompt source replacing the config's. ``size``: replaces the configured video size. A reward that
    fails, returns a bad output or needs a prompt column the prompts lack raises a one-line UserError.
    ``sensitivity``: also score the perturbed videos (``PERTURBATIONS``, one more call each).
    """
    if num_videos < 1:
        raise UserError(f"the number of videos must be >= 1, got {num_videos}")
    found = _load_target(target, list(overrides))
    source = DataConfig(source=data) if data else found.data
    size = size or found.size
    prompts, metadata = _prompts(source, num_videos, found.s3)
    videos = synthetic_videos(num_videos, size, seed)
    columns = sorted({name for row in metadata for name in row}) if metadata else []
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out(
        f"check-reward: {num_videos} synthetic videos of {size.num_frames} frames at {size.height}x{size.width}, "
        f"{size.fps:g} fps, on {device}; prompts from {source.source if source else 'built-in examples'} "
        f"(metadata columns: {', '.join(columns) or 'none'})"
    )
    for spec in found.specs:
        report = _check_one(spec, videos, prompts, metadata, device, found.timeout_s, sensitivity)
        out("\n".join(report))
    return 0


def synthetic_videos(count: int, size: VideoSize, seed: int) -> VideoBatch:
    """Moving colour gradients with a little noise: deterministic, different per video, changing over time, so
    pixel and temporal rewards see varied input (pure noise would score the same everywhere)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.linspace(0, 1, size.height)[:, None, None]
    cols = torch.linspace(0, 1, size.width)[None, :, None]
    videos = []
    for _ in range(count):
        colour = torch.rand(3, generator=generator)
        frames = []
        for frame in range(size.num_frames):
            phase = frame / max(size.num_frames, 1)
            image = (colour * rows + (1 - colour) * ((cols + phase) % 1.0)) / 2 + 0.25
            noise = torch.rand(size.height, size.width, 3, generator=generator) * 0.1
            frames.append(((image + noise).clamp(0, 1) * 255).to(torch.uint8))
        videos.append(torch.stack(frames))
    return VideoBatch(videos, size.fps)


def _load_target(target: str, overrides: list[str]) -> _Target:
    if Path(target).suffix.lower() in (".yaml", ".yml") or Path(target).is_file():
        raw = config_loading.read_yaml(target)
        if "data" in raw:  # a run config: validated whole, as ``run`` would
            config = load_run_config(target, overrides)
            return _Target(
                config.rewards,
                VideoSize.from_model_kwargs(config.model.kwargs),
                config.data,
                config.scoring.timeout_s,
                config.s3,
            )
        rewards = config_loading.validate(_RewardsFile, config_loading.apply_overrides(raw, overrides), target)
        return _Target(rewards.rewards, VideoSize(), rewards.data, rewards.scoring.timeout_s, rewards.s3)
    spec = config_loading.validate(RewardSpec, config_loading.apply_overrides({"name": target}, overrides), target)
    return _Target([spec], VideoSize(), None, ScoringConfig().timeout_s, S3Config())


def _prompts(source: DataConfig | None, count: int, s3: S3Config) -> tuple[list[str], list[dict] | None]:
    """``count`` prompts (repeated if the source has fewer) and their metadata; None without a source."""
    if source is None:
        return [FALLBACK_PROMPTS[i % len(FALLBACK_PROMPTS)] for i in range(count)], None
    prompt_set = ingest(source, s3)
    pool = prompt_set.train + prompt_set.eval
    chosen = [pool[i % len(pool)] for i in range(count)]
    return [p.text for p in chosen], [p.metadata for p in chosen]


def _check_one(
    spec: RewardSpec,
    videos: VideoBatch,
    prompts: list[str],
    metadata: list[dict] | None,
    device: str,
    timeout_s: float | None,
    sensitivity: bool,
) -> list[str]:
    rss_before = _peak_rss_mb()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    clock = time.perf_counter()
    scorer = Scorer([spec], retries=0, timeout_s=timeout_s, max_failed_fraction=0.0)
    scorer.check_metadata(metadata)
    built = time.perf_counter() - clock
    clock = time.perf_counter()
    scorer.setup(device)
    set_up = time.perf_counter() - clock
    first, first_s = _timed(lambda: scorer.score(videos, prompts, metadata))
    second, second_s = _timed(lambda: scorer.score(videos, prompts, metadata))
    if all(value is None for values in second.dimensions.values() for value in values):
        raise UserError(f"reward {spec.name!r} scored none of the {len(videos)} videos (every value None)")
    memory = f"peak RSS {_peak_rss_mb():.0f} MB ({rss_before:.0f} MB before building)"
    if device.startswith("cuda"):
        memory += f"; CUDA peak {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MB"
    lines = [f"reward {spec.name!r}: ok", f"  dimensions  {_dimension_list(second.dimensions, second.weights)}"]
    lines += [f"  {name:<11} {_summary(values)}" for name, values in second.dimensions.items()]
    if first.dimensions != second.dimensions:
        lines.append("  note        the same videos scored differently on the second call (a non-deterministic reward)")
    lines += [
        f"  time        {second_s / len(videos):.4f} s/video (first call {first_s / len(videos):.4f} s/video; "
        f"build {built:.2f} s, setup {set_up:.2f} s)",
        f"  memory      {memory}",
    ]
    if sensitivity:
        lines += sensitivity_lines(
            {name: scorer.score(perturb(videos), prompts, metadata) for name, perturb in PERTURBATIONS.items()}, second
        )
    return lines


# Sensitivity
# ----------------------------------------------------------------------------------------------------------------


def _each(transform: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[VideoBatch], VideoBatch]:
    return lambda videos: VideoBatch([transform(video) for video in videos], videos.fps)


def _at_fps(factor: float) -> Callable[[VideoBatch], VideoBatch]:
    return lambda videos: VideoBatch(list(videos.frames), videos.fps * factor)


def _resized(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def resize(video: torch.Tensor) -> torch.Tensor:
        height, width = (max(1, round(side * factor)) for side in video.shape[1:3])
        channels_first = video.permute(0, 3, 1, 2).float()
        resized = torch.nn.functional.interpolate(channels_first, size=(height, width), mode="bilinear")
        return resized.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()

    return resize


def _exposed(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda video: (video.float() * factor).round().clamp(0, 255).to(torch.uint8)


def _saturated(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Each pixel moved from its grey (BT.601 luma) by ``factor``: 0 is greyscale, 1 unchanged."""

    def saturate(video: torch.Tensor) -> torch.Tensor:
        pixels = video.float()
        grey = (pixels @ pixels.new_tensor(LUMA_WEIGHTS))[..., None]
        return (grey + factor * (pixels - grey)).round().clamp(0, 255).to(torch.uint8)

    return saturate


# name -> the same videos changed in one dimension a generator controls.
PERTURBATIONS: dict[str, Callable[[VideoBatch], VideoBatch]] = {
    "frames x2": _each(lambda video: video.repeat_interleave(2, dim=0)),  # each frame twice: same motion, longer
    "frames /2": _each(lambda video: video[::2]),
    "fps x2": _at_fps(2.0),
    "fps /2": _at_fps(0.5),
    "resolution x2": _each(_resized(2.0)),
    "resolution /2": _each(_resized(0.5)),
    "brightness x1.3": _each(_exposed(1.3)),
    "brightness x0.7": _each(_exposed(0.7)),
    "saturation x1.5": _each(_saturated(1.5)),
    "saturation x0.5": _each(_saturated(0.5)),
}


GAMEABLE_FRACTION = 0.01


def mean_change(perturbed: list[float | None], baseline: list[float | None]) -> float | None:
    """The mean of perturbed - baseline over the videos scored both times; None when there are none."""
    pairs = [(after, before) for after, before in zip(perturbed, baseline) if after is not None and before is not None]
    return sum(after - before for after, before in pairs) / len(pairs) if pairs else None


def sensitivity_lines(perturbed: dict[str, ScoredBatch], baseline: ScoredBatch) -> list[str]:
    """A table: per perturbation the mean change of the total (when the reward weighs anything) and of each
    dimension; then the perturbation that raises the total most, if any does."""
    columns = {"total": baseline.total} if baseline.weights else {}
    columns |= baseline.dimensions
    changes = {
        name: {
            column: mean_change(scored.total if column == "total" else scored.dimensions[column], values)
            for column, values in columns.items()
        }
        for name, scored in perturbed.items()
    }
    width = max(12, *(len(column) + 2 for column in columns))
    header = "".join(f"{column:>{width}}" for column in columns)
    lines = [
        "  sensitivity mean change of each score on the same videos perturbed (none: not scored)",
        f"    {'perturbation':<16}{header}",
    ]
    for name, row in changes.items():
        lines.append(f"    {name:<16}" + "".join(f"{_signed(row[column]):>{width}}" for column in columns))
    if "total" in columns:
        # A rise counts when it exceeds 1% of the total's typical size: float noise (a mean over twice the frames,
        # a resize) moves a score by ~1e-6 and games nothing.
        scored = [abs(value) for value in baseline.total if value is not None]
        floor = GAMEABLE_FRACTION * (sum(scored) / len(scored) if scored else 0.0)
        gains = {name: row["total"] for name, row in changes.items() if (row["total"] or 0.0) > floor}
        if gains:
            worst = max(gains, key=gains.get)
            lines.append(f"  gameable    {worst} raises the total by {gains[worst]:+.4g}")
    return lines


def _signed(value: float | None) -> str:
    return "none" if value is None else f"{value:+.4g}"


def _timed(call):
    clock = time.perf_counter()
    result = call()
    return result, time.perf_counter() - clock


def _dimension_list(dimensions: dict, weights: dict[str, float]) -> str:
    return ", ".join(
        f"{name} (weight {weights[name]:g})" if name in weights else f"{name} (reported, not summed)"
        for name in dimensions
    )


def _summary(values: list[float | None]) -> str:
    present = [value for value in values if value is not None]
    missing = f"{len(values) - len(present)} None" if len(present) < len(values) else "no None"
    if not present:
        return f"every score None ({len(values)})"
    return f"min {min(present):.4g}  mean {sum(present) / len(present):.4g}  max {max(present):.4g}  ({missing})"


def _peak_rss_mb() -> float:
    # ru_maxrss is kilobytes on Linux and bytes on macOS. RSS, unlike tracemalloc, counts tensor memory too.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
