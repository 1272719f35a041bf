"""Analytic rewards for ToyWorld in the paper's three dimensions, and the on-manifold drift metric.

Every score is in [0, 1] and is 1 on every manifold video of the right caption:
  TA (text alignment): the square's colour and its direction of motion match the caption;
  VQ (visual quality): each frame is one sharp square of the right size (L1 distance to the ideal square);
  MQ (motion quality): frames follow each other by one constant shift, i.e. constant-velocity motion.
The drift metric (RMS pixel distance to the nearest manifold video, of any caption) is reported, never rewarded: it
tells whether GRPO improved the rewards by staying among valid videos or by drifting off them.
"""

from __future__ import annotations

import math

import torch

from sage_grpo.core.rewards.base import Scores, VideoBatch

from . import world

# Setting B of the paper (alignment-focused), the weights GRPO optimises in compare.py.
WEIGHTS = {"VQ": 0.5, "MQ": 0.5, "TA": 1.0}
# Pixels fainter than this (max over RGB) are background for the centroid; brighter than FOREGROUND is the square.
_FAINT, _FOREGROUND = 0.25, 0.5


def _strength(video: torch.Tensor) -> torch.Tensor:
    """uint8 [F, H, W, 3] to per-pixel foreground strength [F, H, W] in [0, 1] (the background is black)."""
    return video.float().div(255).amax(dim=-1)


def _centroids(strength: torch.Tensor) -> torch.Tensor:
    """Per frame, the strength-weighted centre (y, x) of the non-faint pixels; NaN for an empty frame."""
    weights = (strength - _FAINT).clamp(min=0)
    coords = torch.arange(world.SIZE, dtype=torch.float32)
    mass = weights.sum(dim=(1, 2))
    y = (weights.sum(dim=2) * coords).sum(dim=1) / mass
    x = (weights.sum(dim=1) * coords).sum(dim=1) / mass
    return torch.stack([y, x], dim=1)


def _velocity(centroids: torch.Tensor) -> torch.Tensor:
    """Least-squares slope of the centroid track, pixels per frame."""
    t = torch.arange(len(centroids), dtype=torch.float32)
    t = t - t.mean()
    return (t[:, None] * (centroids - centroids.mean(dim=0))).sum(dim=0) / (t**2).sum()


def alignment_parts(
    video: torch.Tensor, caption: str, strength: torch.Tensor, centroids: torch.Tensor
) -> tuple[float, float]:
    """(colour score, direction score): TA's two halves, reported apart because they are learnt at different rates."""
    colour, direction = world.parse_caption(caption)
    pixels = video.float().div(255).reshape(-1, 3)[strength.flatten() > _FOREGROUND]
    if len(pixels) == 0:
        return 0.0, 0.0
    # Palette colours are >= 1 apart in RGB, so a wrong colour scores 0.
    colour_score = max(0.0, 1.0 - float(torch.dist(pixels.mean(dim=0), torch.tensor(world.COLOURS[colour]))))
    expected = torch.tensor(world.DIRECTIONS[direction], dtype=torch.float32)
    # Opposite, perpendicular and no motion all score 0; half the speed scores 0.5.
    direction_score = max(0.0, 1.0 - float(torch.dist(_velocity(centroids), expected) / expected.norm()))
    return colour_score, direction_score


def _ideal_square(centre: torch.Tensor) -> torch.Tensor:
    top_left = (centre - (world.SQUARE - 1) / 2).round().clamp(0, world.SIZE - world.SQUARE).long().tolist()
    square = torch.zeros(world.SIZE, world.SIZE)
    square[top_left[0] : top_left[0] + world.SQUARE, top_left[1] : top_left[1] + world.SQUARE] = 1.0
    return square


def visual_quality(strength: torch.Tensor, centroids: torch.Tensor) -> float:
    """Mean over frames of 1 - L1(frame, ideal square at its centroid) / (2 x square area): blur, ragged edges,
    missing or extra blobs all cost; an empty frame scores 0."""
    scores = []
    for frame, centre in zip(strength, centroids):
        if torch.isnan(centre).any():
            scores.append(0.0)
            continue
        error = float((frame - _ideal_square(centre)).abs().sum()) / (2 * world.SQUARE**2)
        scores.append(max(0.0, 1.0 - error))
    return sum(scores) / len(scores)


