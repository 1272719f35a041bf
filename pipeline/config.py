"""The run's one config schema. Each component owns its section's model next to its code; this file assembles
them and checks what no single section can: combinations that cannot work together.

Everything here is validated before any model loads; a problem is one line naming the key (``core.errors``).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sage_grpo.core import config_loading
from sage_grpo.core.distributed import ParallelConfig, ParallelLayout
from sage_grpo.core.lora import LoraConfig
from sage_grpo.core.models import ModelConfig, sequence_layout
from sage_grpo.core.models.base import check_sequence_split
from sage_grpo.core.registry_config import RegistryConfig
from sage_grpo.core.rewards.registry import RewardSpec
from sage_grpo.core.s3 import S3Config
from sage_grpo.core.storage import CheckpointConfig
from sage_grpo.core.tracking_config import TrackingConfig
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.engine import (
    DeepSpeedConfig,
    check_optimizer_fits,
    deepspeed_config,
    partitions_parameters,
    zero_stage,
)
from sage_grpo.stages.evaluate import EvalConfig
from sage_grpo.stages.ingest import DataConfig
from sage_grpo.stages.rollout import RolloutConfig, SDEConfig
from sage_grpo.stages.score import ScoringConfig
from sage_grpo.stages.update import UpdateConfig

# Keys a release moved: a config that still sets one is refused with a line naming its new place.
MOVED_KEYS = {
    **{f"checkpoint.{key}": f"s3.{key}" for key in S3Config.model_fields},
    "data.s3_endpoint_url": "s3.endpoint_url",
    "update.seed": "seed",
}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RunSection(_Section):
    """The ``run`` section: this application's own keys (every other section lives beside its component)."""

    name: str = "sage-grpo"  # the MLflow run's name (unless tracking.run_name)
    output_dir: str = "runs/sage-grpo"
    max_iterations: int = Field(10, ge=1, le=10_000_000)
    time_budget_minutes: float | None = Field(None, gt=0)
    # After SIGTERM/SIGUSR1 the run finishes its iteration and checkpoints; if that takes longer than this (a reward
    # that hangs, a stuck collective), it exits with the retryable code without a new checkpoint: the committed ones
    # are intact, and the scheduler's kill (Kubernetes' grace period, Slurm's signal lead) must not come first.
    preemption_grace_s: float = Field(240.0, gt=0, allow_inf_nan=False)


class RunConfig(_Section):
    # The run's one seed: torch's, the prompt order's, each iteration's sampling seed and the update's order derive
    # from it (eval.seed stays fixed on purpose: every run is evaluated on the same noise). A non-negative int64.
    seed: int = Field(0, ge=0, lt=2**63)
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
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    data: DataConfig
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    s3: S3Config = Field(default_factory=S3Config)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)

    @model_validator(mode="before")
    @classmethod
    def _no_moved_keys(cls, data: object) -> object:
        for old, new in MOVED_KEYS.items():
            section, key = old.split(".")
            if isinstance(data, dict) and isinstance(data.get(section), dict) and key in data[section]:
                raise ValueError(f"{old} moved to {new}")
        return data

    @model_validator(mode="after")
    def _combinations(self):
        lora_keys = self.lora.model_fields_set - {"enabled"}
        if not self.lora.enabled and lora_keys:
            raise ValueError(f"lora.{sorted(lora_keys)[0]} is set but lora.enabled is false")
        if self.registry.model_name and not self.tracking.enabled:
            raise ValueError("registry.model_name needs tracking.enabled: versions are registered in MLflow")
        if self.sde.variant == "ode":
            raise ValueError("sde.variant=ode has no log-probabilities to train on; use dance, flow, cps or sage")
        # The JSON against this run's values (the world size is checked when the engine is built).
        engine_config = deepspeed_config(
            self.deepspeed.config,
            micro_batch_size=self.update.micro_batch_size,
            accumulation_steps=self.accumulation_steps,
            max_grad_norm=self.update.gradient_clipping,
            bf16=self.deepspeed.use_bf16(),
        )
        check_optimizer_fits(self.update.optimizer, engine_config)
        if self.trust_region.measure_weight_space and partitions_parameters(zero_stage(engine_config)):
            raise ValueError(
                "trust_region.measure_weight_space needs each rank's whole trainable weights; ZeRO-3 partitions them "
                "(deepspeed.config: zero2)"
            )
        self._check_sequence_split()
        self._check_hacking_guard()
        return self

    def _check_hacking_guard(self) -> None:
        """A guard that stops exports the best checkpoint by a judge: the retention must keep that step, and every
        evaluation must be checkpointed for it to be there."""
        if self.eval.guard.action != "stop" or not self.eval.judges or not self.eval.every:
            return
        if not (self.checkpoint.best_metric or "").startswith("eval/judge/"):
            raise ValueError(
                "eval.guard.action=stop exports the best checkpoint by a judge: set "
                "checkpoint.best_metric=eval/judge/<dimension>"
            )
        if not self.checkpoint.every or self.eval.every % self.checkpoint.every:
            raise ValueError(
                f"eval.guard.action=stop needs every evaluation checkpointed: eval.every={self.eval.every} must be "
                f"a multiple of checkpoint.every={self.checkpoint.every}"
            )

    def _check_sequence_split(self) -> None:
        """K must divide the heads and the video tokens (Ulysses splits both) and, once launched, the world size."""
        size = self.parallel.sequence_parallel_size
        if size == 1:
            return
        layout = sequence_layout(self.model)
        if layout is not None:
            check_sequence_split(*layout, size)
        ParallelLayout(int(os.environ.get("WORLD_SIZE", size)), size)  # the layout's own check, before any rank starts

    @property
    def accumulation_steps(self) -> int:
        """Micro-steps per optimizer update for this rollout and schedule (``UpdateConfig.accumulation_steps``)."""
        return self.update.accumulation_steps(self.rollout.samples_per_rank, self.sde.trained_step_count)

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output_dir)


def load_run_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    return config_loading.load(RunConfig, path, overrides)
