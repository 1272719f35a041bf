"""Per-rank peak memory of each phase of an iteration and the iteration's FLOPs, traced from the real model
(``core.memory_trace``): what ``sagegrpo plan`` prints after the hand formula of ``pipeline.memory_plan``.

Each phase's peak is what lives across the whole iteration (ZeRO-3's shards of parameters, gradients and optimizer
state and the gathered block, by DeepSpeed's estimators; the KL anchor; the frozen models where they live; a reserve
for the CUDA context, NCCL and fragmentation) plus what the phase holds and what its transformer calls add, traced:

- rollout step: the rollout's latents and one no-grad call (micro-batch x CFG branches);
- update micro-step: the rollout, the KL references, and the larger of a reference forward and the policy's
  forward and backward (gradient checkpointing and LoRA as configured);
- evaluation: one no-grad call at the evaluation's batch.

Not traced: VAE decode's and the reward model's activations (a tiled decode takes minutes on fake tensors; the
reward is a plugin); their weights are counted. FLOPs are the transformer's; a sequence-parallel rank does 1/K of
its group's.
"""

from __future__ import annotations

from dataclasses import dataclass

from sage_grpo.core import flops as flop_math
from sage_grpo.core import memory_trace
from sage_grpo.pipeline import memory_plan

GIB = memory_plan.GIB
# CUDA context (~0.5-1 GiB), NCCL buffers (~1-2 GiB) and allocator fragmentation: a default, not a measurement.
RESERVE_GB = 4.0
# The hand formula and the trace disagree when their activations differ by more than this fraction.
DISAGREEMENT = 0.15

# Published configs of the frozen models HunyuanVideo 1.5's pipeline and VideoAlign load, for counting their
# weights where the checkpoint is not a local folder: Qwen2.5-VL-7B-Instruct's text model, the glyph ByT5-small
# encoder (its d_model is the transformer's text_embed_2_dim), Qwen2-VL-2B-Instruct (VideoAlign's base).
QWEN25_VL_7B_TEXT = {
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
}
GLYPH_BYT5 = {"vocab_size": 384, "d_model": 1472, "d_ff": 3584, "num_layers": 12, "num_heads": 6, "d_kv": 64}
QWEN2_VL_2B = {
    "text_config": {
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
    },
    "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16, "mlp_ratio": 4},
    "tie_word_embeddings": True,
}


def frozen_parameter_counts(reward_names: list[str]) -> dict[str, int]:
    """Parameters of the frozen models a rank holds, counted on the meta device from their configs."""
    from diffusers import AutoencoderKLHunyuanVideo15
    from transformers import (
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        T5Config,
        T5EncoderModel,
    )

    count = memory_trace.parameter_count
    counts = {
        "text encoders": count(lambda: Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**QWEN25_VL_7B_TEXT)))
        + count(lambda: T5EncoderModel(T5Config(**GLYPH_BYT5, is_encoder_decoder=False))),
        "VAE": count(AutoencoderKLHunyuanVideo15),
    }
    if "videoalign" in reward_names:
        counts["reward (VideoAlign)"] = count(lambda: Qwen2VLForConditionalGeneration(Qwen2VLConfig(**QWEN2_VL_2B)))
    return counts


@dataclass(frozen=True)
class PhasePlan:
    """Per-rank bytes of each phase, what lives throughout, the iteration's FLOPs per rank, and the formula's plan."""

    formula: memory_plan.MemoryPlan
    resident: dict[str, int]
    phases: dict[str, int]
    rank_flops: float
    mfu: float
    peak_flops: float
    gpu_name: str
    update_transient: int

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def fits(self) -> bool:
        return self.peak <= self.formula.layout.gpu_mem_gb * GIB

    @property
    def seconds_per_iteration(self) -> float:
        return self.rank_flops / (self.mfu * self.peak_flops)

    @property
    def gpu_hours_per_iteration(self) -> float:
        return self.seconds_per_iteration * self.formula.layout.gpus / 3600

    @property
    def disagreement(self) -> float:
        """How far the hand formula's activations are from the traced update's, as a fraction of the traced."""
        return abs(self.formula.activations - self.update_transient) / self.update_transient

    def __str__(self) -> str:
        layout = self.formula.layout
        gb = lambda n: f"{n / GIB:8.2f} GB"  # noqa: E731
        lines = ["traced per rank (real modules on fake tensors, core/memory_trace.py):", "  lives throughout:"]
        lines += [f"    {name:<22}{gb(size)}" for name, size in self.resident.items()]
        lines.append("  peak per phase:")
        lines += [f"    {name:<22}{gb(size)}" for name, size in self.phases.items()]
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"  peak                  {gb(self.peak)}  of {layout.gpu_mem_gb:g} GB: {verdict}")
        lines.append("  not traced: VAE decode and reward activations (weights counted); host memory: decoded videos")
        agree = "disagree" if self.disagreement > DISAGREEMENT else "agree"
        lines.append(
            f"hand formula vs trace: update activations {self.formula.activations / GIB:.2f} GB vs "
            f"{self.update_transient / GIB:.2f} GB traced: they {agree} ({self.disagreement:.0%})"
        )
        lines.append(
            f"FLOPs per iteration: {self.rank_flops:.3g} per rank, {self.rank_flops * layout.gpus:.3g} over "
            f"{layout.gpus} GPUs (transformer; recomputation included)"
        )
        lines.append(
            f"at {self.mfu:.0%} MFU on {self.gpu_name} ({self.peak_flops / 1e12:g} TFLOP/s bf16): "
            f"{self.seconds_per_iteration:,.0f} s and {self.gpu_hours_per_iteration:,.1f} GPU-hours per iteration"
        )
        return "\n".join(lines)


