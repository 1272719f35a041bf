"""The reward contract: what a reward receives, what it returns, and how outputs are checked and combined.

A reward is any object with ``__call__(videos: VideoBatch, prompts: list[str]) -> dict[str, list[float | None]]``:
one list per named dimension (``{"VQ": [...], "MQ": [...]}``), one entry per video. ``None`` or NaN means "no score"
for that sample; it is dropped from its GRPO group, never counted as 0. A reward may also define ``setup(device)``
(called once before scoring, to move weights to the accelerator) and ``default_weights`` (used when its config
gives none). Prompt metadata (the prompt file's other columns) arrives as keyword arguments, one list per column
aligned with the videos (None where a prompt lacks the column): a reward names the columns it wants
(``def __call__(self, videos, prompts, style)``; a parameter without a default is a required column) or takes them
all with ``**columns``. This is TRL's reward-function contract, extended to several named dimensions per reward.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from sage_grpo.core.lazy import lazy_module

from ..errors import UserError

torch = lazy_module("torch", globals())

Scores = dict[str, list[float | None]]


@dataclass(frozen=True, eq=False)  # == on lists of tensors is ambiguous; compare frames explicitly
class VideoBatch(Sequence):
    """Decoded videos and their frame rate: ``frames[i]`` is a uint8 tensor [F, H, W, 3] (RGB), on any device.

    It behaves as a list of videos (``len``, indexing, iteration; a slice is again a VideoBatch), so a reward that
    ignores time can treat it as one; rewards that sample frames in seconds read ``fps``.
    """

    frames: list[torch.Tensor]
    fps: float

    def __post_init__(self):
        if self.fps <= 0:
            raise ValueError(f"fps must be > 0, got {self.fps}")
        for index, video in enumerate(self.frames):
            if video.dtype != torch.uint8 or video.ndim != 4 or video.shape[-1] != 3:
                raise ValueError(f"video {index} must be uint8 [F, H, W, 3], got {video.dtype} {list(video.shape)}")

    @classmethod
    def from_tensor(cls, videos: torch.Tensor, fps: float) -> VideoBatch:
        """From a model's decoded batch, uint8 [B, F, H, W, 3]."""
        return cls(list(videos.unbind(0)), fps)

    def __len__(self) -> int:
        return len(self.frames)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return VideoBatch(self.frames[index], self.fps)
        return self.frames[index]


@runtime_checkable
class Reward(Protocol):
    def __call__(self, videos: VideoBatch, prompts: list[str]) -> Scores: ...


class RewardUnavailable(RuntimeError):
    """Raised by a reward that has already retried on its own (the remote reward): score its samples None, now."""


# Per-sample columns keyed by column name, each list aligned with the videos.
Columns = dict[str, list]

# The first two arguments of every reward; a metadata column of the same name cannot be passed as well.
POSITIONAL = ("videos", "prompts")


def metadata_columns(metadata: Sequence[Mapping] | None, batch_size: int) -> Columns:
    """Per-sample metadata dicts as one list per column (TRL's layout), None where a sample lacks the column."""
    if metadata is None:
        return {}
    if len(metadata) != batch_size:
        raise ValueError(f"{len(metadata)} metadata rows for {batch_size} videos")
    names = dict.fromkeys(name for row in metadata for name in row if name not in POSITIONAL)
    return {name: [row.get(name) for row in metadata] for name in names}


