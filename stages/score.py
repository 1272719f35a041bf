"""Stage 3, scoring: rewards for a batch of rollout videos, every dimension reported, one weighted total per video.

Recipe, per reward in the config:
1. call it on the videos in sub-batches of its ``batch_size``, with the prompts and the prompt metadata columns it
   takes as keyword arguments, in a worker thread bounded by ``timeout_s`` (a reward that never returns is
   abandoned, not waited on forever);
2. a sub-batch whose call raises or times out is retried ``retries`` times, then its samples are scored None and the
   failure is counted (a flaky reward server must not stop a multi-day run, and must not score 0: None drops the
   sample from its GRPO group); a reward that exits (``SystemExit``, any ``BaseException`` but Ctrl-C) fails its
   samples at once instead of ending the run;
3. an output of the wrong type or length is a bug in the reward: a one-line UserError naming it, at once;
4. a reward that failed for more than ``max_failed_fraction`` of the batch stops the run (``RewardFailure``):
   a run that trains on a handful of surviving samples, or on none, must not end "completed".
Then total = sum over rewards and their weighted dimensions of weight x score (``RewardSpec.effective_weights``);
a sample missing any weighted score, or whose reward failed, has total None. ``Scorer.overlapped`` runs the same
per rollout batch in a worker thread while the next batch is generated (``generate(..., on_batch=sink.submit)``),
and assembles the same ScoredBatch once every batch is in.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sage_grpo.core import distributed
from sage_grpo.core.distributed import ParallelLayout
from sage_grpo.core.errors import UserError, first_line
from sage_grpo.core.lazy import lazy_module
from sage_grpo.core.rewards import RewardSpec, RewardUnavailable, Scores, VideoBatch, build_reward, check_scores
from sage_grpo.core.rewards.base import (
    Columns,
    MetadataParameters,
    merge_dimensions,
    metadata_columns,
    slice_columns,
    weighted_total,
)

torch = lazy_module("torch", globals())

logger = logging.getLogger(__name__)


class ScoringConfig(BaseModel):
    """How reward calls are bounded, retried and given up on (the ``scoring`` section)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    retries: int = Field(2, ge=0)  # retries of a reward call that raised or timed out
    retry_delay_s: float = Field(1.0, ge=0, allow_inf_nan=False)
    timeout_s: float | None = Field(600.0, gt=0, allow_inf_nan=False)  # per call; None: wait forever
    max_failed_fraction: float = Field(0.5, ge=0, le=1)  # of a batch's samples, per reward, before the run stops


class RewardFailure(UserError):
    """A reward failed for more samples of one batch than ``scoring.max_failed_fraction`` allows."""


class RewardTimeout(TimeoutError):
    """A reward call did not return within ``scoring.timeout_s``."""


@dataclass
class ScoredBatch:
    """Scores for one batch: ``total`` feeds ``group_advantages``; ``dimensions`` are logged one by one.

    ``failed`` counts, per reward, the samples scored None because the reward kept failing; ``weights`` are the
    weights the total used, per dimension (unweighted dimensions are absent).
    """

    total: list[float | None]
    dimensions: Scores
    failed: dict[str, int] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)


@dataclass
class _Attempt:
    """One reward's outcome on one sub-batch: its checked scores, or the error that made it fail."""

    scores: Scores | None
    error: str = ""


