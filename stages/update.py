"""Stage 4, the GRPO update: one optimizer update per rollout batch on a DeepSpeed engine.

Recipe, per update:
  1. order every (sample chunk, trained timestep) pair at random (seeded by the update index);
  2. for each pair: the anchor's mean (no grad, anchor weights swapped in) when position KL is on, then the policy's
     velocity and the log-prob of the recorded transition; loss = clipped surrogate x S_t
     + lambda_KL x (position KL + 0.1 x step-wise KL); ``engine.backward``; ``engine.step`` (DeepSpeed applies the
     optimizer at the accumulation boundary, i.e. once per update);
  3. a non-finite gradient norm makes DeepSpeed skip the step on every rank (the norm is all-reduced); it is counted;
  4. lambda_KL's controller sees the update's KL; the anchor refreshes every N updates; the lagged policy (velocity
     term's reference, pi_{k-1}) becomes this update's starting weights once the update was applied.

Why the calibrated lambda (``trust_region.preset: calibrated``). Log-prob and KL are both per-element means in units
of the step's std, so for one micro-step |grad policy| ~ |A| / (std sqrt(E)) and |grad lambda KL| ~ lambda (dmu/std) /
(std sqrt(E)): their ratio is about lambda sqrt(2 KL) / |A|, whatever the model size or video resolution (E cancels).
The controller holds the KL near ``kl_target`` (1e-3 per element, i.e. dmu ~ 0.045 std from the anchor), so lambda in
[0.1, 10] puts the ratio in [0.005, 0.45] at the target, ~0.01-0.3 in practice (measured on the tiny model: the
first measurement matched the estimate to 5%). The paper's lambda in [1e-7, 1e-5] gives ~1e-6: kept as the
``paper`` preset, inert. ``update/kl_grad_ratio`` is measured (two extra backward passes on one micro-step every
``kl_grad_ratio_every`` updates) so a user sees which regime a run is in.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core import distributed, sde
from core.errors import UserError
from core.schedules import LRSchedule, lr_multiplier
from core.grpo import (AdaptiveKLController, Advantages, KLFeedback, SurrogateTerms, clipped_surrogate,
                       gaussian_mean_kl, group_advantages, stepwise_kl)
from core.trust_region import KLStrategy, TrustRegion
from stages.anchor import Anchor
from stages.rollout import score_transition

DEEPSPEED_CONFIGS = Path(__file__).resolve().parent.parent / "deepspeed_configs"

CALIBRATED_LAMBDA_MIN = 0.1
CALIBRATED_LAMBDA_MAX = 10.0
CALIBRATED_KL_TARGET = 1e-3


class UpdateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # adamw (default) or muon (the reference code's optimizer, DeepSpeed's implementation; use weight_decay 0.01 to
    # match it). Same lr 1e-5 either way, as the paper states.
    optimizer: Literal["adamw", "muon"] = "adamw"
    learning_rate: float = Field(1e-5, gt=0, le=1.0, allow_inf_nan=False)
    # Warm-up then decay, stepped once per applied optimizer update (DeepSpeed steps it, and checkpoints its state).
    lr_schedule: LRSchedule = "constant"
    lr_warmup_steps: int = Field(0, ge=0)
    lr_decay_steps: int | None = Field(None, ge=1)   # updates after the warm-up; required by linear and cosine
    lr_min_ratio: float = Field(0.0, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)
    clip_range: float = Field(1e-4, gt=0)
    micro_batch_size: int = Field(1, ge=1)
    equalizer: bool = True
    advantage_clip: float = Field(5.0, gt=0)
    global_std: bool = False
    gradient_checkpointing: bool = False
    seed: int = Field(0, ge=0, lt=2**63)

    @model_validator(mode="after")
    def _decay_has_a_length(self) -> "UpdateConfig":
        if self.lr_schedule != "constant" and self.lr_decay_steps is None:
            raise ValueError(f"lr_schedule={self.lr_schedule} needs update.lr_decay_steps (updates to decay over)")
        return self

    def lr_scheduler(self, optimizer):
        """The torch scheduler DeepSpeed steps; a LambdaLR whose lambda is a pure function of the step."""
        from functools import partial

        return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(
            lr_multiplier, schedule=self.lr_schedule, warmup_steps=self.lr_warmup_steps,
            decay_steps=self.lr_decay_steps, min_ratio=self.lr_min_ratio))


# The adaptive KL weight's numbers per preset. "paper" is the appendix literally (lambda in [1e-7, 1e-5], target 1e-5):
# on our per-element-mean KL its gradient is ~1e-5 of the policy term's, so it is inert (measured: README, Choices).
# "calibrated" (default) puts lambda where the KL gradient is a useful fraction of the policy gradient; see the
# module docstring for the reasoning.
KL_PRESETS: dict[str, dict[str, Any]] = {
    "calibrated": dict(kl_initial=CALIBRATED_LAMBDA_MIN, kl_maximum=CALIBRATED_LAMBDA_MAX, kl_warmup_steps=0,
                       kl_history=3, kl_target=CALIBRATED_KL_TARGET, kl_feedback=KLFeedback.TOWARD_TARGET),
    "paper": dict(kl_initial=1e-7, kl_maximum=1e-5, kl_warmup_steps=100, kl_history=10, kl_target=1e-5,
                  kl_feedback=KLFeedback.TOWARD_TARGET),
}


class TrustRegionConfig(BaseModel):
    """The dual trust region and its adaptive weight. ``preset`` fills the lambda keys left unset: ``calibrated``
    (default, acts) or ``paper`` (the appendix's numbers, inert on this objective); a key set explicitly wins."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    preset: Literal["calibrated", "paper"] = "calibrated"
    strategy: KLStrategy = KLStrategy.DUAL
    position_weight: float = Field(1.0, ge=0)
    stepwise_weight: float = Field(0.1, ge=0)
    # lagged: Gaussian mean KL to the policy one applied update behind (pi_{k-1}). rollout_logratio: the paper's
    # mean(logp_old - logp_new), identically 0 with one update per rollout (kept for parity; a no-op here).
    velocity_estimator: Literal["lagged", "rollout_logratio"] = "lagged"
    anchor_interval: int = Field(10, ge=1)
    anchor_offload: bool = False
    kl_initial: float = Field(gt=0)
    kl_maximum: float = Field(gt=0)
    kl_warmup_steps: int = Field(ge=0)
    kl_history: int = Field(ge=1)
    kl_target: float = Field(gt=0)
    kl_feedback: KLFeedback
    # update/kl_grad_ratio is measured on one micro-step every this many updates (two extra backward passes); 0: off.
    kl_grad_ratio_every: int = Field(10, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            preset = data.get("preset", "calibrated")
            if preset in KL_PRESETS:
                data = KL_PRESETS[preset] | data
        return data

    def region(self) -> TrustRegion:
        return TrustRegion(self.strategy, self.position_weight, self.stepwise_weight, self.anchor_interval)

    def controller(self) -> AdaptiveKLController:
        return AdaptiveKLController(initial=self.kl_initial, maximum=self.kl_maximum, warmup_steps=self.kl_warmup_steps,
                                    history=self.kl_history, target=self.kl_target, feedback=self.kl_feedback)


# ----------------------------------------------------------------------------------------------------------------
# The DeepSpeed engine
# ----------------------------------------------------------------------------------------------------------------


class DeepSpeedConfig(BaseModel):
    """The ``deepspeed`` section. The JSON is loaded and checked when the config is validated; its "auto" fields are
    filled from the run config when the engine is built, and a value it sets that disagrees with the run config is
    refused (as DeepSpeed's HF integration does), never silently overwritten."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    config: str = "zero3"                     # a name in deepspeed_configs/ or a path to a JSON
    precision: Literal["auto", "bf16", "fp32"] = "auto"   # auto: bf16 on GPU, fp32 on CPU
    collective_timeout_minutes: float = Field(30.0, gt=0, le=24 * 60, allow_inf_nan=False)

    @field_validator("config")
    @classmethod
    def _loadable(cls, name_or_path: str) -> str:
        load_deepspeed_json(name_or_path)
        return name_or_path

    def use_bf16(self) -> bool:
        return torch.cuda.is_available() if self.precision == "auto" else self.precision == "bf16"


def load_deepspeed_json(name_or_path: str) -> dict:
    """A shipped config by name (zero2, zero3, zero3_offload) or a user's JSON, checked for what this pipeline
    cannot run: problems are ValueErrors with one line (the config key is added by pydantic)."""
    path = Path(name_or_path)
    if not path.suffix:
        path = DEEPSPEED_CONFIGS / f"{name_or_path}.json"
    shipped = ", ".join(sorted(p.stem for p in DEEPSPEED_CONFIGS.glob("*.json")))
    if not path.is_file():
        raise ValueError(f"{name_or_path!r}: no such DeepSpeed config (a path to a JSON, or one of {shipped})")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a DeepSpeed config is a JSON object, not a {type(config).__name__}")
    for block in ("optimizer", "scheduler"):
        if block in config:
            raise ValueError(f"{path}: its {block!r} block would replace the run's (update.optimizer, "
                             "update.learning_rate, update.lr_schedule): remove it from the JSON")
    if (config.get("fp16") or {}).get("enabled") in (True, "auto"):
        raise ValueError(f"{path}: fp16 is not supported (log-densities need the range): use bf16 or fp32")
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict) or zero.get("stage", 0) not in (0, 1, 2, 3):
        raise ValueError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3")
    for offload in ("offload_optimizer", "offload_param"):
        device = (zero.get(offload) or {}).get("device", "none")
        if device not in ("none", "cpu", "nvme"):
            raise ValueError(f"{path}: zero_optimization.{offload}.device must be none, cpu or nvme, not {device!r}")
    return config


def deepspeed_config(name_or_path: str, *, micro_batch_size: int, accumulation_steps: int, max_grad_norm: float,
                     bf16: bool, world_size: int | None = None, hidden_size: int | None = None) -> dict:
    """The JSON with its "auto" fields filled from the run config. A field the JSON sets to another value than the
    run's is a ValueError. With ``hidden_size``, "auto" ZeRO bucket sizes follow the model (HF's rule)."""
    config = load_deepspeed_json(name_or_path)
    required = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation_steps,
        "gradient_clipping": max_grad_norm,
    }
    if world_size is not None:
        required["train_batch_size"] = micro_batch_size * accumulation_steps * world_size
    for key, value in required.items():
        _fill(config, key, value, name_or_path)
    _fill(config.setdefault("bf16", {}), "enabled", bf16, name_or_path, key_path="bf16.enabled")
    zero = config.get("zero_optimization", {})
    if hidden_size:
        for key, value in (("reduce_bucket_size", hidden_size * hidden_size),
                           ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
                           ("stage3_param_persistence_threshold", 10 * hidden_size)):
            if zero.get(key) == "auto":
                zero[key] = value
    return config


def _fill(section: dict, key: str, value, source: str, key_path: str | None = None) -> None:
    current = section.get(key, "auto")
    if current != "auto" and current != value:
        raise ValueError(f"deepspeed.config {source}: {key_path or key}={current} disagrees with the run config "
                        f"({value}); set it to \"auto\" or to the same value")
    section[key] = value


def _optimizer(params, config: UpdateConfig, offload: bool):
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=config.learning_rate, betas=config.betas, eps=config.adam_eps,
                                weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.learning_rate, betas=config.betas, eps=config.adam_eps,
                             weight_decay=config.weight_decay, foreach=torch.cuda.is_available())


def build_engine(module: torch.nn.Module, config: UpdateConfig, *, accumulation_steps: int,
                 deepspeed_config_name: str = "zero3", bf16: bool = False):
    """Wrap ``module`` (LoRA adapters already added, if any) in a DeepSpeed engine training its trainable params."""
    import deepspeed

    try:
        ds_config = deepspeed_config(deepspeed_config_name, micro_batch_size=config.micro_batch_size,
                                     accumulation_steps=accumulation_steps, max_grad_norm=config.max_grad_norm,
                                     bf16=bf16, world_size=distributed.world_size(), hidden_size=_hidden_size(module))
    except ValueError as error:  # train_batch_size, which needs the world size, is known only now
        raise UserError(str(error)) from None
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "cpu"
    if config.gradient_checkpointing and hasattr(module, "enable_gradient_checkpointing"):
        module.enable_gradient_checkpointing()
    trainable = [p for p in module.parameters() if p.requires_grad]
    if config.optimizer == "muon" and ds_config.get("zero_optimization", {}).get("stage") != 3:
        raise ValueError("update.optimizer=muon is wired for ZeRO-3 configs only (zero3, zero3_offload)")
    if config.optimizer == "muon":
        # DeepSpeed's own Muon (Muon on the 2-D weights, Adam on the rest), configured in its JSON: a client
        # optimizer would see ZeRO-3's flat partitions, and Muon needs whole matrices.
        ds_config["optimizer"] = {"type": "muon", "params": {
            "lr": config.learning_rate, "weight_decay": config.weight_decay, "momentum": config.muon_momentum,
            "betas": list(config.betas), "eps": config.adam_eps}}
        ds_config.setdefault("zero_optimization", {})["reduce_scatter"] = False  # DeepSpeed's Muon requires it
        engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=trainable, config=ds_config,
                                               lr_scheduler=config.lr_scheduler)
        return engine
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=_optimizer(trainable, config, offload),
                                           config=ds_config, lr_scheduler=config.lr_scheduler)
    return engine


def _hidden_size(module: torch.nn.Module) -> int | None:
    """The transformer's width, from its diffusers config (heads x head dim where it has no hidden_size)."""
    config = getattr(module, "config", None) or {}
    if config.get("hidden_size"):
        return int(config["hidden_size"])
    if config.get("num_attention_heads") and config.get("attention_head_dim"):
        return int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    return None


def accumulation_steps(samples_per_rank: int, micro_batch_size: int, trained_steps: int) -> int:
    if samples_per_rank % micro_batch_size:
        raise ValueError(f"{samples_per_rank} samples per rank do not split into micro batches of {micro_batch_size}")
    return samples_per_rank // micro_batch_size * trained_steps


# ----------------------------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------------------------


def compute_advantages(rewards: list[float | None], group_ids: torch.Tensor, config: UpdateConfig) -> Advantages:
    """Group advantages of this rank's samples; ``update.global_std`` divides by the std of every rank's scored
    rewards (gathered), not of this rank's alone, so the scale does not depend on how samples are split."""
    everyone = _gather_rewards(rewards) if config.global_std else None
    return group_advantages(rewards, group_ids, global_std=config.global_std, all_rewards=everyone,
                            clip=config.advantage_clip)


def _gather_rewards(rewards: list[float | None]) -> list[float | None]:
    if distributed.world_size() == 1 or not torch.distributed.is_initialized():
        return list(rewards)
    gathered: list[list] = [None] * distributed.world_size()
    torch.distributed.all_gather_object(gathered, [None if r is None else float(r) for r in rewards])
    return [r for rank_rewards in gathered for r in rank_rewards]


# ----------------------------------------------------------------------------------------------------------------
# The update
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Transition:
    """What one micro-step trains on: a chunk of samples at one timestep."""

    samples: torch.Tensor
    step: int


@dataclass
class _Totals:
    sums: dict[str, float] = field(default_factory=dict)
    count: int = 0
    kl_grad_ratio: float | None = None
    ratio_min: float = math.inf
    ratio_max: float = -math.inf

    def add(self, **values: float) -> None:
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.count += 1

    def means(self) -> dict[str, float]:
        return {key: value / max(self.count, 1) for key, value in self.sums.items()}


@dataclass
class LossTerms:
    """One micro-step's loss and its parts. ``kl`` is unweighted by lambda (the controller sees it)."""

    loss: torch.Tensor
    policy: torch.Tensor
    kl: torch.Tensor
    position_kl: torch.Tensor
    velocity_kl: torch.Tensor
    surrogate: SurrogateTerms


def micro_step_loss(step: sde.SDEStepOutput, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                    valid: torch.Tensor, weight: float, region: TrustRegion, kl_weight: float, *,
                    clip_range: float, anchor_mean: torch.Tensor | None = None,
                    lagged_mean: torch.Tensor | None = None) -> LossTerms:
    """policy term x S_t + lambda x (position KL + velocity weight x velocity KL) for one chunk at one step.

    Every tensor argument must already be on the policy's device (``Updater.update`` moves them once): mixing a
    CPU advantage with a CUDA ratio is exactly the error the first GPU update would raise. The velocity KL is the
    Gaussian mean KL to the lagged policy when ``lagged_mean`` is given, else the rollout log-ratio estimator.
    """
    surrogate = clipped_surrogate(step.log_prob, old_log_prob, advantages, clip_range, weights=weight)
    policy = (surrogate.loss * valid).sum() / len(valid)
    zero = step.log_prob.new_zeros(())
    position = gaussian_mean_kl(step.mean, anchor_mean, step.std).mean() if anchor_mean is not None else zero
    if lagged_mean is not None:
        velocity = gaussian_mean_kl(step.mean, lagged_mean, step.std).mean()
    else:
        velocity = stepwise_kl(old_log_prob, step.log_prob) if region.uses_stepwise_kl else zero
    kl = region.total_kl(position, velocity)
    kl = kl if torch.is_tensor(kl) else zero
    return LossTerms(policy + kl_weight * kl, policy, kl, position, velocity, surrogate)


def gradient_ratio(terms: LossTerms, kl_weight: float, params: list[torch.nn.Parameter]) -> float:
    """|lambda grad KL| / |grad policy term| over ``params``: whether the trust region acts (0.01-0.3 is a useful
    band; 1e-5, the paper's numbers on our per-element KL, means it does nothing). Keeps the graph for the backward."""
    def norm(value: torch.Tensor) -> float:
        if not value.requires_grad:
            return 0.0
        grads = torch.autograd.grad(value, params, retain_graph=True, allow_unused=True)
        return float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None)))

    policy = norm(terms.policy)
    return norm(kl_weight * terms.kl) / policy if policy > 0 else float("nan")


