"""Reward configuration (``RewardSpec``) and the registry that builds a reward from it.

Built-in rewards are imported on first use, so configuring ``brightness`` never imports transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..components import check_arguments, check_resolvable, resolve
from ..errors import UserError, first_line

# The paper's two weightings of VideoAlign's dimensions (spec section 3). Setting B, alignment-focused, is the
# paper's preferred one; "Overall" (VQ + MQ + TA) is reported but never weighted, which would count it twice.
WEIGHT_PRESETS: dict[str, dict[str, float]] = {
    "setting_a": {"VQ": 1.0, "MQ": 1.0, "TA": 1.0},
    "setting_b": {"VQ": 0.5, "MQ": 0.5, "TA": 1.0},
}

# name -> "module:factory"; a factory is a class or a function returning a reward.
BUILTIN_REWARDS = {
    "videoalign": "sage_grpo.core.rewards.videoalign:load_videoalign",
    "tiny-videoalign": "sage_grpo.core.rewards.videoalign:tiny_videoalign",
    "clipscore": "sage_grpo.core.rewards.clip:load_clipscore",
    "pickscore": "sage_grpo.core.rewards.clip:load_pickscore",
    "tiny-clipscore": "sage_grpo.core.rewards.clip:tiny_clipscore",
    "tiny-pickscore": "sage_grpo.core.rewards.clip:tiny_pickscore",
    "brightness": "sage_grpo.core.rewards.simple:Brightness",
    "colorfulness": "sage_grpo.core.rewards.simple:Colorfulness",
    "temporal_smoothness": "sage_grpo.core.rewards.simple:TemporalSmoothness",
    "remote": "sage_grpo.core.rewards.remote:RemoteReward",
}


class RewardSpec(BaseModel):
    """One reward in a config, resolved and bound when the config is validated (before any model loads).

    ``name``: a built-in (see ``BUILTIN_REWARDS``) or a dotted path ``"my_pkg.rewards:SafetyReward"`` to a class or
    factory; it is imported at validation, so a typo is a one-line error naming ``rewards.N.name``. ``kwargs`` go to
    it and are bound to its signature at validation (``rewards.N.kwargs``); the reward itself is built later
    (``build_reward``), so heavy models still load lazily. ``weights``: per-dimension weights in the total, or a
    preset name (``setting_a``, ``setting_b``); ``{}`` weighs nothing (a reported-only metric); when omitted, the
    reward's ``default_weights``, else weight 1 on its dimension if it reports exactly one (a reward reporting
    several must say which count: see ``effective_weights``). Dimensions without a weight are reported, not summed.
    ``batch_size``: videos per call (None: the whole batch).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str
    kwargs: dict[str, Any] = Field(default_factory=dict, validate_default=True)  # bound even when omitted
    weights: dict[str, float] | str | None = None
    batch_size: int | None = Field(default=None, ge=1)

    @field_validator("name")
    @classmethod
    def _resolvable(cls, name: str) -> str:
        return check_resolvable(name, BUILTIN_REWARDS, "reward")

    @field_validator("kwargs")
    @classmethod
    def _bindable(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "name" in info.data:  # absent when the name itself failed: that error is the one to report
            check_arguments(resolve_factory(info.data["name"]), kwargs, f"reward {info.data['name']!r}")
        return kwargs

    @field_validator("weights")
    @classmethod
    def _known_preset(cls, weights):
        if isinstance(weights, str) and weights not in WEIGHT_PRESETS:
            raise ValueError(f"unknown weight preset {weights!r}: expected one of {', '.join(WEIGHT_PRESETS)}")
        return weights

    def explicit_weights(self) -> dict[str, float] | None:
        """The configured weights with a preset expanded, or None when the config names none."""
        if isinstance(self.weights, str):
            return dict(WEIGHT_PRESETS[self.weights])
        return None if self.weights is None else dict(self.weights)

    def effective_weights(self, reward, reported: Iterable[str]) -> dict[str, float]:
        """The weights this reward's dimensions enter the total with: the config's, else the reward's
        ``default_weights``, else 1 on its only dimension. Several dimensions and no weights anywhere is a one-line
        UserError: summing them all would silently count extras (a word count, an "Overall" that already sums the
        others) in the total, and weighing none would silently train on nothing."""
        weights = self.explicit_weights()
        if weights is None:
            weights = getattr(reward, "default_weights", None)
        if weights is not None:
            return dict(weights)
        reported = sorted(reported)
        if len(reported) > 1:
            raise UserError(
                f"reward {self.name!r} reports {len(reported)} dimensions ({', '.join(reported)}) and "
                f"no weights: set its weights, e.g. {{{reported[0]}: 1.0}} (unweighted dimensions are "
                "reported, not summed; weights: {} reports them all)"
            )
        return dict.fromkeys(reported, 1.0)


def build_reward(spec: RewardSpec) -> Callable:
    """Instantiate the reward a spec names (its kwargs were bound at validation). A value its constructor rejects
    (ValueError) is a one-line UserError naming the reward."""
    try:
        reward = resolve_factory(spec.name)(**spec.kwargs)
    except ValueError as error:
        raise UserError(f"reward {spec.name!r}: {first_line(error)}") from None
    if not callable(reward):
        raise UserError(f"reward {spec.name!r} built a {type(reward).__name__}, which is not callable")
    return reward


def resolve_factory(name: str) -> Callable:
    return resolve(name, BUILTIN_REWARDS, "reward")
