"""Stage 4, the GRPO update: one optimizer update per rollout batch on a DeepSpeed engine.

Recipe, per update:
  1. order every (sample chunk, trained timestep) pair at random (seeded by the update index);
  2. for each pair: the anchor's mean (no grad, anchor weights swapped in) when position KL is on, then the policy's
     velocity and the log-prob of the recorded transition; loss = clipped surrogate x S_t
     + lambda_KL x (position KL + 0.1 x step-wise KL); ``engine.backward``; ``engine.step`` (DeepSpeed applies the
     optimizer at the accumulation boundary, i.e. once per update);
  3. a non-finite gradient norm makes DeepSpeed skip the step on every rank (the norm is all-reduced); it is counted;
  4. lambda_KL's controller sees the update's KL; the anchor refreshes every N updates.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from core import distributed, sde
from core.grpo import AdaptiveKLController, Advantages, KLFeedback, clipped_surrogate, gaussian_mean_kl, stepwise_kl
from core.trust_region import KLStrategy, TrustRegion
from stages.anchor import Anchor

DEEPSPEED_CONFIGS = Path(__file__).resolve().parent.parent / "deepspeed_configs"


class UpdateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)
    clip_range: float = Field(1e-4, gt=0)
    micro_batch_size: int = Field(1, ge=1)
    equalizer: bool = True
    advantage_clip: float = Field(5.0, gt=0)
    global_std: bool = False
    gradient_checkpointing: bool = False
    seed: int = 0


class TrustRegionConfig(BaseModel):
    """The dual trust region and its adaptive weight; defaults are the paper's (section 4 of the spec)."""

    model_config = ConfigDict(extra="forbid")

    strategy: KLStrategy = KLStrategy.DUAL
    position_weight: float = Field(1.0, ge=0)
    stepwise_weight: float = Field(0.1, ge=0)
    anchor_interval: int = Field(10, ge=1)
    anchor_offload: bool = False
    kl_initial: float = Field(1e-7, gt=0)
    kl_maximum: float = Field(1e-5, gt=0)
    kl_warmup_steps: int = Field(100, ge=0)
    kl_history: int = Field(10, ge=1)
    kl_target: float = Field(1e-5, gt=0)
    kl_feedback: KLFeedback = KLFeedback.TOWARD_TARGET

    def region(self) -> TrustRegion:
        return TrustRegion(self.strategy, self.position_weight, self.stepwise_weight, self.anchor_interval)

    def controller(self) -> AdaptiveKLController:
        return AdaptiveKLController(initial=self.kl_initial, maximum=self.kl_maximum, warmup_steps=self.kl_warmup_steps,
                                    history=self.kl_history, target=self.kl_target, feedback=self.kl_feedback)


# ----------------------------------------------------------------------------------------------------------------
# The DeepSpeed engine
# ----------------------------------------------------------------------------------------------------------------


def deepspeed_config(name_or_path: str, *, micro_batch_size: int, accumulation_steps: int, max_grad_norm: float,
                     bf16: bool) -> dict:
    """Load a shipped config by name (zero3, zero2, zero3_offload) or a user's JSON, and fill its "auto" fields
    from our config, so the JSON and the run config can never disagree."""
    path = Path(name_or_path)
    if not path.suffix:
        path = DEEPSPEED_CONFIGS / f"{name_or_path}.json"
    config = json.loads(path.read_text())
    filled = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation_steps,
        "gradient_clipping": max_grad_norm,
    }
    for key, value in filled.items():
        if config.get(key, "auto") not in ("auto", value):
            raise ValueError(f"{path.name}: {key}={config[key]} disagrees with the run config ({value})")
        config[key] = value
    config["train_batch_size"] = micro_batch_size * accumulation_steps * distributed.world_size()
    config.setdefault("bf16", {})["enabled"] = bf16
    return config


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

    ds_config = deepspeed_config(deepspeed_config_name, micro_batch_size=config.micro_batch_size,
                                 accumulation_steps=accumulation_steps, max_grad_norm=config.max_grad_norm, bf16=bf16)
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "cpu"
    if config.gradient_checkpointing and hasattr(module, "enable_gradient_checkpointing"):
        module.enable_gradient_checkpointing()
    trainable = [p for p in module.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=_optimizer(trainable, config, offload),
                                           config=ds_config)
    return engine


def accumulation_steps(samples_per_rank: int, micro_batch_size: int, trained_steps: int) -> int:
    if samples_per_rank % micro_batch_size:
        raise ValueError(f"{samples_per_rank} samples per rank do not split into micro batches of {micro_batch_size}")
    return samples_per_rank // micro_batch_size * trained_steps


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
    ratio_min: float = math.inf
    ratio_max: float = -math.inf

    def add(self, **values: float) -> None:
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.count += 1

    def means(self) -> dict[str, float]:
        return {key: value / max(self.count, 1) for key, value in self.sums.items()}


