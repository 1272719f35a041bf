"""The ``registry`` section of a run config, apart from ``core.registry`` (which re-exports it) so that reading a
config does not import MLflow, pandas and torch."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MIN_EVAL_PROMPTS = 8
DEFAULT_PRIMARY_METRIC = "eval/reward"  # what stages/evaluate.py logs for the training rewards
# The noise floor of a gain between two evaluations: one policy (the shortened demo's, 8 iterations) evaluated on the
# 20 demo prompts with eval.seed 1..6 gave eval/reward with sd 0.00072 (2026-12-06; the command is in docs/mlflow.md),
# so two evaluations of one policy differ by more than 2 x sqrt(2) x sd = 0.0021 about 5% of the time. A smaller gain
# is noise. The demo's brightness reward: measure yours the same way and set registry.margin.
DEFAULT_MARGIN = 0.002


class RegistryConfig(BaseModel):
    """The ``registry`` section, publishing at the end of a run: export, register as the ``challenger``, then the
    promotion gate."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model_name: str | None = None  # None: do not register
    base_model: str | None = None  # what the pyfunc loads the export onto; default: model.pretrained/name
    promote: bool = False  # run the gate after registering
    primary_metric: str = DEFAULT_PRIMARY_METRIC
    margin: float = Field(DEFAULT_MARGIN, ge=0)  # the primary metric must gain more than this
    guards: dict[str, float] = Field(default_factory=dict)  # metric -> largest allowed drop
    # Fewer prompts than this and the gate refuses: a mean over a handful of videos is mostly seed noise.
    min_eval_prompts: int = Field(DEFAULT_MIN_EVAL_PROMPTS, ge=1)
