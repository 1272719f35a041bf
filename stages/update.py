"""Stage 4, the GRPO update: one or more optimizer updates per rollout batch on a DeepSpeed engine
(``stages.engine.build_engine``).

Recipe, per rollout:
  1. order every (sample chunk, trained timestep) pair at random (seeded by the update index), group them
     ``transitions_per_micro_step`` to a forward, and split them into ``updates_per_rollout`` mini-batches, each one
     optimizer update (PPO's reuse of a rollout: from the second update on the ratio departs from 1, so the clip and
     the velocity KL to the lagged policy act);
  2. before an update's first backward, the anchor's and the lagged policy's means for all its micro-steps (no grad,
     each reference's weights swapped in once: neither moves until the update is applied); then for each micro-step
     the policy's velocity and the log-prob of the recorded transition; loss = clipped surrogate x S_t
     + lambda_KL x (position KL + 0.1 x step-wise KL); ``engine.backward``; ``engine.step`` (DeepSpeed applies the
     optimizer at the accumulation boundary, i.e. once per update);
  3. a non-finite gradient norm makes DeepSpeed skip the step on every rank (the norm is all-reduced); it is counted;
  4. lambda_KL's controller sees the update's KL; the anchor refreshes every N updates; the lagged policy (velocity
     term's reference, pi_{k-1}) becomes this update's starting weights once the update was applied; the EMA of the
     weights (``ema_decay``, for evaluation and export through ``Updater.ema_swapped_in``) takes a step.

How strong the trust region is (``update/kl_grad_ratio``, ``OutputGradients``). On every update each loss term is
differentiated with respect to the model's output (the predicted velocity of every trained sample and timestep) and
the squared norms are summed over the update's micro-steps and all ranks: |lambda sum grad KL| / |sum grad policy|, in
total and per term (``/position``, ``/velocity``). It is the ratio of the two pushes on what the network predicts,
the same on every ZeRO stage, full or LoRA, at the cost of three backward passes through the SDE step's arithmetic
(not the network) per micro-step. No closed form predicts it: S_t weights only the policy term, and the KL's
gradient grows with the distance from its reference, 0 on an update whose reference was just refreshed; such
updates are not measured. The ``calibrated`` preset steers lambda to hold the ratio at ``kl_ratio_target``
(``core.grpo.GradientRatioController``); the ``paper`` preset's lambda in [1e-7, 1e-5] steers by the KL and leaves
the ratio ~1e-6 (inert).

Whether the model can learn (issue 49; docs/mlflow.md says how to read them): per applied update, the gradient's RMS
against Adam's eps, the RMS change of the fp32 master weights per unit of learning rate and each top-level module's
share of it (``core.learning_diagnostics``, measured by ``stages.master_weights.WeightStep``); per rollout, the
fraction of prompt groups whose rewards have no variance and each update's first micro-step's ratio.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sage_grpo.core import distributed, flops, sde
from sage_grpo.core.checkpoint_values import UpdaterValues, values_problem
from sage_grpo.core.distributed import ParallelLayout
from sage_grpo.core.errors import UserError
from sage_grpo.core.grpo import (
    Advantages,
    SurrogateTerms,
    clipped_surrogate,
    gaussian_mean_kl,
    group_advantages,
    stepwise_kl,
)
from sage_grpo.core.lazy import lazy_module
from sage_grpo.core.learning_diagnostics import gradient_signals, mean_per_key, step_signals
from sage_grpo.core.lr_schedules import LRSchedule, lr_multiplier
from sage_grpo.core.progress import progress_bar
from sage_grpo.core.trust_region import KLStrategy, TrustRegionConfig, WeightGradients
from sage_grpo.stages.anchor import Anchor
from sage_grpo.stages.master_weights import WeightStep
from sage_grpo.stages.rollout import score_transition

torch = lazy_module("torch", globals())

logger = logging.getLogger(__name__)


class UpdateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # adamw (default) or muon (the reference code's optimizer, DeepSpeed's implementation; use weight_decay 0.01 to
    # match it). Same lr 1e-5 either way, as the paper states.
    optimizer: Literal["adamw", "muon"] = "adamw"
    learning_rate: float = Field(1e-5, gt=0, le=1.0, allow_inf_nan=False)
    # Warm-up then decay, stepped once per applied optimizer update (DeepSpeed steps it, and checkpoints its state).
    lr_schedule: LRSchedule = "constant"
    lr_warmup_steps: int = Field(0, ge=0)
    lr_decay_steps: int | None = Field(None, ge=1)  # updates after the warm-up; required by linear and cosine
    lr_min_ratio: float = Field(0.0, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    # The global gradient norm clip; adamw only (see gradient_clipping: Muon runs unclipped).
    max_grad_norm: float = Field(1.0, gt=0)
    clip_range: float = Field(1e-4, gt=0)
    micro_batch_size: int = Field(1, ge=1)
    # Optimizer updates per rollout: the rollout's (chunk, timestep) pairs, shuffled, split into this many equal
    # mini-batches, each one optimizer step (PPO's reuse: from the second on, the ratio departs from 1 and the clip and
    # the velocity KL act). 1 is the paper's one update per rollout.
    updates_per_rollout: int = Field(1, ge=1, le=1000)
    # (chunk, timestep) pairs batched into one forward: fewer, larger forwards (this many x micro_batch_size samples).
    # The batch composition then differs from the rollout's, so the first update's ratio is 1 only to float precision
    # (|ratio - 1| <= RATIO_TOLERANCE, tested), not bit for bit.
    transitions_per_micro_step: int = Field(1, ge=1, le=1000)
    # EMA of the trainable weights for evaluation and export (Updater.ema_swapped_in), stepped after every applied
    # update and kept in float32 as each rank's own shards; None: off.
    ema_decay: float | None = Field(None, gt=0, lt=1)
    equalizer: bool = True
    advantage_clip: float = Field(5.0, gt=0)
    global_std: bool = False
    gradient_checkpointing: bool = False
    # Stop the run (exit 2, no export or registration) once this many optimizer updates in a row were skipped for
    # non-finite gradients: nothing trains any more, and a run that goes on would "complete" with an untrained policy.
    max_skipped_updates: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _decay_has_a_length(self) -> UpdateConfig:
        if self.lr_schedule != "constant" and self.lr_decay_steps is None:
            raise ValueError(f"lr_schedule={self.lr_schedule} needs update.lr_decay_steps (updates to decay over)")
        return self

    @model_validator(mode="after")
    def _muon_is_not_clipped(self) -> UpdateConfig:
        if self.optimizer == "muon" and "max_grad_norm" in self.model_fields_set:
            raise ValueError(
                "max_grad_norm does not apply to optimizer=muon: DeepSpeed would clip Muon's orthogonalized update "
                "by its own norm, shrinking every step by a model-sized factor; Muon runs unclipped"
            )
        return self

    @property
    def gradient_clipping(self) -> float:
        """DeepSpeed's ``gradient_clipping``: ``max_grad_norm``, or 0 (off) under Muon. DeepSpeed orthogonalizes the
        Muon matrices' gradients before it takes the clip norm, so the norm is that of the updates, about the square
        root of the matrices' summed widths whatever the gradient (11 measured on the tiny model, ~10^3 estimated for
        HunyuanVideo 1.5): clipping at 1 would divide every Muon step by it (deepspeedai/DeepSpeed#8439). An
        orthogonalized update is bounded by construction; the auxiliary AdamW's biases and norms go unclipped too."""
        return 0.0 if self.optimizer == "muon" else self.max_grad_norm

    def accumulation_steps(self, samples_per_rank: int, trained_steps: int) -> int:
        """Micro-steps per optimizer update, the DeepSpeed engine's gradient_accumulation_steps: the rollout's
        (chunk of ``micro_batch_size`` samples, trained step) transitions, grouped ``transitions_per_micro_step`` to a
        forward, split into ``updates_per_rollout`` equal mini-batches. Each must divide exactly, or mini-batches would
        weigh their transitions unequally: a ValueError says what to change."""
        if samples_per_rank % self.micro_batch_size:
            raise ValueError(
                f"update.micro_batch_size={self.micro_batch_size} does not divide the {samples_per_rank} samples per "
                "rank (rollout.prompts_per_rank x rollout.group_size)"
            )
        transitions = samples_per_rank // self.micro_batch_size * trained_steps
        per_update = self.transitions_per_micro_step * self.updates_per_rollout
        if transitions % per_update:
            raise ValueError(
                f"the {transitions} (chunk, timestep) transitions per rollout (samples per rank / "
                f"micro_batch_size x trained steps) do not split into update.updates_per_rollout="
                f"{self.updates_per_rollout} mini-batches of micro-steps of update.transitions_per_micro_step="
                f"{self.transitions_per_micro_step} transitions"
            )
        return transitions // per_update

    def lr_scheduler(self, optimizer):
        """The torch scheduler DeepSpeed steps; a LambdaLR whose lambda is a pure function of the step."""
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_multiplier())

    def learning_rate_of(self, update: int) -> float:
        """The learning rate the scheduler gives the ``update``-th optimizer update (counted from 1)."""
        return self.learning_rate * self._lr_multiplier()(update - 1)

    def _lr_multiplier(self):
        from functools import partial

        return partial(
            lr_multiplier,
            schedule=self.lr_schedule,
            warmup_steps=self.lr_warmup_steps,
            decay_steps=self.lr_decay_steps,
            min_ratio=self.lr_min_ratio,
        )