def phase_plan(config, formula: memory_plan.MemoryPlan, *, mfu: float = 0.35, gpu_name: str = "H100") -> PhasePlan:
    """The traced plan of a validated run config on ``formula``'s layout (``memory_plan.plan_for``)."""
    from sage_grpo.core.errors import UserError

    peak_flops = flop_math.peak_flops(gpu_name)
    if peak_flops is None:
        raise UserError(f"--gpu {gpu_name}: unknown; one of {', '.join(flop_math.PEAK_BF16_FLOPS)}")
    if not 0 < mfu <= 1:
        raise UserError(f"--mfu must be in (0, 1], got {mfu}")
    work, layout, states = formula.workload, formula.layout, formula.states
    k = layout.sequence_parallel
    grid = (
        (work.frames - 1) // memory_plan.VAE_TEMPORAL + 1,
        work.height // memory_plan.VAE_SPATIAL,
        work.width // memory_plan.VAE_SPATIAL,
    )
    transformer = memory_plan._transformer_config(config.model.pretrained) or {}
    lora = config.lora if config.lora.enabled else None
    update = config.update
    batch = work.batch  # micro-batch x CFG branches: the rollout, reference, update and evaluation calls alike

    def traced(k_split: int, *, train: bool) -> memory_trace.StepTrace:
        call = memory_trace.TransformerCall(
            batch,
            grid,
            train=train,
            checkpointing=train and layout.grad_checkpointing,
            sequence_parallel=k_split,
        )
        return memory_trace.trace_hunyuanvideo15(transformer, call, lora_config=lora if train else None)

    forward, step = traced(k, train=False), traced(k, train=True)
    whole_forward, whole_step = (forward, step) if k == 1 else (traced(1, train=False), traced(1, train=True))
    dtype_bytes = 2 if config.model.dtype != "float32" else 4
    frozen = frozen_parameter_counts([spec.name for spec in config.rewards])
    if config.model.kwargs.get("offload_text_encoder"):
        frozen.pop("text encoders")
    resident = {
        "parameters (ZeRO)": states.params,
        "gradients (ZeRO)": states.gradients,
        "optimizer (ZeRO)": states.optimizer,
        "KL anchor": formula.anchor,
        **{name: count * dtype_bytes for name, count in frozen.items()},
        "reserve": int(RESERVE_GB * GIB),
    }
    base = sum(resident.values())
    phases = {
        "rollout step": base + work.rollout + forward.peak,
        "VAE decode": base + work.rollout,
        "scoring": base + work.rollout,
        "update micro-step": base + work.rollout + work.references + max(step.peak, forward.peak),
        "evaluation": base + forward.peak,
    }
    samples = config.rollout.samples_per_rank
    calls = samples // update.micro_batch_size
    trained = config.sde.trained_step_count
    references = _reference_count(config)
    group_flops = calls * (
        config.sde.steps * whole_forward.flops + trained * (whole_step.flops + references * whole_forward.flops)
    )
    return PhasePlan(
        formula=formula,
        resident=resident,
        phases=phases,
        rank_flops=group_flops / k,
        mfu=mfu,
        peak_flops=peak_flops,
        gpu_name=gpu_name,
        update_transient=step.peak,
    )


def _reference_count(config) -> int:
    """The KL references each trained transition's forward is joined by: the anchor's, the lagged policy's."""
    region = config.trust_region
    lagged = region.uses_stepwise_kl and config.trust_region.velocity_estimator == "lagged"
    return int(region.needs_anchor) + int(lagged)
