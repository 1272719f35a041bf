"""Per-rank peak memory of each phase of an iteration and the iteration's FLOPs, traced from the real model
(``core.memory_trace``): what ``sagegrpo plan`` prints after the hand formula of ``pipeline.memory_plan``.

Each phase's peak is what lives across the whole iteration (ZeRO-3's shards of parameters, gradients and optimizer
state and the gathered block, by DeepSpeed's estimators; the KL anchor; the frozen models where they live; a reserve
for the CUDA context, NCCL and fragmentation) plus what the phase holds and what its transformer calls add, traced:

- rollout step: the rollout's latents and one no-grad call (micro-batch x CFG branches), beside the scoring of
  the micro-batch before it (a worker thread scores each micro-batch while the next is generated and decoded);
- VAE decode: the rollout's latents and the model adapter's own ``decode`` of one micro-batch's final latents
  (``core.memory_trace.trace_*_decode``): HunyuanVideo 1.5's tiled as its adapter tiles it (diffusers' 256 x 256
  pixel tiles of every frame, decoded one after another and all kept until blended), Wan's untiled as its adapter
  decodes it, with the decoded video and its uint8 copy; beside the scoring, too;
- scoring: the rollout's latents and, with VideoAlign configured, one no-grad forward of its Qwen2-VL-2B at its
  released config on a micro-batch's videos, sampled and resized by VideoAlign's rules
  (``core.memory_trace.trace_videoalign``);
- update micro-step: the rollout, the KL references, and the larger of a reference forward and the policy's
  forward and backward (gradient checkpointing and LoRA as configured);
- evaluation: the largest of one no-grad call at the run's batch, a decode and the scoring (one after another).

Two-expert Wan 2.2 A14B: both experts' ZeRO-3 shards live throughout (one engine holds both); each step's call is
its expert's (``WanPipeline``'s boundary rule), traced with the other expert built beside it, so the trace shows what
a forward gathers: its own expert's parameters only. Only the trained experts' steps train (``model.train_experts``).

Not traced: a plugin reward (any reward but VideoAlign): neither its weights nor its activations; VideoAlign's
preprocessing (the video on the GPU, its sampled frames resized). FLOPs are the transformer's, each step's expert's
(the decode's and the scoring's are left out); a sequence-parallel rank does 1/K of its group's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from sage_grpo.core import flops as flop_math
from sage_grpo.core import memory_trace
from sage_grpo.pipeline import memory_plan
from sage_grpo.stages import engine

GIB, BF16_BYTES = memory_plan.GIB, memory_plan.BF16_BYTES
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


# HunyuanVideo 1.5 renders 24 frames per second (``VideoModelAdapter.fps``), the rate a reward samples frames by.
HUNYUANVIDEO15_FPS = 24

# Wan's text encoder, UMT5-XXL's encoder (google/umt5-xxl, the text_encoder of every Wan 2.1 / 2.2 diffusers
# checkpoint), counted from its published config; Wan 2.2 A14B's VAE is Wan 2.1's, diffusers' AutoencoderKLWan defaults.
UMT5_XXL = {
    "vocab_size": 256384,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "feed_forward_proj": "gated-gelu",
    "tie_word_embeddings": False,
}


def wan_frozen_parameter_counts(reward_names: list[str]) -> dict[str, int]:
    """Parameters of the frozen models a Wan rank holds, counted on the meta device from their configs."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    count = memory_trace.parameter_count
    counts = {
        "text encoders": count(lambda: UMT5EncoderModel(UMT5Config(**UMT5_XXL, is_encoder_decoder=False))),
        "VAE": count(AutoencoderKLWan),
    }
    return counts | _reward_counts(reward_names)


def _reward_counts(reward_names: list[str]) -> dict[str, int]:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    if "videoalign" not in reward_names:
        return {}
    model = lambda: Qwen2VLForConditionalGeneration(Qwen2VLConfig(**QWEN2_VL_2B))  # noqa: E731
    return {"reward (VideoAlign)": memory_trace.parameter_count(model)}