class Updater:
    """Holds what persists across updates: the engine, the anchor, the KL controller and the counters."""

    def __init__(self, engine, adapter, update_config: UpdateConfig, trust_config: TrustRegionConfig):
        self.engine = engine
        self.adapter = adapter
        self.config = update_config
        self.trust = trust_config.region()
        self.trust_config = trust_config
        self.controller = trust_config.controller()
        self.anchor = Anchor.snapshot(engine.module, offload=trust_config.anchor_offload) \
            if self.trust.needs_anchor else None
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
        for transition in transitions:
            loss, parts = self._micro_step(rollout, advantages, weights, transition)
            self.engine.backward(loss)
            self.engine.step()
            totals.add(**parts)
            totals.ratio_min = min(totals.ratio_min, parts["ratio_min"])
            totals.ratio_max = max(totals.ratio_max, parts["ratio_max"])
        return self._finish_update(totals, weights, rollout)

    def _transitions(self, rollout) -> list[Transition]:
        # The rollout's own transformer batches: the same batch composition reproduces its log-probs bit for bit.
        chunks = rollout.batches
        steps = [int(t) for t in torch.nonzero(rollout.trained_steps).flatten()]
        pairs = [Transition(chunk, step) for chunk in chunks for step in steps]
        order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(self.config.seed + self.updates_done))
        return [pairs[i] for i in order]

    def _timestep_weights(self, rollout) -> torch.Tensor:
        return timestep_weights(rollout, equalize=self.config.equalizer)

    def _micro_step(self, rollout, advantages: Advantages, weights, transition: Transition):
        index, t = transition.samples, transition.step
        latents = rollout.latents[index, t]
        target = rollout.latents[index, t + 1]
        sigma = rollout.sigmas[t].expand(len(index)).float()
        sigma_next = rollout.sigmas[t + 1].expand(len(index)).float()
        embeddings = rollout.sample_embeddings(index)

        sde_config = rollout.sde_config

        def transition_under(module):
            velocity = self.adapter.predict_velocity(latents, sigma, embeddings, module=module)
            return sde.sde_step(sde_config.sde_variant, velocity, latents, sigma, sigma_next, sde_config.eta,
                                prev_sample=target)

        anchor_mean = None
        if self.anchor is not None:
            with torch.no_grad(), self.anchor.swapped_in():
                anchor_mean = transition_under(self.engine).mean
        step = transition_under(self.engine)

        old_log_prob = rollout.log_probs[index, t].float()
        valid = advantages.valid[index].float()
        surrogate = clipped_surrogate(step.log_prob, old_log_prob, advantages.values[index].float(),
                                      self.config.clip_range, weights=float(weights[t]))
        policy_loss = (surrogate.loss * valid).sum() / len(index)
        position_kl = gaussian_mean_kl(step.mean, anchor_mean, step.std).mean() if anchor_mean is not None \
            else torch.zeros(())
        velocity_kl = stepwise_kl(old_log_prob, step.log_prob)
        kl = self.trust.total_kl(position_kl, velocity_kl)
        loss = policy_loss + self.controller.value * kl
        parts = {
            "loss": loss.item(), "policy_loss": policy_loss.item(), "position_kl": position_kl.item(),
            "stepwise_kl": velocity_kl.item(), "kl": float(kl),
            "clip_fraction": surrogate.clipped.float().mean().item(), "ratio_mean": surrogate.ratio.mean().item(),
            "ratio_min": surrogate.ratio.min().item(), "ratio_max": surrogate.ratio.max().item(),
        }
        return loss, parts

    def _finish_update(self, totals: _Totals, weights, rollout) -> dict[str, float]:
        skipped = not self.engine.was_step_applied()
        metrics = distributed.all_reduce_mean(totals.means())
        metrics["ratio_min"], metrics["ratio_max"] = totals.ratio_min, totals.ratio_max
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
                "anchor": self.anchor.state_dict() if self.anchor else None}

    def load_state_dict(self, state: dict) -> None:
        self.updates_done = int(state["updates_done"])
        self.skipped_updates = int(state["skipped_updates"])
        self.controller.load_state_dict(state["controller"])
        if self.anchor is not None:
            self.anchor.load_state_dict(state["anchor"])


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
    config = rollout.sde_config
    index = torch.arange(rollout.num_samples) if samples is None else samples
    embeddings = rollout.sample_embeddings(index)
    norms = {}
    for t in torch.nonzero(rollout.trained_steps.cpu()).flatten().tolist():
        latents = rollout.latents[index, t]
        sigma = rollout.sigmas[t].expand(len(index)).float()
        sigma_next = rollout.sigmas[t + 1].expand(len(index)).float()
        velocity = adapter.predict_velocity(latents, sigma, embeddings)
        step = sde.sde_step(config.sde_variant, velocity, latents, sigma, sigma_next, config.eta,
                            prev_sample=rollout.latents[index, t + 1])
        grads = torch.autograd.grad(step.log_prob.sum() * float(weights[t]), params, allow_unused=True)
        norms[t] = float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None)))
    return norms