class Updater:
    """Holds what persists across updates: the engine, the anchor, the lagged policy, the KL controller and the
    counters. Under ZeRO-3 the anchor and the lagged policy are each rank's own shards (``stages/anchor.py``)."""

    def __init__(self, engine, adapter, update_config: UpdateConfig, trust_config: TrustRegionConfig):
        self.engine = engine
        self.adapter = adapter
        self.config = update_config
        self.trust = trust_config.region()
        self.trust_config = trust_config
        self.controller = trust_config.controller()
        offload = trust_config.anchor_offload
        self.anchor = Anchor.snapshot(engine.module, offload=offload) if self.trust.needs_anchor else None
        lagged = self.trust.uses_stepwise_kl and trust_config.velocity_estimator == "lagged"
        self.lagged = Anchor.snapshot(engine.module, offload=offload) if lagged else None
        self.updates_done = 0
        self.skipped_updates = 0

    # -- the recipe -----------------------------------------------------------------------------------------------

    def update(self, rollout, advantages: Advantages) -> dict[str, float]:
        weights = self._timestep_weights(rollout)
        totals = _Totals()
        transitions = self._transitions(rollout)
        if len(transitions) != self.engine.gradient_accumulation_steps():
            raise ValueError(f"{len(transitions)} micro-steps in this rollout, but the engine accumulates "
                             f"{self.engine.gradient_accumulation_steps()}: roll out with batch_size = micro_batch_size")
        if self.lagged is not None:
            self.lagged.stage()  # this update's starting weights: the lagged policy once the update is applied
        measure = self._ratio_due()
        for i, terms in enumerate(self.losses(rollout, advantages, weights, transitions)):
            if measure and i == 0:
                totals.kl_grad_ratio = gradient_ratio(terms, self.controller.value, self._trainable())
            self.engine.backward(terms.loss)
            self.engine.step()
            ratio = terms.surrogate.ratio
            totals.add(loss=terms.loss.item(), policy_loss=terms.policy.item(), kl=terms.kl.item(),
                       position_kl=terms.position_kl.item(), velocity_kl=terms.velocity_kl.item(),
                       clip_fraction=terms.surrogate.clipped.float().mean().item(), ratio_mean=ratio.mean().item())
            totals.ratio_min = min(totals.ratio_min, ratio.min().item())
            totals.ratio_max = max(totals.ratio_max, ratio.max().item())
        return self._finish_update(totals, weights, rollout)

    def losses(self, rollout, advantages: Advantages, weights: torch.Tensor | None = None,
               transitions: list[Transition] | None = None) -> Iterator[LossTerms]:
        """Each micro-step's loss in training order, computed lazily (after the previous step was applied)."""
        weights = self._timestep_weights(rollout) if weights is None else weights
        device = rollout.latents.device
        # Once per update: group_advantages builds CPU tensors, the policy's ratio lives on the model's device.
        advantages = Advantages(advantages.values.to(device), advantages.valid.to(device))
        for transition in self._transitions(rollout) if transitions is None else transitions:
            yield self._micro_step(rollout, advantages, weights, transition)

    def _ratio_due(self) -> bool:
        every = self.trust_config.kl_grad_ratio_every
        return bool(every) and self.trust.strategy is not KLStrategy.NONE and self.updates_done % every == 0

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.engine.module.parameters() if p.requires_grad]

    def _transitions(self, rollout) -> list[Transition]:
        # The rollout's own transformer batches: the same batch composition reproduces its log-probs bit for bit.
        chunks = rollout.batches
        steps = [int(t) for t in torch.nonzero(rollout.trained_steps.cpu()).flatten()]
        pairs = [Transition(chunk, step) for chunk in chunks for step in steps]
        order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(self.config.seed + self.updates_done))
        return [pairs[i] for i in order]

    def _timestep_weights(self, rollout) -> torch.Tensor:
        return timestep_weights(rollout, equalize=self.config.equalizer)

    def _micro_step(self, rollout, advantages: Advantages, weights, transition: Transition) -> LossTerms:
        index, t = transition.samples, transition.step
        references = {}
        for name, copy in (("anchor_mean", self.anchor), ("lagged_mean", self.lagged)):
            if copy is not None:
                with torch.no_grad(), copy.swapped_in():
                    references[name] = score_transition(self.adapter, rollout, index, t, module=self.engine).mean
        step = score_transition(self.adapter, rollout, index, t, module=self.engine)
        on_device = index.to(rollout.latents.device)
        return micro_step_loss(step, rollout.log_probs[on_device, t].float(), advantages.values[on_device],
                               advantages.valid[on_device].float(), float(weights[t]), self.trust,
                               self.controller.value, clip_range=self.config.clip_range, **references)

    def _finish_update(self, totals: _Totals, weights, rollout) -> dict[str, float]:
        skipped = not self.engine.was_step_applied()
        metrics = distributed.all_reduce_mean(totals.means())
        metrics["ratio_min"], metrics["ratio_max"] = totals.ratio_min, totals.ratio_max
        if totals.kl_grad_ratio is not None:
            metrics["kl_grad_ratio"] = distributed.all_reduce_mean({"r": totals.kl_grad_ratio})["r"]
        metrics["lambda_kl"] = self.controller.value
        grad_norm = self.engine.get_global_grad_norm()
        metrics["grad_norm"] = float("nan") if grad_norm is None else float(grad_norm)
        trained = weights[rollout.trained_steps.cpu()]
        metrics["equalizer_min"], metrics["equalizer_max"] = float(trained.min()), float(trained.max())
        if skipped:
            self.skipped_updates += 1
        else:
            self.updates_done += 1
            self.controller.update(metrics["kl"])
            if self.lagged is not None:
                self.lagged.commit()
            if self.anchor is not None and self.trust.refresh_due(self.updates_done):
                self.anchor.refresh()
        metrics["skipped"] = float(skipped)
        metrics["skipped_updates"] = float(self.skipped_updates)
        metrics["updates_done"] = float(self.updates_done)
        metrics["anchor_refreshes"] = float(self.anchor.refreshes if self.anchor else 0)
        return metrics

    # -- state for checkpoints ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"updates_done": self.updates_done, "skipped_updates": self.skipped_updates,
                "controller": self.controller.state_dict(),
                "anchor": self.anchor.state_dict() if self.anchor else None,
                "lagged": self.lagged.state_dict() if self.lagged else None}

    def load_state_dict(self, state: dict) -> None:
        self.updates_done = int(state["updates_done"])
        self.skipped_updates = int(state["skipped_updates"])
        self.controller.load_state_dict(state["controller"])
        if self.anchor is not None:
            self.anchor.load_state_dict(state["anchor"])
        if self.lagged is not None:
            self.lagged.load_state_dict(state["lagged"])

    def load_resharded_state_dict(self, states: list[dict], rank: int, world: int) -> None:
        """The states every rank of a run on another number of ranks saved: the counters and the KL controller are
        the same on every rank (they follow all-reduced metrics), rank 0's are taken; the anchor and lagged shards are
        re-partitioned for this rank of ``world`` (``Anchor.load_resharded_state_dict``)."""
        self.updates_done = int(states[0]["updates_done"])
        self.skipped_updates = int(states[0]["skipped_updates"])
        self.controller.load_state_dict(states[0]["controller"])
        for name, copy in (("anchor", self.anchor), ("lagged", self.lagged)):
            if copy is not None:
                copy.load_resharded_state_dict([state[name] for state in states], rank, world)