def frozen_parameter_counts(reward_names: list[str]) -> dict[str, int]:
    """Parameters of the frozen models a rank holds, counted on the meta device from their configs."""
    from diffusers import AutoencoderKLHunyuanVideo15
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    count = memory_trace.parameter_count
    counts = {
        "text encoders": count(lambda: Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**QWEN25_VL_7B_TEXT)))
        + count(lambda: T5EncoderModel(T5Config(**GLYPH_BYT5, is_encoder_decoder=False))),
        "VAE": count(AutoencoderKLHunyuanVideo15),
    }
    return counts | _reward_counts(reward_names)


@dataclass(frozen=True)
class ExpertPlan:
    """Two-expert Wan 2.2 A14B: the steps each expert runs and trains, the parameters one forward gathers (its step's
    expert only: ZeRO-3 gathers what a forward reads, block by block), and the bytes per rank that offloading the
    idle expert would save: its bf16 parameter shard (its gradients and optimizer state, if it trains, join every
    optimizer step). No option offloads it: both stay resident."""

    steps: dict[str, int]
    trained_steps: dict[str, int]
    gathered: int
    idle_shard: int

    def lines(self, peak: int, gpu_mem_gb: float) -> list[str]:
        runs = ", ".join(f"{name} {self.steps[name]} steps ({self.trained_steps[name]} trained)" for name in self.steps)
        offloaded = peak - self.idle_shard
        verdict = "fits" if offloaded <= gpu_mem_gb * GIB else "does NOT fit"
        return [
            f"  experts: both resident (their ZeRO shards are counted above); {runs}",
            f"  a forward gathers only its step's expert: {self.gathered / GIB:.2f} GB of parameters read, block by "
            "block; the other expert's stay sharded",
            f"  idle expert offloaded (NOT implemented: no option does it): would save its {self.idle_shard / GIB:.2f} "
            f"GB parameter shard per rank, peak {offloaded / GIB:.2f} GB: {verdict}",
        ]


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
    experts: ExpertPlan | None = None
    untraced_rewards: list[str] = field(default_factory=list)

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
        if self.experts is not None:
            lines += self.experts.lines(self.peak, layout.gpu_mem_gb)
        plugins = ", ".join(self.untraced_rewards)
        plugins = f"reward {plugins} (a plugin: neither its weights nor its activations); " if plugins else ""
        lines.append(f"  not traced: {plugins}reward preprocessing (frames resized); host memory: decoded videos")
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
    model = _TracedModel.of(config, formula)
    forward = {name: model.trace(name, k, train=False) for name in model.running}
    step = {name: model.trace(name, k, train=True) for name in model.trained}
    whole_forward = forward if k == 1 else {name: model.trace(name, 1, train=False) for name in model.running}
    whole_step = step if k == 1 else {name: model.trace(name, 1, train=True) for name in model.trained}
    forward_peak = max(trace.peak for trace in forward.values())
    step_peak = max(trace.peak for trace in step.values())
    dtype_bytes = 2 if config.model.dtype != "float32" else 4
    rewards = [spec.name for spec in config.rewards]
    if model.family == "wan":
        # Wan's VAE runs in float32 whatever the model's dtype (core/models/wan.py).
        frozen, float32 = wan_frozen_parameter_counts(rewards), {"VAE"}
    else:
        frozen, float32 = frozen_parameter_counts(rewards), set()
    if config.model.kwargs.get("offload_text_encoder"):
        frozen.pop("text encoders")
    resident = {
        "parameters (ZeRO)": states.params,
        "gradients (ZeRO)": states.gradients,
        "optimizer (ZeRO)": states.optimizer,
        "KL anchor": formula.anchor,
        **{name: count * (4 if name in float32 else dtype_bytes) for name, count in frozen.items()},
        "reserve": int(RESERVE_GB * GIB),
    }
    base = sum(resident.values())
    decode_peak = model.trace_decode(config.update.micro_batch_size).peak
    scoring = _videoalign_scoring(config, (work.frames, work.height, work.width), model.fps)
    # A micro-batch is scored in a worker thread while the next is generated and decoded (stages/score.py).
    scoring_peak = 0 if scoring is None else scoring.peak
    phases = {
        "rollout step": base + work.rollout + forward_peak + scoring_peak,
        "VAE decode": base + work.rollout + decode_peak + scoring_peak,
        "scoring": base + work.rollout + scoring_peak,
        "update micro-step": base + work.rollout + work.references + max(step_peak, forward_peak),
        "evaluation": base + max(forward_peak, decode_peak, scoring_peak),
    }
    calls = config.rollout.samples_per_rank // config.update.micro_batch_size
    references = _reference_count(config)
    group_flops = 0
    for expert, trained in zip(model.schedule.step_experts, model.schedule.trained):
        group_flops += whole_forward[expert].flops
        if trained:
            group_flops += whole_step[expert].flops + references * whole_forward[expert].flops
    group_flops *= calls
    return PhasePlan(
        formula=formula,
        resident=resident,
        phases=phases,
        rank_flops=group_flops / k,
        mfu=mfu,
        peak_flops=peak_flops,
        gpu_name=gpu_name,
        update_transient=step_peak,
        experts=model.expert_plan(forward, layout) if len(model.running) > 1 else None,
        untraced_rewards=[spec.name for spec in config.rewards if spec.name != "videoalign"],
    )


