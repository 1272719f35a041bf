"""GRPO objective: group advantages, the clipped surrogate, Gaussian KL terms, and the adaptive KL weight.

Pure tensor math with no I/O and no global state (``shared/spec/sage-grpo.md`` sections 3 and 4).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum

from sage_grpo.core.lazy import lazy_module

torch = lazy_module("torch", globals())

ADVANTAGE_EPS = 1e-8


@dataclass(frozen=True)
class Advantages:
    """Per-sample advantages; ``valid`` is False for dropped samples and samples of degenerate groups. ``groups``
    counts the prompt groups the samples belong to, ``zero_variance_groups`` those whose scored rewards were all equal:
    every advantage of such a group is 0 (to rounding), so it teaches the policy nothing."""

    values: torch.Tensor
    valid: torch.Tensor
    groups: int
    zero_variance_groups: int


def group_advantages(
    rewards: torch.Tensor | list[float | None],
    group_ids: torch.Tensor | list[int],
    *,
    global_std: bool = False,
    all_rewards: torch.Tensor | list[float | None] | None = None,
    clip: float = 5.0,
) -> Advantages:
    """A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-8), clipped to [-clip, clip].

    A NaN or None reward means "no score": that sample is dropped from its group, never counted as 0. A group with
    fewer than two scored samples has no baseline and contributes nothing. ``global_std`` divides by the std of all
    scored rewards instead of the group's (Dr. GRPO-style variance normalisation across prompts): of ``all_rewards``
    when given (every rank's rewards, gathered by the caller: ``stages.update.compute_advantages``), else of
    ``rewards``. The result is on the CPU; the update moves it to the model's device.
    """
    rewards = _as_rewards(rewards)
    group_ids = torch.as_tensor(group_ids).cpu()
    if rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError(
            f"rewards {list(rewards.shape)} and group ids {list(group_ids.shape)} must be equal 1-D shapes"
        )
    scored = torch.isfinite(rewards)
    values = torch.zeros_like(rewards)
    valid = torch.zeros_like(scored)
    # Population std (unbiased=False) matches the reference and stays defined for groups of two.
    all_scored_std = _scored_std(rewards if all_rewards is None else _as_rewards(all_rewards))
    groups = torch.unique(group_ids)
    zero_variance = 0
    for group in groups:
        members = (group_ids == group) & scored
        if members.sum() < 2:
            continue
        group_rewards = rewards[members]
        # Compared, not read off the advantages: three rewards of 0.1 leave r - mean at 1e-17, not 0.
        zero_variance += bool(group_rewards.min() == group_rewards.max())
        scale = all_scored_std if global_std else group_rewards.std(unbiased=False)
        values[members] = (group_rewards - group_rewards.mean()) / (scale + ADVANTAGE_EPS)
        valid[members] = True
    return Advantages(
        values=values.clamp(-clip, clip).to(torch.float32),
        valid=valid,
        groups=len(groups),
        zero_variance_groups=zero_variance,
    )


def _as_rewards(rewards) -> torch.Tensor:
    if isinstance(rewards, list):
        return torch.tensor([float("nan") if r is None else float(r) for r in rewards], dtype=torch.float64)
    return rewards.detach().cpu().to(torch.float64)


def _scored_std(rewards: torch.Tensor) -> torch.Tensor:
    scored = rewards[torch.isfinite(rewards)]
    return scored.std(unbiased=False) if len(scored) > 1 else torch.tensor(0.0, dtype=torch.float64)


@dataclass(frozen=True)
class SurrogateTerms:
    loss: torch.Tensor  # per element, already weighted by the equalizer
    ratio: torch.Tensor
    clipped: torch.Tensor  # bool: the clipped branch was active


def clipped_surrogate(
    log_prob_new: torch.Tensor,
    log_prob_old: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    weights: torch.Tensor | float = 1.0,
) -> SurrogateTerms:
    """PPO's clipped surrogate max(-A r, -A clip(r, 1-eps, 1+eps)), times the per-timestep weight S_t."""
    ratio = torch.exp(log_prob_new.float() - log_prob_old.float())
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped)
    return SurrogateTerms(loss=loss * weights, ratio=ratio, clipped=clipped > unclipped)


