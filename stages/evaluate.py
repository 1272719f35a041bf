"""Stage 6, evaluation: held-out prompts, fixed seeds, deterministic sampling, every reward dimension and the
independent metrics; sample videos and a reward-curve plot as files for the tracker.

Recipe: sample each held-out prompt once with the ODE sampler (the same seeds every time, so evaluations are
comparable across iterations and runs) -> score with the training rewards and the extra metrics -> write a few
videos (MP4 where an encoder is installed, else GIF) -> return the mean of every dimension.

Every rank runs the same sampling (under ZeRO-3 a forward is a collective, so all ranks must take part);
scoring and writing happen where ``write`` is true (rank 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from core.rewards.base import VideoBatch
from core.rewards.registry import RewardSpec
from stages.rollout import SDEConfig, generate
from stages.score import Scorer


class EvalConfig(BaseModel):
    """The ``eval`` section: every k iterations, the first ``num_prompts`` held-out prompts, fixed seeds."""

    model_config = ConfigDict(extra="forbid")

    every: int = Field(0, ge=0)               # iterations between evaluations; 0 disables
    num_prompts: int = Field(4, ge=1)
    seed: int = Field(1234, ge=0, lt=2**63)
    metrics: list[RewardSpec] = Field(default_factory=list)   # extra metrics (e.g. clipscore) beside the rewards
    write_videos: int = Field(2, ge=0)


@dataclass
class Evaluation:
    metrics: dict[str, float]
    videos: list[Path] = field(default_factory=list)


def evaluate(adapter, prompts: list[str], sde_config: SDEConfig, scorer: Scorer, *, seed: int, out_dir: Path,
             batch_size: int, write_videos: int, write: bool, embeddings=None,
             prompt_metadata: list[dict] | None = None) -> Evaluation:
    """``prompt_metadata``: each prompt's extra columns, passed to the rewards that take them (one video per prompt)."""
    deterministic = SDEConfig(variant="ode", steps=sde_config.steps, shift=sde_config.shift)
    rollout = generate(adapter, prompts, 1, deterministic, seed, batch_size=batch_size, progress=False,
                       embeddings=embeddings)
    if not write:
        return Evaluation(metrics={})
    videos = VideoBatch.from_tensor(rollout.videos, adapter.fps)
    scored = scorer.score(videos, rollout.sample_prompts, prompt_metadata)
    metrics = {f"eval/{name}": _mean(values) for name, values in scored.dimensions.items()}
    metrics["eval/reward"] = _mean(scored.total)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [write_video(rollout.videos[i], adapter.fps, out_dir / f"eval_{i:02d}") for i in
               range(min(write_videos, len(prompts)))]
    return Evaluation(metrics=metrics, videos=written)


def _mean(values: list[float | None]) -> float:
    scored = [v for v in values if v is not None and not math.isnan(v)]
    return sum(scored) / len(scored) if scored else float("nan")


def write_video(frames: torch.Tensor, fps: int, stem: Path) -> Path:
    """uint8 [F, H, W, 3] to ``stem.mp4`` when imageio has an ffmpeg backend, else ``stem.gif``."""
    import imageio.v3 as iio

    array = frames.cpu().numpy()
    try:
        path = stem.with_suffix(".mp4")
        iio.imwrite(path, array, fps=fps, codec="libx264")
    except Exception:  # no ffmpeg plugin installed: GIF needs only Pillow
        path = stem.with_suffix(".gif")
        iio.imwrite(path, array, duration=1000 / fps, loop=0)
    return path


def plot_reward_curves(history: list[dict[str, float]], path: Path) -> Path:
    """Training reward (mean per iteration) and every eval/* metric against the iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    iterations = [h["iteration"] for h in history]
    keys = ["reward/mean"] + sorted({k for h in history for k in h if k.startswith("eval/")})
    for key in keys:
        points = [(i, h[key]) for i, h in zip(iterations, history) if key in h and not math.isnan(h[key])]
        if points:
            ax.plot(*zip(*points), marker="o", label=key)
    ax.set(xlabel="iteration", ylabel="reward", title="reward over training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
