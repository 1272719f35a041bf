"""The ``registry`` section of a run config, apart from ``core.registry`` (which re-exports it) so that reading a
config does not import MLflow, pandas and torch."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MIN_EVAL_PROMPTS = 8
DEFAULT_PRIMARY_METRIC = "eval/reward"  # what stages/evaluate.py logs for the training rewards


class RegistryConfig(BaseModel):
    """The ``registry`` section, publishing at the end of a run: export, register as the ``challenger``, then the
    promotion gate."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model_name: str | None = None  # None: do not register
    base_model: str | None = None  # what the pyfunc loads the export onto; default: model.pretrained/name
    promote: bool = False  # run the gate after registering
    primary_metric: str = DEFAULT_PRIMARY_METRIC
    margin: float = Field(0.0, ge=0)
    guards: dict[str, float] = Field(default_factory=dict)  # metric -> largest allowed drop
    # Fewer prompts than this and the gate refuses: a mean over a handful of videos is mostly seed noise.
    min_eval_prompts: int = Field(DEFAULT_MIN_EVAL_PROMPTS, ge=1)