def gaussian_mean_kl(mean: torch.Tensor, reference_mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """KL between Gaussians sharing variance std^2: mean over non-batch elements of ||dmu||^2, over 2 std^2."""
    squared = (mean.float() - reference_mean.float()).pow(2).flatten(1).mean(dim=1)
    std = torch.as_tensor(std, dtype=squared.dtype, device=squared.device).flatten()
    return squared / (2.0 * std**2)


def stepwise_kl(log_prob_old: torch.Tensor, log_prob_new: torch.Tensor) -> torch.Tensor:
    """Estimate of KL(pi_old || pi_theta) from the rollout's own samples: mean(logp_old - logp_new)."""
    return (log_prob_old.float() - log_prob_new.float()).mean()


# ----------------------------------------------------------------------------------------------------------------
# Adaptive KL weight
# ----------------------------------------------------------------------------------------------------------------


class KLFeedback(str, Enum):
    """What lambda_KL is steered by.

    ``gradient_ratio`` (the ``calibrated`` preset): the measured update-level ratio |lambda grad KL| / |grad policy|
    is held at a target (``GradientRatioController``), a quantity every run reaches. The other two steer by the KL
    itself against a fixed target (``AdaptiveKLController``): ``toward_target`` tightens the constraint when KL is
    high (x1.1) and relaxes it when low (x0.9), as the paper says it intends; ``as_written`` is the paper's appendix
    read literally (x0.9 when KL is high, x1.1 when low), kept so its results can be reproduced. A fixed KL target
    the run never reaches pins lambda at a bound: measured, the toy world's and the demo's KL peak ~20x below 1e-3.
    """

    GRADIENT_RATIO = "gradient_ratio"
    TOWARD_TARGET = "toward_target"
    AS_WRITTEN = "as_written"


class _KLWeight:
    """What a KL-weight controller checkpoints: its update count, lambda, its window of measurements and its
    ``strength``, the factor :meth:`tighten` (the hacking guard, ``stages/evaluate.py``) has multiplied lambda's bounds
    and its target pull by."""

    steps: int
    value: float
    measurements: deque[float]
    strength: float = 1.0

    def tighten(self, factor: float) -> None:
        """A stronger trust region from now on: lambda and its bounds x ``factor``, and a target that asks for
        ``factor`` times the pull (each controller's ``update`` reads ``strength``)."""
        if not factor > 1:
            raise ValueError(f"a tightening factor must be > 1, got {factor}")
        self.strength *= factor
        self.value *= factor

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "value": self.value,
            "measurements": list(self.measurements),
            "strength": self.strength,
        }

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.value = float(state["value"])
        self.strength = float(state["strength"])
        self.measurements.clear()
        self.measurements.extend(float(m) for m in state["measurements"])