def _videoalign_scoring(config, video: tuple[int, int, int], fps: int) -> memory_trace.StepTrace | None:
    """One VideoAlign call on a micro-batch's videos (``video``: frames, height, width), in sub-batches of the
    reward's ``batch_size``, Qwen2-VL-2B at its released config; None when VideoAlign is not configured."""
    spec = next((spec for spec in config.rewards if spec.name == "videoalign"), None)
    if spec is None:
        return None
    micro_batch = config.update.micro_batch_size
    call = memory_trace.videoalign_call(min(spec.batch_size or micro_batch, micro_batch), video, fps, spec.kwargs)
    return memory_trace.trace_videoalign(QWEN2_VL_2B, call)


@dataclass
class _TracedModel:
    """The run's transformer(s) as the trace builds them, and the steps each runs and trains."""

    family: str
    experts: dict[str, dict]  # expert name -> transformer config
    schedule: memory_plan.Schedule
    grid: tuple[int, int, int]
    batch: int  # micro-batch x CFG branches: the rollout, reference, update and evaluation calls alike
    text_tokens: tuple[int, ...]
    checkpointing: bool
    lora: object
    param_count: int
    vae_config: dict
    vae_tiling: bool
    model_kwargs: dict
    _traces: dict = field(default_factory=dict)

    @classmethod
    def of(cls, config, formula: memory_plan.MemoryPlan) -> _TracedModel:
        work, shape = formula.workload, formula.workload.shape
        _, p_h, p_w = shape.patch
        grid = (
            (work.frames - 1) // memory_plan.VAE_TEMPORAL + 1,
            work.height // memory_plan.VAE_SPATIAL * p_h,
            work.width // memory_plan.VAE_SPATIAL * p_w,
        )
        family = memory_plan.model_family(config)
        if family == "wan":
            checkpoint = memory_plan.wan_checkpoint(config.model.pretrained)
            experts, boundary = checkpoint.experts, checkpoint.boundary_ratio
            text = (int(config.model.kwargs.get("max_sequence_length", memory_trace.WAN_TEXT_TOKENS)),)
        else:
            experts = {"transformer": memory_plan._transformer_config(config.model.pretrained) or {}}
            boundary, text = None, tuple(memory_trace.HUNYUANVIDEO15_TEXT_TOKENS.values())
        return cls(
            family=family,
            experts=experts,
            schedule=memory_plan.schedule(config, boundary),
            grid=grid,
            batch=work.batch,
            text_tokens=text,
            checkpointing=formula.layout.grad_checkpointing,
            lora=config.lora if config.lora.enabled else None,
            param_count=shape.param_count,
            vae_config=_vae_config(config.model.pretrained),
            # HunyuanVideo15Adapter.from_pretrained's vae_tiling (on by default); WanAdapter decodes untiled.
            vae_tiling=family != "wan" and bool(config.model.kwargs.get("vae_tiling", True)),
            model_kwargs=config.model.kwargs,
        )

    @property
    def fps(self) -> int:
        """The frame rate the scorer samples the videos at: the adapter's (``WanAdapter``'s ``fps`` kwarg)."""
        if self.family == "wan":
            from sage_grpo.core.models.wan import WanAdapter

            return self.model_kwargs.get("fps", memory_trace.init_defaults(WanAdapter)["fps"])
        return HUNYUANVIDEO15_FPS

    @property
    def running(self) -> list[str]:
        """The experts the rollout runs, in the order of their first step."""
        return list(dict.fromkeys(self.schedule.step_experts))

    @property
    def trained(self) -> list[str]:
        trained = [expert for expert, on in zip(self.schedule.step_experts, self.schedule.trained) if on]
        return list(dict.fromkeys(trained)) or self.running[:1]

    def trace(self, expert: str, k: int, *, train: bool) -> memory_trace.StepTrace:
        """One call of ``expert`` on 1/``k`` of the tokens, traced once per distinct expert config."""
        key = (json.dumps(self.experts[expert], sort_keys=True, default=str), k, train)
        if key not in self._traces:
            call = memory_trace.TransformerCall(
                self.batch,
                self.grid,
                train=train,
                checkpointing=train and self.checkpointing,
                sequence_parallel=k,
                text_tokens=self.text_tokens,
            )
            lora = self.lora if train else None
            if self.family == "wan":
                self._traces[key] = memory_trace.trace_wan(self.experts, call, expert=expert, lora_config=lora)
            else:
                self._traces[key] = memory_trace.trace_hunyuanvideo15(self.experts[expert], call, lora_config=lora)
        return self._traces[key]

    def trace_decode(self, batch: int) -> memory_trace.StepTrace:
        """One decode of ``batch`` samples' final latents, as the rollout decodes each micro-batch."""
        call = memory_trace.DecodeCall(batch, self.grid, tiling=self.vae_tiling)
        trace = memory_trace.trace_wan_decode if self.family == "wan" else memory_trace.trace_hunyuanvideo15_decode
        return trace(self.vae_config, call)

    def expert_plan(self, forward: dict[str, memory_trace.StepTrace], layout) -> ExpertPlan:
        shard = BF16_BYTES * self.param_count // len(self.experts)
        if engine.partitions_parameters(layout.zero_stage):
            shard = 0 if layout.offload_param else shard // layout.gpus
        steps = self.schedule.step_experts
        return ExpertPlan(
            steps={name: steps.count(name) for name in self.experts},
            trained_steps={
                name: sum(on for expert, on in zip(steps, self.schedule.trained) if expert == name)
                for name in self.experts
            },
            gathered=max(trace.gathered for trace in forward.values()),
            idle_shard=shard,
        )


def _vae_config(pretrained: str | None) -> dict:
    """The VAE config of a local diffusers checkpoint; for anything else diffusers' defaults (``{}``), which are the
    released VAEs' (HunyuanVideo 1.5's; Wan 2.1's, which Wan 2.2 A14B ships)."""
    path = Path(pretrained or "") / "vae" / "config.json"
    return json.loads(path.read_text()) if pretrained and path.is_file() else {}


def _reference_count(config) -> float:
    """The KL reference forwards each trained transition's forward is joined by, on average: the anchor's, and the
    lagged policy's except on the one update of U per rollout that reads it from the rollout's means (U > 1:
    ``Updater.reads_rollout_means``)."""
    region, updates = config.trust_region, config.update.updates_per_rollout
    lagged = region.uses_stepwise_kl and config.trust_region.velocity_estimator == "lagged"
    return int(region.needs_anchor) + int(lagged) * (1 - 1 / updates if updates > 1 else 1)