# ----------------------------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------------------------


def compute_advantages(
    rewards: list[float | None], group_ids: torch.Tensor, config: UpdateConfig, parallel: ParallelLayout | None = None
) -> Advantages:
    """Group advantages of this rank's samples; ``update.global_std`` divides by the std of every data-parallel
    group's scored rewards (gathered), not of this rank's alone, so the scale does not depend on how samples are
    split. ``parallel``: the run's layout (plain data parallelism over this process's world when left out)."""
    everyone = _gather_rewards(rewards, parallel or ParallelLayout.build()) if config.global_std else None
    return group_advantages(
        rewards, group_ids, global_std=config.global_std, all_rewards=everyone, clip=config.advantage_clip
    )


def _gather_rewards(rewards: list[float | None], parallel: ParallelLayout) -> list[float | None]:
    if distributed.world_size() == 1 or not torch.distributed.is_initialized():
        return list(rewards)
    gathered: list[list] = [None] * distributed.world_size()
    torch.distributed.all_gather_object(gathered, [None if r is None else float(r) for r in rewards])
    return [r for rank_rewards in parallel.one_per_sequence_group(gathered) for r in rank_rewards]


# ----------------------------------------------------------------------------------------------------------------
# The update
# ----------------------------------------------------------------------------------------------------------------


