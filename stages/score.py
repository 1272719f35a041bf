"""Scoring stage: rewards for a batch of rollout videos, every dimension reported, one weighted total per video.

Recipe, per reward in the config:
1. call it on the videos in sub-batches of its ``batch_size``;
2. a sub-batch whose call raises is retried ``retries`` times, then its samples are scored None and the failure is
   counted (a flaky reward server must not stop a multi-day run, and must not score 0: None drops the sample
   from its GRPO group);
3. an output of the wrong type or length is a bug in the reward: a one-line UserError naming it, at once.
Then total = sum over rewards and their weighted dimensions of weight x score; a sample missing any weighted score,
or whose reward failed, has total None. ``score_async`` runs the same in a worker thread, so scoring one rollout
batch can overlap generating the next.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from core.errors import UserError
from core.rewards import RewardSpec, RewardUnavailable, Scores, VideoBatch, build_reward, check_scores
from core.rewards.base import merge_dimensions, weighted_total

logger = logging.getLogger(__name__)


@dataclass
class ScoredBatch:
    """Scores for one batch: ``total`` feeds ``group_advantages``; ``dimensions`` are logged one by one.

    ``failed`` counts, per reward, the samples scored None because the reward kept failing.
    """

    total: list[float | None]
    dimensions: Scores
    failed: dict[str, int] = field(default_factory=dict)


class Scorer:
    """Runs the configured rewards; ``failures`` counts failed samples per reward over the scorer's life."""

    def __init__(self, specs: list[RewardSpec], *, retries: int = 2, retry_delay_s: float = 1.0):
        self.rewards = [(spec, build_reward(spec)) for spec in specs]
        self.retries, self.retry_delay_s = retries, retry_delay_s
        self.failures: Counter[str] = Counter()
        # Dimensions each reward reported before: a failed call still reports them, as None.
        self._known_dimensions: dict[str, set[str]] = {spec.name: set() for spec in specs}
        self._executor: ThreadPoolExecutor | None = None

    def setup(self, device) -> None:
        for _, reward in self.rewards:
            if hasattr(reward, "setup"):
                reward.setup(device)

    def score(self, videos: VideoBatch, prompts: list[str]) -> ScoredBatch:
        if len(videos) != len(prompts):
            raise ValueError(f"{len(videos)} videos for {len(prompts)} prompts")
        dimensions: Scores = {}
        owners: dict[str, str] = {}
        weights: dict[str, float] = {}
        failed_samples = [False] * len(videos)
        failed_counts: dict[str, int] = {}
        for spec, reward in self.rewards:
            declared = self._declared_weights(spec, reward)
            scores, failed = self._score_reward(spec, reward, videos, prompts, declared)
            merge_dimensions(dimensions, scores, spec.name, owners)
            weights.update(declared if declared is not None else dict.fromkeys(scores, 1.0))
            failed_samples = [a or b for a, b in zip(failed_samples, failed)]
            if any(failed):
                failed_counts[spec.name] = sum(failed)
                self.failures[spec.name] += sum(failed)
        total = weighted_total(dimensions, weights, len(videos))
        total = [None if failed else value for value, failed in zip(total, failed_samples)]
        return ScoredBatch(total=total, dimensions=dimensions, failed=failed_counts)

    def score_async(self, videos: VideoBatch, prompts: list[str]) -> Future:
        """``score`` in a single background thread (calls run one after another); returns a Future[ScoredBatch]."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scorer")
        return self._executor.submit(self.score, videos, prompts)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _score_reward(self, spec: RewardSpec, reward, videos: VideoBatch, prompts: list[str],
                      declared: dict[str, float] | None) -> tuple[Scores, list[bool]]:
        """One reward over the batch in sub-batches; failed sub-batches are None in every known dimension."""
        size = spec.batch_size or len(videos)
        chunks = [(start, self._call_with_retries(spec.name, reward, videos[start:start + size],
                                                  prompts[start:start + size]))
                  for start in range(0, len(videos), size)]
        known = self._known_dimensions[spec.name]
        for _, chunk in chunks:
            if chunk is not None:
                self._check_weighted_dimensions(spec.name, declared or {}, chunk)
                known.update(chunk)
        known.update(declared or {})
        scores: Scores = {dimension: [None] * len(videos) for dimension in known}
        failed = [False] * len(videos)
        for start, chunk in chunks:
            stop = min(start + size, len(videos))
            if chunk is None:
                failed[start:stop] = [True] * (stop - start)
                continue
            for dimension, values in chunk.items():
                scores[dimension][start:stop] = values
        return scores, failed

    def _call_with_retries(self, name: str, reward, videos: VideoBatch, prompts: list[str]) -> Scores | None:
        attempt = 0
        while True:
            try:
                return check_scores(reward(videos, prompts), len(videos), name)
            except UserError:
                raise
            except RewardUnavailable as error:  # it already retried on its own: do not multiply the retries
                logger.warning("reward %r unavailable, scoring %d samples None: %s", name, len(videos), error)
                return None
            except Exception as error:
                attempt += 1
                if attempt > self.retries:
                    logger.warning("reward %r failed %d times, scoring %d samples None: %s",
                                   name, attempt, len(videos), error)
                    return None
                logger.warning("reward %r failed (attempt %d of %d), retrying: %s",
                               name, attempt, self.retries + 1, error)
                time.sleep(self.retry_delay_s)

    @staticmethod
    def _declared_weights(spec: RewardSpec, reward) -> dict[str, float] | None:
        """The spec's weights, else the reward's ``default_weights``; None means 1 on every reported dimension."""
        weights = spec.explicit_weights()
        return weights if weights is not None else getattr(reward, "default_weights", None)

    @staticmethod
    def _check_weighted_dimensions(name: str, weights: dict[str, float], scores: Scores) -> None:
        unknown = sorted(set(weights) - set(scores))
        if unknown:
            raise UserError(f"reward {name!r} has no dimension(s) {', '.join(unknown)} to weight "
                            f"(it reports {', '.join(sorted(scores))})")
