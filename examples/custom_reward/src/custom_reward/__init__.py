"""An example reward plug-in for sage-grpo: configure it as ``custom_reward:ColorMatch``."""

from .rewards import ColorMatch

__all__ = ["ColorMatch"]