# |ratio - 1| of the first update when transitions_per_micro_step > 1 (the forward's batch differs from the rollout's,
# so kernels round differently: measured ~1e-7 on CPU, float32). Ten times below the default clip range (1e-4), so the
# first update is not clipped; tested in tests/distributed/test_throughput.py.
RATIO_TOLERANCE = 1e-5


@dataclass
class Transition:
    """What one micro-step trains on: a chunk of samples at one timestep, or, with transitions_per_micro_step > 1,
    several (chunk, timestep) pairs concatenated (``step`` then holds each sample's timestep)."""

    samples: torch.Tensor
    step: int | torch.Tensor

    @classmethod
    def batched(cls, pairs: list[Transition]) -> Transition:
        if len(pairs) == 1:
            return pairs[0]
        return cls(
            torch.cat([p.samples for p in pairs]),
            torch.cat([torch.full((len(p.samples),), p.step, dtype=torch.long) for p in pairs]),
        )


class OutputGradients:
    """One optimizer update's squared gradient norms of the policy term, the position KL, the velocity KL and their
    weighted sum, with respect to the model's output (the predicted velocity), summed over its micro-steps.

    Each micro-step predicts different outputs, so the update's output-space gradient is their concatenation and its
    squared norm the sum of the micro-steps'; over ranks likewise (the all-reduced mean differs from the sum by the
    same factor for every term, which the ratio cancels).
    """

    TERMS = ("policy", "position", "velocity", "kl")

    def __init__(self):
        self.rows: list[torch.Tensor] = []

    def add(self, terms: LossTerms, region: TrustRegionConfig) -> None:
        """Differentiate ``terms`` with respect to their output (the graph stays for the backward)."""
        policy, position, velocity = (
            _output_gradient(value, terms.output) for value in (terms.policy, terms.position_kl, terms.velocity_kl)
        )
        kl = region.total_kl(position, velocity)
        kl = kl if torch.is_tensor(kl) else torch.zeros_like(policy)
        self.rows.append(torch.stack([g.float().pow(2).sum() for g in (policy, position, velocity, kl)]))

    def ratios(self, kl_weight: float, region: TrustRegionConfig) -> dict[str, float] | None:
        """|lambda sum grad KL| / |sum grad policy| in total ("") and per term, over every rank; None when the
        policy term has no gradient (every advantage 0) or a gradient is not finite. Collective: every rank calls
        it."""
        sums = torch.stack(self.rows).sum(0).double().cpu() if self.rows else torch.zeros(len(self.TERMS))
        squared = distributed.all_reduce_mean(dict(zip(self.TERMS, sums.tolist())))
        if not (squared["policy"] > 0 and all(map(math.isfinite, squared.values()))):
            return None
        policy = math.sqrt(squared["policy"])
        return {
            "": kl_weight * math.sqrt(squared["kl"]) / policy,
            "position": kl_weight * region.position_weight * math.sqrt(squared["position"]) / policy,
            "velocity": kl_weight * region.stepwise_weight * math.sqrt(squared["velocity"]) / policy,
        }


