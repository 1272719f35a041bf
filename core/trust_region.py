"""The dual trust region: its config section (``trust_region``), which KL terms a strategy uses, when the moving
anchor refreshes, and the controller of its weight lambda.

``shared/spec/sage-grpo.md`` section 4. The anchor's weights themselves live in ``stages/anchor.py``; how strong the
trust region is, measured on every update, in ``stages/update.py`` (``OutputGradients``) and docs/algorithm.md.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sage_grpo.core import distributed
from sage_grpo.core.errors import UserError
from sage_grpo.core.grpo import AdaptiveKLController, GradientRatioController, KLFeedback
from sage_grpo.core.lazy import lazy_module

torch = lazy_module("torch", globals())


class KLStrategy(str, Enum):
    NONE = "none"  # no KL term
    FIXED = "fixed"  # position KL to the initial model
    STEP_WISE = "step_wise"  # velocity KL to the rollout policy only
    MOVING = "moving"  # position KL to a moving anchor only
    DUAL = "dual"  # moving-anchor position KL + step-wise velocity KL (SAGE-GRPO)


# lambda's numbers per preset. "paper" is the appendix literally (lambda in [1e-7, 1e-5], KL target 1e-5): on our
# per-element-mean KL its gradient is ~1e-6 of the policy term's, so it is inert (docs/algorithm.md). "calibrated"
# (default) holds the measured gradient ratio at kl_ratio_target, lambda free over six decades.
KL_PRESETS: dict[str, dict[str, Any]] = {
    "calibrated": dict(
        kl_initial=0.1,
        kl_minimum=1e-4,
        kl_maximum=100.0,
        kl_warmup_steps=0,
        kl_history=10,
        kl_target=1e-3,
        kl_feedback=KLFeedback.GRADIENT_RATIO,
    ),
    "paper": dict(
        kl_initial=1e-7,
        kl_maximum=1e-5,
        kl_warmup_steps=100,
        kl_history=10,
        kl_target=1e-5,
        kl_feedback=KLFeedback.TOWARD_TARGET,
    ),
}


class TrustRegionConfig(BaseModel):
    """The trust region and its adaptive weight. ``preset`` fills the lambda keys left unset: ``calibrated``
    (default, acts) or ``paper`` (the appendix's numbers, inert on this objective); a key set explicitly wins."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    preset: Literal["calibrated", "paper"] = "calibrated"
    # moving, not the paper's dual: the velocity term changed nothing measurable on the ToyWorld and costs a
    # reference forward per micro-step (docs/algorithm.md, "The velocity term is off by default").
    strategy: KLStrategy = KLStrategy.MOVING
    position_weight: float = Field(1.0, ge=0)
    stepwise_weight: float = Field(0.1, ge=0)  # the reference code's weight of the velocity term
    # lagged: Gaussian mean KL to the policy one applied update behind (pi_{k-1}). rollout_logratio: the paper's
    # mean(logp_old - logp_new), identically 0 with one update per rollout (kept for parity; a no-op here).
    velocity_estimator: Literal["lagged", "rollout_logratio"] = "lagged"
    anchor_interval: int = Field(10, ge=1)  # N, the reference code's: the anchor refreshes every N updates
    anchor_offload: bool = False
    kl_initial: float = Field(gt=0)
    # lambda's floor under gradient_ratio feedback (the KL-steered feedbacks use kl_initial as theirs)
    kl_minimum: float | None = Field(None, gt=0)
    kl_maximum: float = Field(gt=0)
    kl_warmup_steps: int = Field(ge=0)
    kl_history: int = Field(ge=1)
    # The KL the toward_target / as_written feedbacks steer to (per element, in units of the step's variance).
    kl_target: float = Field(gt=0)
    # The update-level |lambda grad KL| / |grad policy| the gradient_ratio feedback holds (update/kl_grad_ratio): a
    # measured compromise between learning and drift (docs/algorithm.md, "How the target was chosen").
    kl_ratio_target: float = Field(0.003, gt=0)
    kl_feedback: KLFeedback
    # Also log update/kl_grad_ratio/weight_space, the same ratio on the trainable weights' gradients (what the optimizer
    # steps on): a second forward and two backward passes per micro-step of each measured update, and two float32
    # copies of the trainable weights' gradients; ZeRO-3's partitioned weights are refused (docs/algorithm.md).
    measure_weight_space: bool = False

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "kl_grad_ratio_every" in data:
                raise ValueError(
                    "kl_grad_ratio_every was removed: update/kl_grad_ratio is measured on every update at no extra "
                    "network pass; delete the key"
                )
            preset = data.get("preset", "calibrated")
            if preset in KL_PRESETS:
                data = KL_PRESETS[preset] | data
        return data

    @model_validator(mode="after")
    def _lambda_range(self) -> TrustRegionConfig:
        if not (self.kl_minimum or self.kl_initial) <= self.kl_initial <= self.kl_maximum:
            raise ValueError(
                f"need kl_minimum <= kl_initial <= kl_maximum, got {self.kl_minimum}, {self.kl_initial}, "
                f"{self.kl_maximum}"
            )
        return self

    @property
    def uses_position_kl(self) -> bool:
        return self.strategy in (KLStrategy.FIXED, KLStrategy.MOVING, KLStrategy.DUAL)

    @property
    def uses_stepwise_kl(self) -> bool:
        return self.strategy in (KLStrategy.STEP_WISE, KLStrategy.DUAL)

    @property
    def needs_anchor(self) -> bool:
        return self.uses_position_kl

    @property
    def anchor_moves(self) -> bool:
        return self.strategy in (KLStrategy.MOVING, KLStrategy.DUAL)

    def refresh_due(self, updates_done: int) -> bool:
        """True when the anchor must be re-copied from the policy after ``updates_done`` optimizer updates.

        Counted in absolute updates (N, 2N, ...), so a run whose length N does not divide, or a resumed run,
        refreshes at the same updates as an uninterrupted one. A fixed anchor never refreshes.
        """
        return self.anchor_moves and updates_done > 0 and updates_done % self.anchor_interval == 0

    def total_kl(self, position_kl, stepwise_kl):
        """position_weight * position KL + stepwise_weight * step-wise KL, over the terms the strategy uses."""
        total = 0.0
        if self.uses_position_kl:
            total = total + self.position_weight * position_kl
        if self.uses_stepwise_kl:
            total = total + self.stepwise_weight * stepwise_kl
        return total

    def controller(self) -> AdaptiveKLController | GradientRatioController:
        if self.kl_feedback is KLFeedback.GRADIENT_RATIO:
            return GradientRatioController(
                initial=self.kl_initial,
                minimum=self.kl_minimum or self.kl_initial,
                maximum=self.kl_maximum,
                target=self.kl_ratio_target,
                history=self.kl_history,
            )
        return AdaptiveKLController(
            initial=self.kl_initial,
            maximum=self.kl_maximum,
            warmup_steps=self.kl_warmup_steps,
            history=self.kl_history,
            target=self.kl_target,
            feedback=self.kl_feedback,
        )


class WeightGradients:
    """One optimizer update's gradients of the policy term and of the KL (unweighted by lambda) with respect to the
    trainable weights, summed over its micro-steps and over ranks: the weight-space counterpart of the output-space
    ``update/kl_grad_ratio``. Each micro-step is forwarded again through ``module`` with the weights as leaves of
    their own (``torch.func.functional_call``), so DeepSpeed's gradient hooks, which own the weights' ``.grad``, never
    see these backward passes; within an update the weights do not move, so it is the same function the engine
    differentiates."""

    def __init__(self, module: torch.nn.Module):
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if any(hasattr(p, "ds_tensor") for _, p in named):
            raise UserError(
                "trust_region.measure_weight_space needs each rank's whole trainable weights; ZeRO-3 partitions them "
                "(use deepspeed.config: zero2, or turn the measurement off)"
            )
        self._module = module
        self.leaves = {name: p.detach().requires_grad_() for name, p in named}
        self.sums: dict[str, list[torch.Tensor]] = {}

    def module(self, *args, **kwargs):
        """The policy module computing with the leaves: pass it where a module is expected (``module=``)."""
        return torch.func.functional_call(self._module, self.leaves, args, kwargs)

    def add(self, policy: torch.Tensor, kl: torch.Tensor) -> None:
        """Differentiate one micro-step's policy term and KL (both computed through :meth:`module`)."""
        leaves = list(self.leaves.values())
        for term, value in (("policy", policy), ("kl", kl)):
            if not (torch.is_tensor(value) and value.requires_grad):
                continue
            grads = torch.autograd.grad(value, leaves, retain_graph=term == "policy", allow_unused=True)
            sums = self.sums.setdefault(term, [torch.zeros_like(p, dtype=torch.float32) for p in leaves])
            for total, grad in zip(sums, grads):
                if grad is not None:
                    total += grad.float()

    def ratio(self, kl_weight: float) -> float | None:
        """|lambda sum grad KL| / |sum grad policy| over every rank; None without a policy gradient. Collective."""
        norms = {}
        for term in ("policy", "kl"):
            flat = torch.cat([g.flatten() for g in self.sums[term]]) if term in self.sums else torch.zeros(1)
            if distributed.world_size() > 1 and torch.distributed.is_initialized():
                flat = flat.to(distributed.device())
                torch.distributed.all_reduce(flat)  # the update's gradient sums every rank's micro-steps
            norms[term] = float(flat.double().norm())
        return kl_weight * norms["kl"] / norms["policy"] if norms["policy"] > 0 else None
