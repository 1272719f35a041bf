"""Reward configuration (``RewardSpec``) and the registry that builds a reward from it.

Built-in rewards are imported on first use, so configuring ``brightness`` never imports transformers.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..components import resolve
from ..errors import UserError

# The paper's two weightings of VideoAlign's dimensions (spec section 3). Setting B, alignment-focused, is the
# paper's preferred one; "Overall" (VQ + MQ + TA) is reported but never weighted, which would count it twice.
WEIGHT_PRESETS: dict[str, dict[str, float]] = {
    "setting_a": {"VQ": 1.0, "MQ": 1.0, "TA": 1.0},
    "setting_b": {"VQ": 0.5, "MQ": 0.5, "TA": 1.0},
}

# name -> "module:factory"; a factory is a class or a function returning a reward.
BUILTIN_REWARDS = {
    "videoalign": "core.rewards.videoalign:load_videoalign",
    "tiny-videoalign": "core.rewards.videoalign:tiny_videoalign",
    "clipscore": "core.rewards.clip:load_clipscore",
    "pickscore": "core.rewards.clip:load_pickscore",
    "tiny-clipscore": "core.rewards.clip:tiny_clipscore",
    "tiny-pickscore": "core.rewards.clip:tiny_pickscore",
    "brightness": "core.rewards.simple:Brightness",
    "colorfulness": "core.rewards.simple:Colorfulness",
    "temporal_smoothness": "core.rewards.simple:TemporalSmoothness",
    "remote": "core.rewards.remote:RemoteReward",
}


class RewardSpec(BaseModel):
    """One reward in a config.

    ``name``: a built-in (see ``BUILTIN_REWARDS``) or a dotted path ``"my_pkg.rewards:SafetyReward"`` to a class or
    factory. ``kwargs`` go to it. ``weights``: per-dimension weights in the total, or a preset name (``setting_a``,
    ``setting_b``); ``{}`` weighs nothing (a reported-only metric); when omitted, the reward's ``default_weights``
    or else weight 1 on every dimension it returns. Dimensions without a weight are still reported.
    ``batch_size``: videos per call (None: the whole batch).
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    weights: dict[str, float] | str | None = None
    batch_size: int | None = Field(default=None, ge=1)

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


def build_reward(spec: RewardSpec) -> Callable:
    """Instantiate the reward a spec names; bad kwargs are a one-line UserError naming the reward."""
    factory = resolve_factory(spec.name)
    try:
        inspect.signature(factory).bind(**spec.kwargs)
    except TypeError as error:
        raise UserError(f"reward {spec.name!r}: bad kwargs {sorted(spec.kwargs)}: {error}") from None
    reward = factory(**spec.kwargs)
    if not callable(reward):
        raise UserError(f"reward {spec.name!r} built a {type(reward).__name__}, which is not callable")
    return reward


def resolve_factory(name: str) -> Callable:
    return resolve(name, BUILTIN_REWARDS, "reward")