def _output_gradient(value: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    if not (value.requires_grad and output.requires_grad):
        return torch.zeros_like(output)
    (gradient,) = torch.autograd.grad(value, output, retain_graph=True, allow_unused=True)
    return torch.zeros_like(output) if gradient is None else gradient


@dataclass
class _Totals:
    """Each micro-step's scalars, kept on the policy's device until read: one host sync per optimizer update. A
    ``.item()`` per micro-step would block the host until that micro-step's backward finished on the GPU, so the
    next forward's Python and DeepSpeed hook work could not run while the GPU computes."""

    FIELDS = ("loss", "policy_loss", "kl", "position_kl", "velocity_kl", "clip_fraction", "ratio_mean")

    rows: list[torch.Tensor] = field(default_factory=list)
    gradients: OutputGradients = field(default_factory=OutputGradients)
    # One entry per measured optimizer update: {"": total, "position": ..., "velocity": ...}
    ratios: list[dict[str, float]] = field(default_factory=list)
    kl_weight: float = math.nan  # the lambda the (last) update trained with
    learning_rate: float = math.nan  # the rate the (last) update stepped with
    # Each update's first micro-step: (largest |ratio - 1|, clip fraction).
    first_rows: list[torch.Tensor] = field(default_factory=list)
    # One entry per applied optimizer update: its gradient and step sizes (core.learning_diagnostics).
    steps: list[dict[str, float]] = field(default_factory=list)

    def add(self, terms: LossTerms) -> None:
        ratio = terms.surrogate.ratio.detach().float()
        scalars = (terms.loss, terms.policy, terms.kl, terms.position_kl, terms.velocity_kl)
        self.rows.append(
            torch.stack(
                [
                    *(value.detach().float().reshape(()) for value in scalars),
                    terms.surrogate.clipped.float().mean(),
                    ratio.mean(),
                    ratio.min(),
                    ratio.max(),
                ]
            )
        )

    def add_first(self, terms: LossTerms) -> None:
        """An update's first micro-step: how far the policy already is from the rollout's before this update."""
        ratio = terms.surrogate.ratio.detach().float()
        self.first_rows.append(torch.stack([(ratio - 1).abs().max(), terms.surrogate.clipped.float().mean()]))

    def merge(self, other: _Totals) -> None:
        self.rows += other.rows
        self.ratios += other.ratios
        self.first_rows += other.first_rows
        self.steps += other.steps
        self.kl_weight = other.kl_weight
        self.learning_rate = other.learning_rate

    def ratio_means(self) -> dict[str, float]:
        """The measured updates' gradient ratios, averaged; empty when no update of the rollout was measured."""
        return mean_per_key(self.ratios)

    def first_micro_steps(self) -> tuple[float, float]:
        """Over the updates' first micro-steps on this rank: the largest |ratio - 1| and the mean clip fraction."""
        table = torch.stack(self.first_rows).double().cpu()
        return table[:, 0].max().item(), table[:, 1].mean().item()

    def _table(self) -> torch.Tensor:
        return torch.stack(self.rows).double().cpu() if self.rows else torch.empty(0, len(self.FIELDS) + 2)

    def means(self) -> dict[str, float]:
        table = self._table()
        return dict(zip(self.FIELDS, table[:, : len(self.FIELDS)].mean(0).tolist())) if len(table) else {}

    def ratio_range(self) -> tuple[float, float]:
        table = self._table()
        return (table[:, -2].min().item(), table[:, -1].max().item()) if len(table) else (math.inf, -math.inf)


@dataclass
class LossTerms:
    """One micro-step's loss and its parts. ``kl`` is unweighted by lambda (the controller sees it)."""

    loss: torch.Tensor
    policy: torch.Tensor
    kl: torch.Tensor
    position_kl: torch.Tensor
    velocity_kl: torch.Tensor
    surrogate: SurrogateTerms
    output: torch.Tensor | None = None  # the predicted velocity every term was computed from


def micro_step_loss(
    step: sde.SDEStepOutput,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    weight: float | torch.Tensor,
    region: TrustRegionConfig,
    kl_weight: float,
    *,
    clip_range: float,
    anchor_mean: torch.Tensor | None = None,
    lagged_mean: torch.Tensor | None = None,
) -> LossTerms:
    """policy term x S_t + lambda x (position KL + velocity weight x velocity KL) for one chunk at one step, or for
    several (chunk, step) pairs at once (``weight`` then holds each sample's S_t).

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
    return LossTerms(policy + kl_weight * kl, policy, kl, position, velocity, surrogate, step.velocity)


class Updater:
    """Holds what persists across updates: the engine, the anchor, the lagged policy, the EMA, the KL controller and
    the counters. Under ZeRO-3 the anchor, the lagged policy and the EMA are each rank's own shards
    (``stages/anchor.py``). ``seed`` is the run's (the top-level ``seed``): each update's training order derives
    from it. ``parallel``: the run's layout (plain data parallelism over this process's world when left out)."""

    def __init__(
        self,
        engine,
        adapter,
        update_config: UpdateConfig,
        trust_config: TrustRegionConfig,
        *,
        seed: int = 0,
        parallel: ParallelLayout | None = None,
    ):
        self.engine = engine
        self.parallel = parallel or ParallelLayout.build()
        self.seed = seed
        self.adapter = adapter
        self.config = update_config
        self.trust = trust_config
        self.controller = trust_config.controller()
        offload = trust_config.anchor_offload
        self.anchor = Anchor.snapshot(engine.module, offload=offload) if self.trust.needs_anchor else None
        lagged = self.trust.uses_stepwise_kl and trust_config.velocity_estimator == "lagged"
        self.lagged = Anchor.snapshot(engine.module, offload=offload) if lagged else None
        # float32 whatever the weights' precision: a bf16 EMA would stall (decay 0.999 moves it by 1e-3 of the
        # difference, below bf16's resolution).
        self.ema = (
            Anchor.snapshot(engine.module, offload=offload, dtype=torch.float32)
            if update_config.ema_decay is not None
            else None
        )
        self.updates_done = 0
        self.skipped_updates = 0
        self.skipped_in_a_row = 0  # not checkpointed: a resumed run gets max_skipped_updates afresh
        self.weight_gradients: WeightGradients | None = None  # the update being measured in weight space
        self.weight_step = WeightStep(engine.module)  # each update's change of the master weights
        self.lagged_forward_share = 1.0  # of the last rollout's updates, those that ran the lagged policy's forwards

    # -- the recipe -----------------------------------------------------------------------------------------------

    def update(self, rollout, advantages: Advantages) -> dict[str, float]:
        """``updates_per_rollout`` optimizer updates on this rollout; metrics are over all of them. Collective: every
        rank calls it."""
        weights = self._timestep_weights(rollout)
        minibatches = self._minibatches(rollout)
        if len(minibatches[0]) != self.engine.gradient_accumulation_steps():
            raise ValueError(
                f"{len(minibatches[0])} micro-steps per update in this rollout, but the engine "
                f"accumulates {self.engine.gradient_accumulation_steps()}: roll out with batch_size = "
                "micro_batch_size and build the engine with UpdateConfig.accumulation_steps"
            )
        totals, skipped = _Totals(), 0
        bar = progress_bar(
            total=sum(map(len, minibatches)), desc="update", unit="step", leave=False, dynamic_ncols=True
        )
        lagged_is_rollout, applied, lagged_forwards = self._lagged_is_rollout_policy(rollout), 0, 0
        for micro_steps in minibatches:
            clear_gradient_partitions(self.engine)
            if self.lagged is not None:
                self.lagged.stage()  # this update's starting weights: the lagged policy once the update is applied
            lagged_forwards += not lagged_is_rollout
            minibatch = _Totals(kl_weight=self.controller.value, learning_rate=self._learning_rate())
            self.weight_step.start(self.engine.optimizer)
            measured = self._strength_measurable()
            in_weight_space = measured and self.trust.measure_weight_space
            self.weight_gradients = WeightGradients(self.engine.module) if in_weight_space else None
            losses = self.losses(rollout, advantages, weights, micro_steps, lagged_from_rollout=lagged_is_rollout)
            for index, terms in enumerate(losses):
                minibatch.add(terms)
                if index == 0:
                    minibatch.add_first(terms)
                if measured:
                    minibatch.gradients.add(terms, self.trust)
                # The K ranks of a sequence-parallel group hold one sample's loss each, and each backward carries the
                # gradient of its own tokens only; DeepSpeed averages over all ranks, so K times the loss makes the
                # average over data-parallel groups (K = 1 without sequence parallelism).
                self.engine.backward(terms.loss * self.parallel.sequence_parallel_size)
                self.engine.step()
                bar.update()
            if self._after_update(minibatch):
                skipped += 1
            else:  # the lagged policy is now this update's starting weights: the rollout's before any applied update
                lagged_is_rollout = self.lagged is not None and applied == 0 and rollout.means is not None
                applied += 1
            self.weight_gradients = None
            totals.merge(minibatch)
        bar.close()
        self.lagged_forward_share = lagged_forwards / len(minibatches)
        return self._metrics(totals, weights, rollout, skipped) | self._zero_variance_groups(advantages)

    @property
    def reads_rollout_means(self) -> bool:
        """Whether the next rollout should record its means (``generate(record_means=True)``, as much memory as its
        latents): with several updates per rollout, the second one's lagged policy is the rollout's weights (the first
        one's starting weights), and so is a run's first update's. With one update per rollout only a run's first
        update could read them: not worth a first iteration's peak memory."""
        return self.lagged is not None and self.config.updates_per_rollout > 1

    def _lagged_is_rollout_policy(self, rollout) -> bool:
        """Whether the lagged policy is the weights that generated ``rollout`` (the current ones: the update trains on
        its own policy's rollout) on every rank, and the rollout recorded its means to read the reference from.
        Compared value for value (each rank its own shards), so a restored or stale lagged copy is never mistaken for
        it. Collective when the rollout has means (the same on every rank: ``reads_rollout_means``)."""
        if self.lagged is None or rollout.means is None:
            return False
        return not distributed.any_rank(not self.lagged.matches_policy())

    def losses(
        self,
        rollout,
        advantages: Advantages,
        weights: torch.Tensor | None = None,
        transitions: list[Transition] | None = None,
        *,
        lagged_from_rollout: bool = False,
    ) -> Iterator[LossTerms]:
        """Each micro-step's loss in training order, its policy forward computed lazily (after the previous micro-step
        was applied). ``transitions`` (default: the whole rollout) must belong to one optimizer update;
        ``lagged_from_rollout``: the lagged policy is the rollout's, its means are read from ``rollout.means``."""
        weights = self._timestep_weights(rollout) if weights is None else weights
        device = rollout.latents.device
        # Once per update: group_advantages builds CPU tensors, the policy's ratio lives on the model's device.
        advantages = replace(advantages, values=advantages.values.to(device), valid=advantages.valid.to(device))
        transitions = self._transitions(rollout) if transitions is None else transitions
        references_of = self._reference_means(rollout, transitions, lagged_from_rollout=lagged_from_rollout)
        for transition, references in zip(transitions, references_of):
            if self.weight_gradients is not None:  # the same micro-step again, differentiated in weight space
                terms = self._micro_step(
                    rollout, advantages, weights, transition, references, self.weight_gradients.module
                )
                self.weight_gradients.add(terms.policy, terms.kl)
            yield self._micro_step(rollout, advantages, weights, transition, references)

    def iteration_flops(self, rollout) -> float:
        """Model FLOPs of one iteration on this rank (``core.flops``): the rollout's forwards, then per trained
        transition the policy's forward and backward (3 forwards) and the anchor and lagged forwards (the latter on the
        last rollout's updates that did not read the rollout's means)."""
        forward = model_forward_flops(self.engine.module, self.adapter)
        references = (self.anchor is not None) + (self.lagged is not None) * self.lagged_forward_share
        generated = rollout.num_samples * len(rollout.step_etas)
        trained = rollout.num_samples * int(rollout.trained_steps.sum())
        return forward * (generated + trained * (3 + references))

    def mfu(self, rollout, seconds: float) -> float | None:
        """Estimated model FLOPs utilisation of an iteration that took ``seconds``; None off a known GPU. The K ranks
        of a sequence-parallel group share each sample's FLOPs, which ``iteration_flops`` counts whole."""
        peak = flops.peak_flops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
        if peak is None:
            return None
        return flops.mfu(self.iteration_flops(rollout), seconds, peak, devices=self.parallel.sequence_parallel_size)

    @contextmanager
    def ema_swapped_in(self):
        """Within the block the policy module computes with the EMA weights (no-grad use only: evaluation, sampling,
        export); the training weights are restored on exit. Without ``update.ema_decay`` it changes nothing."""
        if self.ema is None:
            yield
            return
        with self.ema.swapped_in():
            yield

    def _strength_measurable(self) -> bool:
        """Whether the next update's gradient ratio says how strong the trust region is: not when a KL reference
        equals the policy (the initial weights, or an anchor refreshed after the last update), where its KL and
        gradient are exactly 0. The same on every rank (it follows the all-reduced update count)."""
        if self.trust.strategy is KLStrategy.NONE:
            return False
        anchor_fresh = self.anchor is not None and (self.updates_done == 0 or self.trust.refresh_due(self.updates_done))
        lagged_fresh = self.lagged is not None and self.updates_done == 0
        return not (anchor_fresh or lagged_fresh)

    def _transitions(self, rollout) -> list[Transition]:
        """Every micro-step of this rollout in training order: its (chunk, timestep) pairs shuffled (seeded by the
        update count, so a resumed run repeats the order), grouped ``transitions_per_micro_step`` to a forward."""
        # The rollout's own transformer batches: the same batch composition reproduces its log-probs bit for bit.
        steps = [int(t) for t in torch.nonzero(rollout.trained_steps.cpu()).flatten()]
        pairs = [Transition(chunk, step) for chunk in rollout.batches for step in steps]
        generator = torch.Generator().manual_seed(self.seed + self.updates_done)
        shuffled = [pairs[i] for i in torch.randperm(len(pairs), generator=generator)]
        k = self.config.transitions_per_micro_step
        return [Transition.batched(shuffled[i : i + k]) for i in range(0, len(shuffled), k)]

    def _minibatches(self, rollout) -> list[list[Transition]]:
        micro_steps = self._transitions(rollout)
        size = len(micro_steps) // self.config.updates_per_rollout
        if size == 0 or len(micro_steps) % size:
            raise ValueError(
                f"{len(micro_steps)} micro-steps in this rollout do not split into "
                f"update.updates_per_rollout={self.config.updates_per_rollout} equal mini-batches"
            )
        return [micro_steps[i : i + size] for i in range(0, len(micro_steps), size)]

    def _timestep_weights(self, rollout) -> torch.Tensor:
        return timestep_weights(rollout, equalize=self.config.equalizer)

    def _reference_means(
        self, rollout, transitions: list[Transition], *, lagged_from_rollout: bool = False
    ) -> list[dict[str, torch.Tensor]]:
        """The anchor's and the lagged policy's means for each of one update's micro-steps, each forward batched as
        its micro-step. Neither moves until the update is applied, so each is swapped in once per update instead of
        twice per micro-step: under ZeRO-3 a swap releases every gathered parameter (the persistent small ones
        included), which the next forward gathers again. When the lagged policy is the rollout's
        (``lagged_from_rollout``), its means are the ones the rollout recorded: no forward."""
        means = [{} for _ in transitions]
        if lagged_from_rollout:
            for slot, transition in zip(means, transitions):
                slot["lagged_mean"] = recorded_means(rollout, transition)
        for name, copy in (("anchor_mean", self.anchor), ("lagged_mean", self.lagged)):
            if copy is None or name in means[0]:
                continue
            with torch.no_grad(), copy.swapped_in():
                for slot, transition in zip(means, transitions):
                    step = score_transition(
                        self.adapter, rollout, transition.samples, transition.step, module=self.engine
                    )
                    slot[name] = step.mean
        return means

    def _micro_step(
        self,
        rollout,
        advantages: Advantages,
        weights,
        transition: Transition,
        references: dict[str, torch.Tensor],
        module=None,
    ) -> LossTerms:
        index, t = transition.samples, transition.step
        step = score_transition(self.adapter, rollout, index, t, module=self.engine if module is None else module)
        device = rollout.latents.device
        on_device = index.to(device)
        if torch.is_tensor(t):  # batched pairs: each sample's own timestep and S_t
            old_log_prob, weight = rollout.log_probs[on_device, t.to(device)], weights[t].to(device)
        else:
            old_log_prob, weight = rollout.log_probs[on_device, t], float(weights[t])
        return micro_step_loss(
            step,
            old_log_prob.float(),
            advantages.values[on_device],
            advantages.valid[on_device].float(),
            weight,
            self.trust,
            self.controller.value,
            clip_range=self.config.clip_range,
            **references,
        )

    def _after_update(self, minibatch: _Totals) -> int:
        """Bookkeeping once an optimizer update's micro-steps are done; returns 1 if DeepSpeed skipped it."""
        if not self.engine.was_step_applied():  # the same on every rank: DeepSpeed all-reduces its overflow check
            self.skipped_updates += 1
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row >= self.config.max_skipped_updates:
                raise UserError(
                    f"the last {self.skipped_in_a_row} optimizer updates were all skipped for non-finite gradients "
                    "(DeepSpeed's OVERFLOW): nothing trains, so the run stops without an export; check "
                    "update.learning_rate and the rewards (update.max_skipped_updates sets the limit)"
                )
            return 1
        self.skipped_in_a_row = 0
        self.updates_done += 1
        minibatch.steps.append(self._step_sizes(minibatch.learning_rate))
        ratios = minibatch.gradients.ratios(self.controller.value, self.trust) if minibatch.gradients.rows else None
        in_weight_space = self.weight_gradients.ratio(self.controller.value) if self.weight_gradients else None
        if ratios is not None and in_weight_space is not None:
            ratios["weight_space"] = in_weight_space
        if ratios is not None:
            minibatch.ratios.append(ratios)
        # Both signals over all ranks, so every rank's controller (and checkpoint) agrees.
        kl = distributed.all_reduce_mean({"kl": minibatch.means().get("kl", 0.0)})["kl"]
        # The KL's gain per unit of learning rate (the last step's): lambda follows an lr warm-up or decay at once.
        lr, next_lr = (self.config.learning_rate_of(max(u, 1)) for u in (self.updates_done - 1, self.updates_done))
        self.controller.update(kl, None if ratios is None else ratios[""], lr=lr, next_lr=next_lr)
        if self.lagged is not None:
            self.lagged.commit()
        if self.anchor is not None and self.trust.refresh_due(self.updates_done):
            self.anchor.refresh()
        if self.ema is not None:
            self.ema.blend(self.config.ema_decay)
        return 0

    def _step_sizes(self, learning_rate: float) -> dict[str, float]:
        """The applied update's gradient RMS (against Adam's eps), its step per unit of ``learning_rate`` and each
        top-level module's share of it (``core.learning_diagnostics``), over every rank. Collective."""
        sizes: dict[str, float] = {}
        grad_norm = self.engine.get_global_grad_norm()  # before clipping, averaged over ranks and micro-steps
        if grad_norm is not None:
            sizes |= gradient_signals(
                float(grad_norm),
                self.weight_step.coordinates,
                # Under Muon DeepSpeed's norm is that of the orthogonalized updates, and eps is only the auxiliary
                # Adam's (biases, norms): no ratio to read.
                adam_eps=self.config.adam_eps if self.config.optimizer == "adamw" else None,
                gradient_clipping=self.config.gradient_clipping,
            )
        squared = self.weight_step.squared_change(self.engine.optimizer)
        if squared is not None:
            sizes |= step_signals(squared, self.weight_step.coordinates, learning_rate)
        return sizes

    def _learning_rate(self) -> float:
        """The scheduler's current rate: the next update's (read where DeepSpeed's engine.get_lr() reads it)."""
        return float(self.engine.optimizer.param_groups[0]["lr"])

    def _zero_variance_groups(self, advantages: Advantages) -> dict[str, float]:
        """The fraction of every rank's prompt groups whose rewards were all equal: no learning signal. Collective."""
        counts = distributed.all_reduce_sum(
            {"groups": advantages.groups, "zero_variance": advantages.zero_variance_groups}
        )
        return {"zero_variance_groups": counts["zero_variance"] / counts["groups"]} if counts["groups"] else {}

    def _metrics(self, totals: _Totals, weights, rollout, skipped: int) -> dict[str, float]:
        means = totals.means()
        first_max, means["first_micro_step/clip_fraction"] = totals.first_micro_steps()
        reused = self.config.updates_per_rollout > 1
        if not reused:
            # One update per rollout: every micro-step scores the rollout's own transitions with the weights that
            # sampled them (the optimizer applies only at the end), so the ratio is 1 and nothing is clipped. Logged,
            # ratio_mean == 1 and clip_fraction == 0 read like a bug; what can differ is whether the training forward
            # reproduces the rollout's log-probs (0 on CPU in float32; bf16 or a batched forward leave rounding), so
            # that is logged instead. Clipping acts only where it exceeds clip_range (log(1 + eps) ~ eps).
            means.pop("ratio_mean", None)
            means.pop("clip_fraction", None)
        metrics = distributed.all_reduce_mean(means)
        # The first update's first micro-step scores the rollout's transitions with its own weights (|ratio - 1| is
        # the forward's rounding); each later update's shows how far the updates before it moved the policy.
        metrics |= distributed.all_reduce_max({"first_micro_step/max_abs_ratio_minus_1": first_max})
        metrics |= mean_per_key(totals.steps)  # over the rollout's applied updates, already over all ranks
        ratio_min, ratio_max = totals.ratio_range()
        if reused:
            metrics["ratio_min"], metrics["ratio_max"] = ratio_min, ratio_max
        else:  # this rank's largest |log pi_train - log pi_rollout| over the update
            metrics["logprob_mismatch"] = max(_log_distance(ratio_min), _log_distance(ratio_max))
        for term, ratio in totals.ratio_means().items():  # already over all ranks
            metrics["kl_grad_ratio" + (f"/{term}" if term else "")] = ratio
        metrics["lambda_kl"] = totals.kl_weight
        grad_norm = self.engine.get_global_grad_norm()
        metrics["grad_norm"] = float("nan") if grad_norm is None else float(grad_norm)
        # As HF Trainer and torchtune log it: the scheduler's rate after this iteration's updates (the next update's).
        metrics["learning_rate"] = self._learning_rate()
        trained = weights[rollout.trained_steps.cpu()]
        metrics["equalizer_min"], metrics["equalizer_max"] = float(trained.min()), float(trained.max())
        metrics["skipped"] = float(skipped)
        metrics["skipped_updates"] = float(self.skipped_updates)
        metrics["updates_done"] = float(self.updates_done)
        metrics["anchor_refreshes"] = float(self.anchor.refreshes if self.anchor else 0)
        return metrics

    # -- state for checkpoints ----------------------------------------------------------------------------------------

    def state_problem(self, state: dict, step: int) -> str | None:
        """A value no update produces (``core.checkpoint_values``): lambda outside its range, a non-finite
        measurement or shard, a counter below 0."""
        lambda_range = (self.trust.kl_minimum or self.trust.kl_initial, self.trust.kl_maximum)
        return values_problem(UpdaterValues, state, "updater", lambda_range=lambda_range)

    def state_dict(self) -> dict:
        return {
            "updates_done": self.updates_done,
            "skipped_updates": self.skipped_updates,
            "controller": self.controller.state_dict(),
            "anchor": self.anchor.state_dict() if self.anchor else None,
            "lagged": self.lagged.state_dict() if self.lagged else None,
            "ema": self.ema.state_dict() if self.ema else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.updates_done = int(state["updates_done"])
        self.skipped_updates = int(state["skipped_updates"])
        self.controller.load_state_dict(state["controller"])
        if self.anchor is not None:
            self.anchor.load_state_dict(state["anchor"])
        if self.lagged is not None:
            self.lagged.load_state_dict(state["lagged"])
        if self.ema is not None:
            self._load_ema(state.get("ema"))

    def _load_ema(self, state: dict | None) -> None:
        if state is None:  # a checkpoint of a run without EMA: start the average at the restored weights
            logger.warning("update.ema_decay is set but the checkpoint has no EMA: it starts from the restored weights")
            self.ema.refresh()
        else:
            self.ema.load_state_dict(state)

    def load_resharded_state_dict(self, states: list[dict], rank: int, world: int) -> None:
        """The states every rank of a run on another number of ranks saved: the counters and the KL controller are
        the same on every rank (they follow all-reduced metrics), rank 0's are taken; the anchor, lagged and EMA shards
        are re-partitioned for this rank of ``world`` (``Anchor.load_resharded_state_dict``)."""
        self.updates_done = int(states[0]["updates_done"])
        self.skipped_updates = int(states[0]["skipped_updates"])
        self.controller.load_state_dict(states[0]["controller"])
        for name, copy in (("anchor", self.anchor), ("lagged", self.lagged)):
            if copy is not None:
                copy.load_resharded_state_dict([state[name] for state in states], rank, world)
        if self.ema is not None and states[0].get("ema") is not None:
            self.ema.load_resharded_state_dict([state["ema"] for state in states], rank, world)
        elif self.ema is not None:
            self._load_ema(None)


def clear_gradient_partitions(engine) -> None:
    """Zero ZeRO-3's gradient partitions before an optimizer update's first micro-step. DeepSpeed 0.19
    (``stage3.py``, ``partition_grads``) copies a parameter's gradient into its partition on micro-step 0, adds to it
    on later ones and never clears it: a parameter without a gradient on micro-step 0 (an expert of two-expert Wan 2.2
    whose transitions come later in the update, or not at all) would add to, or be stepped again with, the previous
    update's gradient. Under optimizer offload the boundary copies only the parameters used in the update into the
    fp32 gradients, so those are cleared too. One memset of this rank's partition; nothing on ZeRO-1/2."""
    optimizer = getattr(engine, "optimizer", None)
    flat = getattr(optimizer, "grad_partitions_flat_buffer", None)
    if flat is None:
        return
    flat.zero_()
    if getattr(optimizer, "offload_optimizer", False):
        for group in optimizer.fp32_partitioned_groups_flat:
            if group.grad is not None:
                group.grad.zero_()


def recorded_means(rollout, transition: Transition) -> torch.Tensor:
    """The means ``rollout`` recorded for ``transition``'s samples at its step(s), on the latents' device."""
    device = rollout.means.device
    samples, step = transition.samples.to(device), transition.step
    return rollout.means[samples, step.to(device) if torch.is_tensor(step) else step]


def _log_distance(ratio: float) -> float:
    """|log ratio|; inf for a ratio that underflowed to 0."""
    return math.inf if ratio == 0 else abs(math.log(ratio))


# ----------------------------------------------------------------------------------------------------------------
# Diagnostics
# ----------------------------------------------------------------------------------------------------------------


def model_forward_flops(module: torch.nn.Module, adapter) -> float:
    """FLOPs of one transformer call on one sample: its video tokens (latent size over the patch size) through
    ``core.flops.forward_flops_per_token``, twice with CFG (both branches run). Text tokens are left out: they are a
    few hundred against tens of thousands of video tokens at the paper's size."""
    config = getattr(module, "config", None) or {}
    patch, patch_t = config.get("patch_size", 1), config.get("patch_size_t", 1)
    # Wan's config holds its patch as one (frames, height, width) tuple; HunyuanVideo 1.5's as two numbers.
    p_t, p_h, p_w = patch if isinstance(patch, list | tuple) else (patch_t, patch, patch)
    _, frames, height, width = adapter.latent_shape()
    tokens = (frames // p_t) * (height // p_h) * (width // p_w)
    layers = config.get("num_layers", 0) + config.get("num_single_layers", 0)
    # Under ZeRO-3 a parameter's local tensor is empty; ds_numel is its whole size.
    parameters = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
    # A module of equal experts (two-expert Wan 2.2) runs one of them per forward.
    parameters //= getattr(module, "num_experts", 1)
    branches = 2 if getattr(adapter, "cfg_enabled", False) else 1
    return branches * tokens * flops.forward_flops_per_token(parameters, layers, flops.hidden_size(module) or 0, tokens)


def timestep_weights(rollout, *, equalize: bool) -> torch.Tensor:
    """Per-step loss weights: the equalizer's S_t over the trained steps, or 1 on them when it is off."""
    if not equalize:
        return rollout.trained_steps.cpu().float()
    return rollout.sde_config.step_weights(rollout.sigmas.cpu())