# ----------------------------------------------------------------------------------------------------------------
# Diagnostics
# ----------------------------------------------------------------------------------------------------------------


def timestep_weights(rollout, *, equalize: bool) -> torch.Tensor:
    """Per-step loss weights: the equalizer's S_t over the trained steps, or 1 on them when it is off."""
    trained = rollout.trained_steps.cpu()
    if not equalize:
        return trained.float()
    config = rollout.sde_config
    return sde.balance_factors(config.sde_variant, rollout.sigmas.cpu(), config.eta, trained=trained).float()


def timestep_gradient_norms(adapter, rollout, *, equalize: bool, samples: torch.Tensor | None = None):
    """The norm of grad log pi summed over samples, per trained timestep, times S_t when ``equalize``: the quantity
    the temporal gradient equalizer balances (the paper's claim, measured rather than assumed)."""
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    weights = timestep_weights(rollout, equalize=equalize)
    index = torch.arange(rollout.num_samples) if samples is None else torch.as_tensor(samples)
    norms = {}
    for t in torch.nonzero(rollout.trained_steps.cpu()).flatten().tolist():
        step = score_transition(adapter, rollout, index, t)
        grads = torch.autograd.grad(step.log_prob.sum() * float(weights[t]), params, allow_unused=True)
        norms[t] = float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None)))
    return norms