class AdaptiveKLController(_KLWeight):
    """lambda_KL: linear warm-up from ``initial`` to ``maximum`` over ``warmup_steps`` updates, then feedback
    (from ``initial`` when there is no warm-up).

    After warm-up, each update compares D (the mean of the last ``history`` measured KL values) with the target and
    scales lambda by 1.1 or 0.9 when D leaves [0.5, 1.5] x target; lambda always stays in [initial, maximum].
    """

    def __init__(
        self,
        *,
        initial: float = 1e-7,
        maximum: float = 1e-5,
        warmup_steps: int = 100,
        history: int = 10,
        target: float = 1e-5,
        feedback: KLFeedback | str = KLFeedback.TOWARD_TARGET,
        up: float = 1.1,
        down: float = 0.9,
    ):
        if not 0 < initial <= maximum:
            raise ValueError(f"need 0 < initial <= maximum, got {initial}, {maximum}")
        if warmup_steps < 0 or history < 1:
            raise ValueError("warmup_steps must be >= 0 and history >= 1")
        self.initial, self.maximum, self.target = initial, maximum, target
        self.warmup_steps, self.up, self.down = warmup_steps, up, down
        self.feedback = KLFeedback(feedback)
        self.steps = 0
        self.value = initial  # warm-up starts here; without warm-up, feedback starts here
        self.measurements: deque[float] = deque(maxlen=history)

    def update(self, measured_kl: float, measured_ratio: float | None = None, **learning_rates: float) -> float:
        """Record one optimizer step's KL and return the weight to use for the next step (the gradient ratio and the
        learning rates are not this controller's signals)."""
        self.measurements.append(float(measured_kl))
        self.steps += 1
        # Tightened: lambda's range x strength, and a KL target strength times smaller.
        initial, maximum = self.initial * self.strength, self.maximum * self.strength
        target = self.target / self.strength
        if self.steps <= self.warmup_steps:
            self.value = initial + (maximum - initial) * self.steps / self.warmup_steps
            return self.value
        recent = sum(self.measurements) / len(self.measurements)
        high, low = recent > 1.5 * target, recent < 0.5 * target
        if self.feedback is KLFeedback.TOWARD_TARGET:
            factor = self.up if high else self.down if low else 1.0
        else:
            factor = self.down if high else self.up if low else 1.0
        self.value = min(max(self.value * factor, initial), maximum)
        return self.value


class GradientRatioController(_KLWeight):
    """lambda_KL holding the update-level gradient ratio r = |lambda grad KL| / |grad policy| at ``target``.

    For one update r is exactly proportional to lambda, so each measured update gives lambda's gain g = r / lambda.
    The next lambda is target / (geometric mean of the last ``history`` gains), clipped to [``minimum``, ``maximum``].
    An update without a measurement (None: a KL reference was just refreshed, so the KL and its gradient are 0 and
    say nothing about strength) leaves lambda as it is; so does a measured ratio of 0 (no KL gradient to scale).

    The gain grows with how far the weights may be from the KL reference, which the learning rate sets. Given ``lr``
    (the learning rate of the step before the measured update), each gain is taken per unit of learning rate, and
    lambda is set for the next update's ``next_lr``: an lr warm-up or decay moves lambda as 1 / lr at once instead of
    through the window's lag. At a constant lr both cancel: the gain per update.
    """

    def __init__(self, *, initial: float, minimum: float, maximum: float, target: float, history: int):
        if not 0 < minimum <= initial <= maximum:
            raise ValueError(f"need 0 < minimum <= initial <= maximum, got {minimum}, {initial}, {maximum}")
        if target <= 0 or history < 1:
            raise ValueError(f"need target > 0 and history >= 1, got {target}, {history}")
        self.minimum, self.maximum, self.target = minimum, maximum, target
        self.steps = 0
        self.value = initial
        self.measurements: deque[float] = deque(maxlen=history)  # log gains

    def update(
        self, measured_kl: float, measured_ratio: float | None = None, *, lr: float = 1.0, next_lr: float = 1.0
    ) -> float:
        """Record one optimizer update's gradient ratio (measured at the current lambda, after a step at ``lr``) and
        return the lambda for the next update (after a step at ``next_lr``)."""
        self.steps += 1
        if measured_ratio is not None and measured_ratio > 0 and math.isfinite(measured_ratio) and lr > 0:
            self.measurements.append(math.log(measured_ratio / (self.value * lr)))
        if not (self.measurements and next_lr > 0):
            return self.value
        mean_log_gain = sum(self.measurements) / len(self.measurements) + math.log(next_lr)
        # Tightened: the ratio held, and lambda's range, x strength.
        wanted = self.target * self.strength / math.exp(mean_log_gain)
        self.value = min(max(wanted, self.minimum * self.strength), self.maximum * self.strength)
        return self.value