def motion_quality(strength: torch.Tensor, centroids: torch.Tensor) -> float:
    """Correlation of each frame with the previous one shifted by the video's own (rounded) velocity, times
    exp(-mean |acceleration|) of the centroid: 1 for rigid constant-velocity motion, about 0 for noise."""
    if torch.isnan(centroids).any():
        return 0.0
    shift = [int(round(float(v))) for v in _velocity(centroids)]
    correlations = []
    for previous, current in zip(strength[:-1], strength[1:]):
        moved = torch.roll(previous, shifts=shift, dims=(0, 1)).flatten()
        current = current.flatten()
        if moved.std() == 0 or current.std() == 0:
            correlations.append(0.0)
        else:
            correlations.append(max(0.0, float(torch.corrcoef(torch.stack([moved, current]))[0, 1])))
    acceleration = (centroids[2:] - 2 * centroids[1:-1] + centroids[:-2]).norm(dim=1).mean()
    return sum(correlations) / len(correlations) * math.exp(-float(acceleration))


class ToyWorldReward:
    """The reward contract of ``core.rewards.base``: {"TA", "VQ", "MQ"} -> one score per video. With ``parts`` the
    scores also hold TA's halves, "colour" and "direction" (unweighted: diagnostics for the benchmark's tables)."""

    default_weights = WEIGHTS

    def __init__(self, parts: bool = False):
        self.parts = parts

    def __call__(self, videos: VideoBatch, prompts: list[str]) -> Scores:
        scores: Scores = {"TA": [], "VQ": [], "MQ": []} | ({"colour": [], "direction": []} if self.parts else {})
        for video, caption in zip(videos, prompts):
            video = video.cpu()
            strength = _strength(video)
            centroids = _centroids(strength)
            colour, direction = alignment_parts(video, caption, strength, centroids)
            scores["TA"].append(0.5 * (colour + direction))
            scores["VQ"].append(visual_quality(strength, centroids))
            scores["MQ"].append(motion_quality(strength, centroids))
            if self.parts:
                scores["colour"].append(colour)
                scores["direction"].append(direction)
        return scores


def manifold_drift(videos: VideoBatch) -> list[float]:
    """RMS pixel distance (in [0, 1] units) from each video to the nearest video of the manifold."""
    valid, _ = world.manifold()
    reference = valid.permute(0, 1, 3, 4, 2).flatten(1)  # [N, F*H*W*3], laid out as VideoBatch frames are
    generated = torch.stack([video.cpu().float().div(255).flatten() for video in videos])
    nearest = torch.cdist(generated, reference).min(dim=1).values
    return (nearest / math.sqrt(reference.shape[1])).tolist()


class GoldJudge:
    """What the caption asks, judged on the video: the square's colour x its motion x a valid video. ``gold`` is the
    product of TA's colour half, the motion score (1 - |velocity - captioned velocity| / |captioned velocity|, 0 when
    static, moving the wrong way or across; half the speed scores 0.5) and VQ (one sharp square of the right size in
    every frame). The proxy (``ToyWorldReward``) averages TA's halves and adds MQ, which a static square satisfies; the
    judge is reported (``weights: {}``), never trained on. ``static`` and ``wrong_way`` (1 or 0 per video) count the
    two hacks: |velocity| below half the captioned speed, and motion against the captioned direction; ``right_way``
    counts the squares moving within 45 degrees of the captioned direction (what gold needs to be learnable)."""

    default_weights: dict[str, float] = {}

    def __call__(self, videos: VideoBatch, prompts: list[str]) -> Scores:
        scores: Scores = {"gold": [], "static": [], "wrong_way": [], "right_way": []}
        for video, caption in zip(videos, prompts):
            video = video.cpu()
            strength = _strength(video)
            centroids = _centroids(strength)
            colour, motion = alignment_parts(video, caption, strength, centroids)
            scores["gold"].append(colour * motion * visual_quality(strength, centroids))
            velocity = _velocity(centroids)
            expected = torch.tensor(world.DIRECTIONS[world.parse_caption(caption)[1]], dtype=torch.float32)
            moving = bool(torch.isfinite(velocity).all()) and float(velocity.norm()) >= 0.5 * float(expected.norm())
            scores["static"].append(float(not moving))
            alignment = float(velocity @ expected) / max(float(velocity.norm() * expected.norm()), 1e-12)
            scores["wrong_way"].append(float(moving and alignment < 0))
            scores["right_way"].append(float(moving and alignment > math.cos(math.pi / 4)))
        return scores