@dataclass(frozen=True)
class MetadataParameters:
    """Which metadata columns a reward's ``__call__`` takes: every one (``**kwargs``) or the ones it names.

    ``filled`` are the names of the parameters a call fills by position (``self``, ``videos``, ``prompts`` under
    whatever names the reward gives them): a column by one of these names cannot reach ``**kwargs`` (Python raises
    "got multiple values for argument"), so it is not passed."""

    takes_all: bool
    named: frozenset[str]
    required: frozenset[str]
    filled: frozenset[str] = frozenset()

    @classmethod
    def of(cls, reward) -> MetadataParameters:
        # ``signature`` leaves out a method's instance parameter, yet a keyword by its name collides with it: read
        # the function under the bound method, whose first parameter is that instance.
        method = reward if inspect.ismethod(reward) else reward.__call__
        function, bound = (method.__func__, 1) if inspect.ismethod(method) else (reward, 0)
        try:
            parameters = list(inspect.signature(function).parameters.values())
        except (TypeError, ValueError):  # no introspectable signature (a C callable): the plain contract
            return cls(False, frozenset(), frozenset())
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        keywords = positional[bound + len(POSITIONAL) :] + [p for p in parameters if p.kind == p.KEYWORD_ONLY]
        return cls(
            takes_all=any(p.kind == p.VAR_KEYWORD for p in parameters),
            named=frozenset(p.name for p in keywords),
            required=frozenset(p.name for p in keywords if p.default is p.empty),
            filled=frozenset(
                p.name for p in positional[: bound + len(POSITIONAL)] if p.kind == p.POSITIONAL_OR_KEYWORD
            ),
        )

    def select(self, columns: Columns, reward_name: str) -> Columns:
        """The columns to pass; a required column no prompt has is a one-line UserError naming the reward."""
        missing = sorted(self.required - set(columns))
        if missing:
            have = ", ".join(sorted(columns)) or "none"
            raise UserError(
                f"reward {reward_name!r} needs the prompt column(s) {', '.join(missing)}, which the "
                f"prompts lack (their columns: {have}); use a .jsonl or .csv source with them"
            )
        if self.takes_all:
            return {k: v for k, v in columns.items() if k not in self.filled}
        return {k: v for k, v in columns.items() if k in self.named}


def slice_columns(columns: Columns, start: int, stop: int) -> Columns:
    return {name: values[start:stop] for name, values in columns.items()}


def check_scores(output: object, batch_size: int, reward_name: str) -> Scores:
    """The reward's output as ``{dimension: [float | None]}`` with non-finite values turned into None.

    A wrong type or length is a bug in the reward, not a transient failure: it raises UserError at once, in one line
    that names the reward, instead of being retried or silently scored None.
    """
    if not isinstance(output, Mapping) or not output:
        raise UserError(
            f"reward {reward_name!r} returned {type(output).__name__}, expected a non-empty dict "
            "{dimension: list of float or None}"
        )
    checked = {}
    for dimension, values in output.items():
        if not isinstance(dimension, str):
            raise UserError(f"reward {reward_name!r} returned a dimension named {dimension!r}, expected a string")
        if not isinstance(values, (list, tuple)):
            raise UserError(
                f"reward {reward_name!r} dimension {dimension!r} is a {type(values).__name__}, "
                "expected a list of float or None"
            )
        if len(values) != batch_size:
            raise UserError(
                f"reward {reward_name!r} dimension {dimension!r} has {len(values)} scores for {batch_size} videos"
            )
        checked[dimension] = [_score_value(value, reward_name, dimension) for value in values]
    return checked


def _score_value(value: object, reward_name: str, dimension: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UserError(
            f"reward {reward_name!r} dimension {dimension!r} holds a {type(value).__name__}, expected float or None"
        )
    value = float(value)
    return value if math.isfinite(value) else None


def merge_dimensions(into: Scores, scores: Scores, reward_name: str, owners: dict[str, str]) -> None:
    """Add one reward's dimensions to ``into``; two rewards may not report the same dimension name."""
    for dimension, values in scores.items():
        owner = owners.setdefault(dimension, reward_name)
        if owner != reward_name:
            raise UserError(f"rewards {owner!r} and {reward_name!r} both report dimension {dimension!r}")
        into[dimension] = values


def weighted_total(dimensions: Scores, weights: Mapping[str, float], batch_size: int) -> list[float | None]:
    """Per sample, sum of weight x score over the weighted dimensions; None when any weighted score is None."""
    totals: list[float | None] = []
    for index in range(batch_size):
        terms = [(weight, dimensions[name][index]) for name, weight in weights.items() if weight != 0]
        if any(score is None for _, score in terms):
            totals.append(None)
        else:
            totals.append(sum(weight * score for weight, score in terms))
    return totals


def join_batches(chunks: list[Scores]) -> Scores:
    """Scores of consecutive sub-batches joined in order, dimension by dimension."""
    joined: Scores = {}
    for chunk in chunks:
        for dimension, values in chunk.items():
            joined.setdefault(dimension, []).extend(values)
    return joined
