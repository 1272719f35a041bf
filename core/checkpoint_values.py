"""The values a checkpointed state may hold, declared as pydantic models.

A checkpoint is data from outside. ``pipeline.checkpointer.schema_problem`` checks that a saved state has the live
object's structure; these models check what that cannot: the values. One out of range resumes a run that is silently
wrong: lambda NaN makes every loss NaN, so DeepSpeed skips every update and the run "completes" untrained; lambda
negative pushes the policy away from its anchor; a sampler position past the prompt set, or a counter below 0, replays
or skips data. Each stateful object's ``state_problem`` validates its state against its model here, so a step holding
such a value is set aside like any other bad step (``Checkpointer.load``).

``extra="ignore"``: the keys are the structure check's job; these models name only the values that have a range.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

Count = Annotated[int, Field(strict=True, ge=0)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
# lambda is produced by min(max(...)) and by the warm-up's interpolation, which may land an ulp past its bound.
_ROUNDING = 1e-9


def _all_finite(tensor: Any) -> Any:
    if not bool(tensor.isfinite().all()):
        raise ValueError("holds NaN or infinite values")
    return tensor


FiniteTensor = Annotated[Any, AfterValidator(_all_finite)]


class _Values(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, arbitrary_types_allowed=True)


class ShardValues(_Values):
    """``stages.anchor.Anchor.state_dict()``: the anchor's, the lagged policy's or the EMA's shards on one rank."""

    refreshes: Count
    values: list[FiniteTensor]


class ControllerValues(_Values):
    """A KL-weight controller's state (``core.grpo``). Validated with the context ``lambda_range``: the (floor,
    ceiling) the controller keeps lambda in, before a tightening ``strength`` multiplies both."""

    steps: Count
    value: Finite
    measurements: list[Finite]
    strength: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 1.0

    @model_validator(mode="after")
    def _lambda_in_range(self, info: ValidationInfo) -> ControllerValues:
        floor, ceiling = (bound * self.strength for bound in info.context["lambda_range"])
        if not floor * (1 - _ROUNDING) <= self.value <= ceiling * (1 + _ROUNDING):
            raise ValueError(f"lambda {self.value!r} is outside the controller's range [{floor:g}, {ceiling:g}]")
        return self


class UpdaterValues(_Values):
    """``stages.update.Updater.state_dict()``."""

    updates_done: Count
    skipped_updates: Count
    controller: ControllerValues
    anchor: ShardValues | None
    lagged: ShardValues | None
    ema: ShardValues | None = None


class SamplerValues(_Values):
    """``stages.ingest.PromptSampler.state_dict()``: a position within the epoch's order of ``num_prompts`` indices
    (at its end when the epoch was used up exactly), carried-over indices of prompts that exist."""

    num_prompts: Annotated[int, Field(strict=True, ge=1)]
    epoch: Count
    position: Count
    carried_over: list[Count]

    @field_validator("carried_over")
    @classmethod
    def _distinct(cls, carried_over: list[int]) -> list[int]:
        if len(set(carried_over)) != len(carried_over):
            raise ValueError("repeats a prompt index")
        return carried_over

    @model_validator(mode="after")
    def _inside_the_prompt_set(self) -> SamplerValues:
        if self.position > self.num_prompts:
            raise ValueError(f"position {self.position} is past the prompt set of {self.num_prompts}")
        outside = [index for index in self.carried_over if index >= self.num_prompts]
        if outside:
            raise ValueError(f"carried-over prompt {outside[0]} is outside the prompt set of {self.num_prompts}")
        return self


def values_problem(model: type[_Values], state: Any, where: str, **context: Any) -> str | None:
    """Why ``state`` holds a value ``model`` does not allow, in one line naming where (``where`` and the key path), or
    None. ``context`` is what the model's range checks read (e.g. ``lambda_range``)."""
    try:
        model.model_validate(state, context=context)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        path = ".".join(str(part) for part in (where, *first["loc"]))
        value = first.get("input")
        found = f" (found {value!r})" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""
        message = first["msg"].removeprefix("Value error, ")
        return f"{path}: {message}{found}"
    return None