class Scorer:
    """Runs the configured rewards; ``failures`` counts failed samples per reward over the scorer's life, and
    ``last_scored`` is the last ScoredBatch it assembled (``score``, or an overlapped ``result``): ``sagegrpo
    preflight`` pairs a training iteration's totals with the same batch re-sampled after its update.

    ``scoring`` holds ``ScoringConfig``'s fields (``Scorer(specs, **config.scoring.model_dump())``).
    """

    def __init__(self, specs: list[RewardSpec], **scoring: Any):
        self.config = ScoringConfig(**scoring)
        self.rewards = [(spec, build_reward(spec)) for spec in specs]
        self._parameters = {spec.name: MetadataParameters.of(reward) for spec, reward in self.rewards}
        self.failures: Counter[str] = Counter()
        # Dimensions each reward reported before, in its order: a failed call still reports them, as None.
        self._known_dimensions: dict[str, dict[str, None]] = {spec.name: {} for spec in specs}
        self.last_scored: ScoredBatch | None = None

    def setup(self, device) -> None:
        for _, reward in self.rewards:
            if hasattr(reward, "setup"):
                reward.setup(device)

    def check_metadata(self, metadata: Sequence[Mapping] | None) -> None:
        """A one-line UserError when a reward requires a prompt column none of ``metadata``'s rows has: call it
        with the prompt set's metadata right after ingest, before any model loads."""
        columns = metadata_columns(metadata, len(metadata or []))
        for spec, _ in self.rewards:
            self._parameters[spec.name].select(columns, spec.name)

    def score(self, videos: VideoBatch, prompts: list[str], metadata: Sequence[Mapping] | None = None) -> ScoredBatch:
        """``metadata``: one dict per video (its prompt's other columns), passed to the rewards that take them."""
        if len(videos) != len(prompts):
            raise ValueError(f"{len(videos)} videos for {len(prompts)} prompts")
        columns = metadata_columns(metadata, len(videos))
        return self._assemble(self._attempts(videos, prompts, columns, list(range(len(videos)))), len(videos))

    @contextmanager
    def overlapped(self, prompts: list[str], metadata: Sequence[Mapping] | None = None, *, fps: int):
        """Score a batch's videos while the next batch is generated: yields an ``OverlappedScoring`` whose
        ``submit(videos, index)`` queues the uint8 videos [b, F, H, W, 3] of samples ``index`` (positions in
        ``prompts``, one prompt per sample) for a worker thread, and whose ``result()`` waits for every submitted
        batch and returns the ScoredBatch ``score`` would return for all samples at once. Reward calls run one
        after another in submission order; on an error inside the block, queued batches are dropped."""
        sink = OverlappedScoring(self, prompts, metadata_columns(metadata, len(prompts)), fps)
        try:
            yield sink
        finally:
            sink.close()

    def _attempts(
        self, videos: VideoBatch, prompts: list[str], columns: Columns, index: list[int]
    ) -> dict[str, list[tuple[list[int], _Attempt]]]:
        """Every reward on these samples, in sub-batches of its ``batch_size``: per reward, (sample positions,
        attempt) pairs. ``index`` gives the samples' positions in the whole batch the result is assembled for."""
        attempts = {}
        for spec, reward in self.rewards:
            selected = self._parameters[spec.name].select(columns, spec.name)
            size = spec.batch_size or len(videos)
            attempts[spec.name] = [
                (
                    index[start : start + size],
                    self._call_with_retries(
                        spec.name,
                        reward,
                        videos[start : start + size],
                        prompts[start : start + size],
                        slice_columns(selected, start, start + size),
                    ),
                )
                for start in range(0, len(videos), size)
            ]
        return attempts

    def _assemble(self, attempts: dict[str, list[tuple[list[int], _Attempt]]], size: int) -> ScoredBatch:
        """The ScoredBatch of ``size`` samples from every reward's attempts (which may have come in any order)."""
        dimensions: Scores = {}
        owners: dict[str, str] = {}
        weights: dict[str, float] = {}
        failed_samples = [False] * size
        failed_counts: dict[str, int] = {}
        for spec, reward in self.rewards:
            scores, failed, reward_weights = self._reward_scores(spec, reward, attempts[spec.name], size)
            merge_dimensions(dimensions, scores, spec.name, owners)
            weights.update(reward_weights)
            failed_samples = [a or b for a, b in zip(failed_samples, failed)]
            if any(failed):
                failed_counts[spec.name] = sum(failed)
                self.failures[spec.name] += sum(failed)
        total = weighted_total(dimensions, weights, size)
        total = [None if failed else value for value, failed in zip(total, failed_samples)]
        self.last_scored = ScoredBatch(
            total=total,
            dimensions=dimensions,
            failed=failed_counts,
            weights={name: weight for name, weight in weights.items() if weight != 0},
        )
        return self.last_scored

    def _reward_scores(
        self, spec: RewardSpec, reward, attempts: list[tuple[list[int], _Attempt]], size: int
    ) -> tuple[Scores, list[bool], dict[str, float]]:
        """One reward's scores from its attempts; failed sub-batches are None in every known dimension."""
        known = self._known_dimensions[spec.name]
        for _, attempt in attempts:
            known.update(dict.fromkeys(attempt.scores or {}))
        weights = spec.effective_weights(reward, known)
        for _, attempt in attempts:
            if attempt.scores is not None:
                self._check_weighted_dimensions(spec.name, weights, attempt.scores)
        known.update(dict.fromkeys(weights))
        scores: Scores = {dimension: [None] * size for dimension in known}
        failed = [False] * size
        for index, attempt in attempts:
            for position, sample in enumerate(index):
                if attempt.scores is None:
                    failed[sample] = True
                    continue
                for dimension, values in attempt.scores.items():
                    scores[dimension][sample] = values[position]
        self._check_failed_fraction(spec.name, failed, [a.error for _, a in attempts if a.error])
        return scores, failed, weights

    def _check_failed_fraction(self, name: str, failed: list[bool], errors: list[str]) -> None:
        fraction = sum(failed) / len(failed) if failed else 0.0
        if fraction > self.config.max_failed_fraction:
            raise RewardFailure(
                f"reward {name!r} failed for {sum(failed)} of {len(failed)} samples, more than "
                f"scoring.max_failed_fraction={self.config.max_failed_fraction:g}; last error: "
                f"{errors[-1]}"
            )

    def _call_with_retries(
        self, name: str, reward, videos: VideoBatch, prompts: list[str], columns: Columns
    ) -> _Attempt:
        attempt = 0
        while True:
            try:
                return _Attempt(
                    check_scores(self._call_bounded(name, reward, videos, prompts, columns), len(videos), name)
                )
            except UserError:
                raise
            except RewardUnavailable as error:  # it already retried on its own: do not multiply the retries
                logger.warning("reward %r unavailable, scoring %d samples None: %s", name, len(videos), error)
                return _Attempt(None, first_line(error, with_type=True))
            except Exception as error:
                attempt += 1
                if attempt > self.config.retries:
                    logger.warning(
                        "reward %r failed %d times, scoring %d samples None: %s",
                        name,
                        attempt,
                        len(videos),
                        first_line(error, with_type=True),
                    )
                    return _Attempt(None, first_line(error, with_type=True))
                logger.warning(
                    "reward %r failed (attempt %d of %d), retrying: %s",
                    name,
                    attempt,
                    self.config.retries + 1,
                    first_line(error, with_type=True),
                )
                time.sleep(self.config.retry_delay_s)
            except KeyboardInterrupt:
                raise
            except BaseException as error:  # sys.exit in a reward: its samples fail, the run goes on
                logger.warning(
                    "reward %r raised %s, scoring %d samples None (a reward must not exit the run)",
                    name,
                    first_line(error, with_type=True),
                    len(videos),
                )
                return _Attempt(None, first_line(error, with_type=True))

    def _call_bounded(self, name: str, reward, videos: VideoBatch, prompts: list[str], columns: Columns):
        """The reward's output, from a daemon worker thread waited on for at most ``timeout_s``.

        Python cannot kill a thread: a call that times out is abandoned (it may finish later, its result unread),
        and a daemon thread never blocks the process from exiting. The worker inherits the caller's CUDA device
        and grad mode, which are per thread in PyTorch, so the call behaves as if made inline.
        """
        if self.config.timeout_s is None:
            return reward(videos, prompts, **columns)
        outcome: dict[str, Any] = {}
        done = threading.Event()
        call = in_this_threads_state(reward)

        def work() -> None:
            try:
                outcome["value"] = call(videos, prompts, **columns)
            except BaseException as error:  # handed to the caller, which decides what it means
                outcome["error"] = error
            finally:
                done.set()

        threading.Thread(target=work, name=f"reward {name}", daemon=True).start()
        if not done.wait(self.config.timeout_s):
            logger.warning(
                "reward %r did not return within scoring.timeout_s=%g s; abandoning its call (its "
                "thread keeps running in the background)",
                name,
                self.config.timeout_s,
            )
            raise RewardTimeout(f"no result within {self.config.timeout_s:g} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    @staticmethod
    def _check_weighted_dimensions(name: str, weights: dict[str, float], scores: Scores) -> None:
        unknown = sorted(set(weights) - set(scores))
        if unknown:
            raise UserError(
                f"reward {name!r} has no dimension(s) {', '.join(unknown)} to weight "
                f"(it reports {', '.join(sorted(scores))})"
            )


class OverlappedScoring:
    """The sink of ``Scorer.overlapped``: batches scored in one worker thread while the caller goes on."""

    def __init__(self, scorer: Scorer, prompts: list[str], columns: Columns, fps: int):
        self.scorer, self.prompts, self.columns, self.fps = scorer, list(prompts), columns, fps
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scorer")
        # The thread that opened the sink is the one the calls must look made from (generate, which calls submit,
        # runs under no_grad).
        self._score = in_this_threads_state(scorer._attempts)
        self._jobs: list[Future] = []
        self._submitted: set[int] = set()

    def submit(self, videos: torch.Tensor, index: torch.Tensor | Sequence[int]) -> None:
        """Queue the uint8 videos [b, F, H, W, 3] of samples ``index``; returns at once."""
        index = [int(i) for i in index]
        if len(index) != len(videos):
            raise ValueError(f"{len(videos)} videos for {len(index)} sample indices")
        if self._submitted.intersection(index) or not all(0 <= i < len(self.prompts) for i in index):
            raise ValueError(f"sample indices {index} repeat a submitted one or lie outside 0..{len(self.prompts) - 1}")
        self._submitted.update(index)
        batch = VideoBatch.from_tensor(videos, self.fps)
        prompts = [self.prompts[i] for i in index]
        columns = {name: [values[i] for i in index] for name, values in self.columns.items()}
        self._jobs.append(self._executor.submit(self._score, batch, prompts, columns, index))

    def result(self, across=None) -> ScoredBatch:
        """Waits for every submitted batch; a reward's error (a wrong output, too many failures) is raised here.

        ``across``: where each of several ranks scored a share of the samples (the K ranks of a sequence-parallel
        group, ``ParallelLayout.across_sequence_group``), the collective that hands every rank all of their shares:
        each assembles the same ScoredBatch, as one rank scoring every sample would."""
        shares = [self._scored_here()] if across is None else across(self._scored_here)
        submitted = sorted(i for share in shares for i in share["submitted"])
        if submitted != list(range(len(self.prompts))):
            raise ValueError(f"{len(submitted)} of {len(self.prompts)} samples were submitted for scoring")
        attempts: dict[str, list] = {spec.name: [] for spec, _ in self.scorer.rewards}
        for share in shares:
            for name, pairs in share["attempts"].items():
                attempts[name].extend(pairs)
        return self.scorer._assemble(attempts, len(self.prompts))

    def _scored_here(self) -> dict:
        """The samples submitted here and every reward's attempts on them, once all are scored."""
        attempts: dict[str, list] = {}
        for job in self._jobs:
            for name, pairs in job.result().items():
                attempts.setdefault(name, []).extend(pairs)
        return {"submitted": sorted(self._submitted), "attempts": attempts}

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def in_this_threads_state(function):
    """``function`` wrapped to run, in any thread, under the calling thread's grad mode and CUDA device (both are
    per thread in PyTorch), so a call made in a worker behaves as if made inline."""
    grad_enabled = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def call(*args, **kwargs):
        if device is not None:
            torch.cuda.set_device(device)
        with torch.set_grad_enabled(grad_enabled):
            return function(*args, **kwargs)

    return call


def reward_metrics(scored: ScoredBatch, parallel: ParallelLayout | None = None) -> dict[str, float]:
    """Mean and std of the total and of every dimension over all ranks' samples; missing scores are left out.
    ``parallel``: the run's layout (plain data parallelism over this process's world when left out)."""
    sums = {}
    for name, values in [("reward", scored.total)] + [(f"reward/{k}", v) for k, v in scored.dimensions.items()]:
        present = [v for v in values if v is not None and not math.isnan(v)]
        sums[f"{name}|n"] = len(present)
        sums[f"{name}|s"] = sum(present)
        sums[f"{name}|ss"] = sum(v * v for v in present)
    sums["failed|n"] = sum(scored.failed.values())
    means = distributed.all_reduce_mean(sums)  # equal factors on every key: ratios of means are ratios of sums
    metrics = {"reward/failed_samples": means["failed|n"] * (parallel or ParallelLayout.build()).data_parallel_size}
    for key in {k.split("|")[0] for k in sums if k != "failed|n"}:
        n = means[f"{key}|n"]
        mean = means[f"{key}|s"] / n if n else float("nan")
        variance = means[f"{key}|ss"] / n - mean**2 if n else float("nan")
        name = "reward/mean" if key == "reward" else f"{key}/mean"
        metrics[name] = mean
        metrics[name.replace("/mean", "/std")] = math.sqrt(max(variance, 0.0)) if n else float("nan")
    return metrics
