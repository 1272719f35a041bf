"""Rewards: the contract (``base``), configuration and registry (``registry``), and the built-in rewards.

Heavy rewards (VideoAlign, CLIPScore, PickScore) live in their own modules and are imported only when configured.
"""

from .base import Reward, RewardUnavailable, Scores, VideoBatch, check_scores, weighted_total
from .registry import BUILTIN_REWARDS, WEIGHT_PRESETS, RewardSpec, build_reward

__all__ = [
    "BUILTIN_REWARDS",
    "WEIGHT_PRESETS",
    "Reward",
    "RewardSpec",
    "RewardUnavailable",
    "Scores",
    "VideoBatch",
    "build_reward",
    "check_scores",
    "weighted_total",
]
