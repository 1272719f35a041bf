"""The run's one config schema. Each component owns its section's model next to its code; this file assembles
them and checks what no single section can: combinations that cannot work together.

Everything here is validated before any model loads; a problem is one line naming the key (``core.errors``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core import config_loading
from core.lora import LoraConfig
from core.models import ModelConfig
from core.rewards.registry import RewardSpec
from core.storage import CheckpointConfig
from core.tracking import TrackingConfig
from stages.ingest import DataConfig
from stages.rollout import SDEConfig
from stages.score import ScoringConfig
from stages.update import TrustRegionConfig, UpdateConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutConfig(_Section):
    group_size: int = Field(4, ge=2)          # G: a group of one has no baseline
    prompts_per_rank: int = Field(2, ge=1)


class DeepSpeedConfig(_Section):
    config: str = "zero3"                     # a name in deepspeed_configs/ or a path to a JSON
    precision: Literal["auto", "bf16", "fp32"] = "auto"   # auto: bf16 on GPU, fp32 on CPU
    collective_timeout_minutes: float = Field(30.0, gt=0)


class EvalConfig(_Section):
    every: int = Field(0, ge=0)               # iterations between evaluations; 0 disables
    num_prompts: int = Field(4, ge=1)
    seed: int = 1234
    metrics: list[RewardSpec] = Field(default_factory=list)   # extra metrics (e.g. clipscore) beside the rewards
    write_videos: int = Field(2, ge=0)


class RegistryConfig(_Section):
    """Publishing at the end of a run: export, register as the ``challenger``, then the promotion gate."""

    model_name: str | None = None             # None: do not register
    base_model: str | None = None             # what the pyfunc loads the export onto; default: model.pretrained/name
    promote: bool = False                     # run the gate after registering
    primary_metric: str = "eval/reward"
    margin: float = Field(0.0, ge=0)
    guards: dict[str, float] = Field(default_factory=dict)   # metric -> largest allowed drop


class RunSection(_Section):
    name: str = "sage-grpo"
    output_dir: str = "runs/sage-grpo"
    max_iterations: int = Field(10, ge=1)
    time_budget_minutes: float | None = Field(None, gt=0)
    # After SIGTERM/SIGUSR1 the run finishes its iteration and checkpoints; if that takes longer than this (a reward
    # that hangs, a stuck collective), it exits with the retryable code without a new checkpoint: the committed ones
    # are intact, and the scheduler's kill (Kubernetes' grace period, Slurm's signal lead) must not come first.
    preemption_grace_s: float = Field(240.0, gt=0, allow_inf_nan=False)


class RunConfig(_Section):
    seed: int = 0
    run: RunSection = Field(default_factory=RunSection)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sde: SDEConfig = Field(default_factory=SDEConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="brightness")], min_length=1)
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    update: UpdateConfig = Field(default_factory=UpdateConfig)
    trust_region: TrustRegionConfig = Field(default_factory=TrustRegionConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    data: DataConfig
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)

    @model_validator(mode="after")
    def _combinations(self):
        lora_keys = self.lora.model_fields_set - {"enabled"}
        if not self.lora.enabled and lora_keys:
            raise ValueError(f"lora.{sorted(lora_keys)[0]} is set but lora.enabled is false")
        samples = self.rollout.prompts_per_rank * self.rollout.group_size
        if samples % self.update.micro_batch_size:
            raise ValueError(f"update.micro_batch_size={self.update.micro_batch_size} does not divide the "
                             f"{samples} samples per rank (rollout.prompts_per_rank x rollout.group_size)")
        if self.registry.model_name and not self.tracking.enabled:
            raise ValueError("registry.model_name needs tracking.enabled: versions are registered in MLflow")
        if self.sde.variant == "ode":
            raise ValueError("sde.variant=ode has no log-probabilities to train on; use dance, flow, cps or sage")
        return self

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output_dir)


def load_run_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    return config_loading.load(RunConfig, path, overrides)
