"""Per-GPU memory plan for a SAGE-GRPO run: model states under ZeRO/offload/LoRA, the KL anchor, activations.

Model states come from DeepSpeed's own estimators (``estimate_zero3_model_states_mem_needs`` and
``estimate_zero2_model_states_mem_needs``), applied to the trainable parameters; frozen base weights (LoRA) are added
as bf16 tensors placed the way the ZeRO stage places parameters. Activations are an estimate (see
``activation_bytes``), not a measurement: confirm a plan on one node before booking sixty-four.

``sagegrpo plan CONFIG [key=value ...]`` validates the config with the run schema (``pipeline.config``), so the
plan sees exactly the values (and defaults) a run would, and reads:

- ``model.name``: the HunyuanVideo 1.5 transformer (``hunyuan15``) and Wan (``wan``: one transformer, or Wan 2.2
  A14B's two experts, both counted, each step's expert by ``WanPipeline``'s boundary rule); tiny and other models are
  refused.
- ``model.pretrained``: when it is a local diffusers folder, ``transformer/config.json`` (and Wan's
  ``transformer_2/config.json`` and ``model_index.json``) give the architecture; otherwise diffusers' default config,
  which is the 8.3B release for HunyuanVideo 1.5 and the 14B for Wan (a Wan hub id must name A14B: both experts).
- ``model.train_experts`` (two-expert Wan): gradients, optimizer state and the anchor for the trained experts only.
- ``model.guidance_scale`` (1.0): above 1 the conditional and unconditional branches run as one batch, which doubles
  the activations.
- ``model.kwargs.num_frames`` / ``height`` / ``width`` (``VIDEO_DEFAULTS`` where unset: 81 x 480 x 848, Wan's
  81 x 480 x 832).
- ``lora``: validated by ``core.lora.LoraConfig``; the adapter is really attached, on the meta device, so the
  trainable count is peft's own.
- ``deepspeed.config`` (``zero3``): a name in ``deepspeed_configs/`` or a JSON path, for ``zero_optimization.stage``
  and the ``offload_optimizer`` / ``offload_param`` devices.
- ``update.micro_batch_size``, ``update.gradient_checkpointing``, ``trust_region.anchor_offload``.
- ``parallel.sequence_parallel_size`` (1; ``--sequence-parallel K`` replaces it): Ulysses sequence parallelism. Each
  rank of a group of K carries 1/K of a sequence's tokens through the blocks, so its activations shrink by about K;
  the rollout and the KL references do not (the K ranks of a group hold the same videos), and model states and the
  anchor are partitioned by ZeRO-3 over all GPUs, K or not.

Activations, the rollout, the KL references and the reserve are per GPU: more nodes do not shrink them, only the
ZeRO-partitioned states. So when a plan does not fit, the planner suggests (``suggest``) the smallest K on the same
GPUs first, and offload or more nodes only where those are what helps.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from sage_grpo.core.errors import UserError
from sage_grpo.stages import engine

GIB = 2**30
BF16_BYTES = 2
FP32_BYTES = 4

# Stored activations per token, per transformer block, in bytes per unit of hidden size: the 34*h of Korthikanti et
# al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 1) without its 5*a*s/h attention-score
# term, because SDPA's flash and memory-efficient kernels never materialise the score matrix. HunyuanVideo 1.5's
# blocks are dual-stream (text and video keep separate norms and MLPs, attention is joint), so every token, text or
# video, goes through one set of projections per block, as in that count.
ACTIVATION_BYTES_PER_HIDDEN = 34

# Text-side tokens the transformer concatenates to the video tokens: 1000 Qwen2.5-VL positions, 256 ByT5 positions and
# 729 SigLIP image slots (zeroed for text-to-video, but still in the sequence), the diffusers pipeline's padding.
HUNYUANVIDEO15_CONTEXT_TOKENS = 1000 + 256 + 729

# The video size the planner counts where the config's model.kwargs do not set it: the adapters' defaults
# (core/models/hunyuan15.py: 81 frames at the 480p release's size; core/models/wan.py).
VIDEO_DEFAULTS = {"num_frames": 81, "height": 480, "width": 848}
WAN_VIDEO_DEFAULTS = {"num_frames": 81, "height": 480, "width": 832}

# One token per 4 frames (keeping the first) and 16x16 pixels: HunyuanVideo 1.5's VAE compresses 4x in time and 16x
# in space with patch size 1, Wan's 4x and 8x with 2x2 patches.
VAE_TEMPORAL, VAE_SPATIAL = 4, 16

# Wan 2.2 T2V-A14B's published checkpoint (Wan-AI/Wan2.2-T2V-A14B-Diffusers), counted where model.pretrained is not
# a local folder: both experts have diffusers' default WanTransformer3DModel config (the 14B: 40 blocks of 40 heads
# of 128), switched at its model_index.json's boundary_ratio.
WAN22_A14B_BOUNDARY_RATIO = 0.875

# Memory outside model states and stored activations: CUDA context and NCCL buffers (~2-3 GiB), allocator
# fragmentation, the frozen VAE and reward model at rollout time, and the transient peak of the block being
# recomputed in backward. A default to refine with a profile, not a derivation.
DEFAULT_RESERVE_GB = 10.0


@dataclass(frozen=True)
class TransformerShape:
    """What the planner needs to know about a transformer, counted on the meta device."""

    param_count: int
    trainable_count: int
    largest_layer_params: int  # the most parameters ZeRO-3 gathers at once: a leaf block's, or one module's own
    hidden_size: int
    num_heads: int
    num_layers: int
    latent_channels: int
    patch: tuple[int, int, int] = (1, 1, 1)  # latent elements per token: (frames, height, width)


def hunyuanvideo15_shape(
    transformer_config: dict | None = None, lora_config=None, zero3_leaf_modules: str | list[str] = "auto"
) -> TransformerShape:
    """Count ``HunyuanVideo15Transformer3DModel`` built on the meta device: no weights are read or allocated.

    ``transformer_config`` overrides the diffusers defaults (the 8.3B release); ``lora_config`` (a
    ``core.lora.LoraConfig`` with ``enabled``) attaches the adapter so the trainable count is peft's;
    ``zero3_leaf_modules`` (``deepspeed.zero3_leaf_modules``) names the blocks ZeRO-3 gathers whole.
    """
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel

    from sage_grpo.core.lora import add_lora

    with torch.device("meta"):
        model = HunyuanVideo15Transformer3DModel.from_config(transformer_config or {})
    param_count = sum(p.numel() for p in model.parameters())
    largest = largest_gathered(model, zero3_leaf_modules)
    trainable_count = param_count
    if lora_config is not None and lora_config.enabled:
        add_lora(model, lora_config)
        trainable_count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return _shape(model.config, param_count, trainable_count, largest)


@dataclass(frozen=True)
class WanCheckpoint:
    """A Wan checkpoint's transformers by expert name, ``high`` and ``low`` (Wan 2.2 A14B's ``transformer`` and
    ``transformer_2``) or ``transformer`` alone, each's config; and the boundary between two experts."""

    experts: dict[str, dict]
    boundary_ratio: float | None = None


def wan_checkpoint(pretrained: str | None) -> WanCheckpoint:
    """The transformers of a local diffusers folder (its model_index.json says whether a ``transformer_2`` runs), or
    Wan 2.2 A14B's published configs for a hub id that names A14B."""
    folder = Path(pretrained or "")
    index = folder / "model_index.json"
    if pretrained and index.is_file():
        model_index = json.loads(index.read_text())
        read = lambda part: json.loads((folder / part / "config.json").read_text())  # noqa: E731
        if (model_index.get("transformer_2") or [None])[0] is None:
            return WanCheckpoint({"transformer": read("transformer")})
        return WanCheckpoint({"high": read("transformer"), "low": read("transformer_2")}, model_index["boundary_ratio"])
    if "a14b" in (pretrained or "").lower():
        return WanCheckpoint({"high": {}, "low": {}}, WAN22_A14B_BOUNDARY_RATIO)
    raise UserError(
        f"model.pretrained {pretrained!r}: the planner counts Wan from a local diffusers folder, or from Wan 2.2 "
        "A14B's published configs for a hub id naming A14B"
    )


def wan_shape(
    checkpoint: WanCheckpoint,
    lora_config=None,
    train_experts: list[str] | None = None,
    zero3_leaf_modules: str | list[str] = "auto",
) -> TransformerShape:
    """Count Wan's transformers built on the meta device, both experts of a two-expert checkpoint as the run holds
    them (``core.models.wan_experts.WanExperts``, one ZeRO-3 engine over both): the trainable count is the trained
    experts' (``train_experts``, None: all), their LoRA adapters' where ``lora_config`` is enabled; the largest
    gathered layer is one expert's block (a forward gathers only its expert)."""
    import torch
    from diffusers import WanTransformer3DModel

    from sage_grpo.core.lora import add_lora
    from sage_grpo.core.models.wan_experts import WanExperts

    with torch.device("meta"):
        experts = {name: WanTransformer3DModel.from_config(config) for name, config in checkpoint.experts.items()}
    model = WanExperts(experts["high"], experts["low"]) if len(experts) == 2 else experts["transformer"]
    param_count = sum(p.numel() for p in model.parameters())
    largest = largest_gathered(model, zero3_leaf_modules)
    trainable_count = 0
    for name in train_experts or experts:
        if lora_config is not None and lora_config.enabled:
            add_lora(experts[name], lora_config)
        trainable_count += sum(p.numel() for p in experts[name].parameters() if p.requires_grad)
    config = next(iter(experts.values())).config
    return _shape(config, param_count, trainable_count, largest, patch=tuple(config.patch_size))


def _shape(config, param_count: int, trainable_count: int, largest: int, **extra) -> TransformerShape:
    """The plan's view of a diffusers transformer config (one expert's, for Wan: the experts share it)."""
    return TransformerShape(
        param_count=param_count,
        trainable_count=trainable_count,
        largest_layer_params=largest,
        hidden_size=config.num_attention_heads * config.attention_head_dim,
        num_heads=config.num_attention_heads,
        num_layers=config.num_layers,
        latent_channels=config.out_channels or config.in_channels,
        **extra,
    )


@dataclass(frozen=True)
class Schedule:
    """Which expert runs each of the T steps of a run's schedule (``transformer`` throughout for one transformer), and
    which steps train (the SDE window, less the steps of experts ``model.train_experts`` leaves out)."""

    step_experts: tuple[str, ...]
    trained: tuple[bool, ...]

    @property
    def trained_count(self) -> int:
        return sum(self.trained)


def schedule(config, boundary_ratio: float | None = None) -> Schedule:
    """The schedule of a validated run config; with a ``boundary_ratio``, two experts split it by ``WanPipeline``'s
    rule (``core.models.wan.WanAdapter.expert_index``: ``high`` where the float32 timestep is at or above the
    boundary's), and a trained expert without a trained step is refused as the run refuses it
    (``stages.rollout.check_every_trained_expert_trains``)."""
    import torch

    from sage_grpo.core.sde import flow_match_sigmas

    sde = config.sde
    sigmas = flow_match_sigmas(sde.steps, sde.shift)
    if boundary_ratio is None:
        experts = ["transformer"] * sde.steps
    else:
        high = sigmas[:-1].to(torch.float32) * 1000 >= boundary_ratio * 1000
        experts = ["high" if is_high else "low" for is_high in high.tolist()]
    trained_experts = set(config.model.train_experts or experts)
    trained = [bool(on) and expert in trained_experts for on, expert in zip(sde.trained_steps_mask(sigmas), experts)]
    idle = sorted(trained_experts - {expert for expert, on in zip(experts, trained) if on})
    if boundary_ratio is not None and idle:
        raise UserError(
            f"the {idle[0]!r} expert is trained (model.train_experts) but no trained step of this schedule is its "
            f"(sde.window {sde.window}): leave it out of model.train_experts"
        )
    return Schedule(tuple(experts), tuple(trained))


def video_tokens(frames: int, height: int, width: int) -> int:
    """Tokens of one video: (frames-1)/4+1 latent frames of (H/16) x (W/16) patches."""
    if frames < 1 or (frames - 1) % VAE_TEMPORAL:
        raise UserError(f"frames must be 4k+1 for the VAE, got {frames}")
    if height % VAE_SPATIAL or width % VAE_SPATIAL:
        raise UserError(f"height and width must be multiples of {VAE_SPATIAL}, got {height}x{width}")
    return ((frames - 1) // VAE_TEMPORAL + 1) * (height // VAE_SPATIAL) * (width // VAE_SPATIAL)


def activation_bytes(tokens: int, batch: int, hidden_size: int, num_layers: int, grad_checkpointing: bool) -> int:
    """Activations kept for backward in one forward of ``batch`` sequences of ``tokens`` tokens.

    Without checkpointing every block keeps all of its activations. With per-block checkpointing only each block's
    bf16 input is kept, plus one block's full set while it is recomputed.
    """
    per_block = tokens * batch * hidden_size * ACTIVATION_BYTES_PER_HIDDEN
    if not grad_checkpointing:
        return num_layers * per_block
    return num_layers * tokens * batch * hidden_size * BF16_BYTES + per_block


@dataclass(frozen=True)
class ModelStates:
    """Bytes per GPU for parameters, gradients and optimizer state, and bytes per node of host memory."""

    params: int
    gradients: int
    optimizer: int
    cpu_per_node: int


def model_states(
    param_count: int,
    trainable_count: int,
    largest_layer_params: int,
    zero_stage: int,
    offload_optimizer: bool,
    offload_param: bool,
    gpus_per_node: int,
    nodes: int,
) -> ModelStates:
    """DeepSpeed's estimate for the trainable parameters, split into parameters, gradients and optimizer state,
    plus the frozen parameters as bf16 tensors placed like the stage places parameters.

    The split of DeepSpeed's per-parameter bytes: 2 for the bf16 weights, 12 for the fp32 master weights and Adam's two
    moments, the rest (4 under ZeRO-3, 6 under ZeRO-2) for gradients. ZeRO-3 also holds the largest layer gathered,
    which DeepSpeed counts at 4 bytes per parameter and which we book under parameters.
    """
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    if offload_param and not offload_optimizer:
        raise UserError("offload_param without offload_optimizer is not a setting DeepSpeed's estimator models")
    gpus = gpus_per_node * nodes
    frozen = param_count - trainable_count
    if engine.partitions_parameters(zero_stage):
        cpu, gpu, gathered = estimate_zero3_model_states_mem_needs(
            trainable_count,
            largest_layer_params,
            gpus_per_node,
            nodes,
            cpu_offload=offload_optimizer,
            cpu_offload_params=offload_param,
        )
        if offload_param:
            # Everything partitioned lives in host memory; each node holds its GPUs' shards of the frozen weights.
            params, gradients, optimizer = gathered, 0, 0
            cpu += BF16_BYTES * frozen * gpus_per_node // gpus
        elif offload_optimizer:
            params, gradients, optimizer = gpu, 0, 0
        else:
            gradients = 4 * trainable_count // gpus
            optimizer = 12 * trainable_count // gpus
            params = gpu - gradients - optimizer
        if not offload_param:
            params += BF16_BYTES * frozen // gpus
    elif zero_stage == 2:
        if offload_param:
            raise UserError("offload_param needs ZeRO stage 3: stage 2 keeps every parameter on every GPU")
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            trainable_count, gpus_per_node, nodes, cpu_offload=offload_optimizer
        )
        params = BF16_BYTES * param_count  # replicated, frozen weights included
        gradients = 0 if offload_optimizer else gpu - BF16_BYTES * trainable_count - 12 * trainable_count // gpus
        optimizer = 0 if offload_optimizer else 12 * trainable_count // gpus
    else:
        raise UserError(f"the planner models ZeRO stages 2 and 3 (DeepSpeed's estimators), got stage {zero_stage}")
    return ModelStates(params, gradients, optimizer, cpu)


def anchor_bytes(trainable_count: int, zero_stage: int, offload_param: bool, anchor_offload: bool, gpus: int) -> int:
    """GPU bytes of the moving KL anchor: a bf16 copy of each rank's own part of the trainable weights
    (stages/anchor.py). Full fine-tuning: all weights; LoRA: the adapter only. ZeRO-3 shards it like the parameters
    (in host memory under offload_param), ZeRO-2 replicates it; ``anchor_offload`` keeps it in host memory.
    """
    if anchor_offload or (engine.partitions_parameters(zero_stage) and offload_param):
        return 0
    return BF16_BYTES * trainable_count // (gpus if engine.partitions_parameters(zero_stage) else 1)


def largest_gathered(model, zero3_leaf_modules: str | list[str]) -> int:
    """The most parameters ZeRO-3 holds gathered at once: a leaf block's (all of its parameters) or, outside the
    leaves, one module's own."""
    leaves = engine.zero3_leaves(model, zero3_leaf_modules)
    inside = {id(module) for leaf in leaves for module in leaf.modules()}
    blocks = [sum(p.numel() for p in leaf.parameters()) for leaf in leaves]
    others = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules() if id(m) not in inside]
    return max(blocks + others)


def rollout_bytes(samples: int, steps: int, latent_elements: int, *, means: bool = False) -> int:
    """GPU bytes of one rank's rollout, held through its update: each sample's float32 latents before and after every
    step, and with ``means`` every step's mean too (recorded for the lagged reference: ``Updater.reads_rollout_means``,
    stages/rollout.py)."""
    return FP32_BYTES * latent_elements * samples * (steps + 1 + (steps if means else 0))


def reference_bytes(transitions_per_update: int, latent_elements: int, references: int) -> int:
    """GPU bytes of the KL references held through one optimizer update: the anchor's and the lagged policy's float32
    means of each of its transitions (samples x trained steps / updates_per_rollout), computed before its first
    backward so that each is swapped in once per update (stages/update.py)."""
    return FP32_BYTES * latent_elements * transitions_per_update * references


@dataclass(frozen=True)
class Workload:
    """What a run puts on each GPU whatever its layout: the model, one forward's sequences, one rank's rollout.

    ``batch`` is the sequences in one transformer call (micro-batch x CFG branches); ``rollout`` and ``references``
    are the bytes of ``rollout_bytes`` and ``reference_bytes``, whole on every rank of a sequence-parallel group
    (the transformer splits its tokens inside its forward and gathers its output, so the latents stay whole).
    """

    shape: TransformerShape
    lora: bool
    frames: int
    height: int
    width: int
    context_tokens: int = HUNYUANVIDEO15_CONTEXT_TOKENS
    batch: int = 1
    anchor_offload: bool = False
    rollout: int = 0
    references: int = 0
    reserve_gb: float = DEFAULT_RESERVE_GB

    @property
    def video_tokens(self) -> int:
        return video_tokens(self.frames, self.height, self.width)


@dataclass(frozen=True)
class Layout:
    """The GPUs and the settings the planner may change to make a run fit."""

    gpus_per_node: int
    nodes: int
    gpu_mem_gb: float
    sequence_parallel: int = 1
    zero_stage: int = 3
    offload_optimizer: bool = False
    offload_param: bool = False
    grad_checkpointing: bool = True

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


def tokens_per_rank(workload: Workload, sequence_parallel: int) -> int:
    """Tokens one rank of a sequence-parallel group carries through the blocks: 1/K of the video and 1/K of the
    text, which the adapter pads with masked tokens to a multiple of K (``core.models.hunyuan15``)."""
    return workload.video_tokens // sequence_parallel + math.ceil(workload.context_tokens / sequence_parallel)


def check_sequence_parallel(workload: Workload, layout: Layout) -> None:
    """Refuse, in one line, a sequence-parallel size Ulysses cannot run: the run's own check on the heads and video
    tokens (``core.models.base.check_sequence_split``), and groups of K that tile the GPUs."""
    from sage_grpo.core.models.base import check_sequence_split

    k = layout.sequence_parallel
    if k < 1:
        raise UserError(f"parallel.sequence_parallel_size must be >= 1, got {k}")
    check_sequence_split(workload.shape.num_heads, workload.video_tokens, k)
    if layout.gpus % k:
        raise UserError(f"parallel.sequence_parallel_size={k} does not divide the {layout.gpus} GPUs")


def sequence_parallel_sizes(workload: Workload, gpus_per_node: int) -> list[int]:
    """The sizes the planner suggests, smallest first: those Ulysses runs whose groups stay inside one node (an
    all-to-all across nodes runs at network speed on every attention)."""
    heads, tokens = workload.shape.num_heads, workload.video_tokens
    return [k for k in range(1, heads + 1) if not heads % k and not tokens % k and not gpus_per_node % k]


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU bytes of a workload on a layout; ``str(plan)`` is what ``sagegrpo plan`` prints.

    ``suggestions``: what fits instead when the plan does not (see ``suggest``), or the smallest sequence-parallel
    size and fewest nodes that also fit when it does.
    """

    workload: Workload
    layout: Layout
    states: ModelStates
    anchor: int
    activations_with_checkpointing: int
    activations_without_checkpointing: int
    suggestions: tuple[Suggestion, ...] = ()

    @property
    def tokens_per_rank(self) -> int:
        return tokens_per_rank(self.workload, self.layout.sequence_parallel)

    @property
    def activations(self) -> int:
        if self.layout.grad_checkpointing:
            return self.activations_with_checkpointing
        return self.activations_without_checkpointing

    @property
    def reserve(self) -> int:
        return int(self.workload.reserve_gb * GIB)

    @property
    def per_gpu(self) -> int:
        """What no node count shrinks: everything but the ZeRO-partitioned model states and anchor."""
        return self.activations + self.workload.rollout + self.workload.references + self.reserve

    @property
    def total(self) -> int:
        s = self.states
        return s.params + s.gradients + s.optimizer + self.anchor + self.per_gpu

    @property
    def fits(self) -> bool:
        return self.total <= self.layout.gpu_mem_gb * GIB

    def __str__(self) -> str:
        work, layout, shape = self.workload, self.layout, self.workload.shape
        gb = lambda n: f"{n / GIB:8.2f} GB"
        k = layout.sequence_parallel
        offload = [
            name for name, on in (("optimizer", layout.offload_optimizer), ("params", layout.offload_param)) if on
        ]
        mode = f"LoRA ({shape.trainable_count / 1e6:.1f}M trainable)" if work.lora else "full fine-tuning"
        checkpointing = "on" if layout.grad_checkpointing else "off"
        verdict = "fits" if self.fits else "does NOT fit"
        alternative = (
            self.activations_without_checkpointing if layout.grad_checkpointing else self.activations_with_checkpointing
        )
        lines = [
            f"model: {shape.param_count / 1e9:.2f}B parameters, {mode}",
            f"setup: {layout.nodes} node(s) x {layout.gpus_per_node} GPU(s) of {layout.gpu_mem_gb:g} GB, "
            f"ZeRO-{layout.zero_stage} over all {layout.gpus}, offload: {', '.join(offload) or 'none'}",
            f"video: {work.frames} frames {work.height}x{work.width} -> {work.video_tokens + work.context_tokens:,} "
            f"tokens per sequence ({work.video_tokens:,} video + {work.context_tokens:,} text), "
            f"{work.batch} sequence(s) per forward",
            f"sequence parallel: K={k}, {layout.gpus // k} group(s) of {k}; {self.tokens_per_rank:,} tokens per rank "
            f"(1/K of the video and of the text, padded to a multiple of K)",
            "per GPU:",
            f"  parameters     {gb(self.states.params)}",
            f"  gradients      {gb(self.states.gradients)}",
            f"  optimizer      {gb(self.states.optimizer)}",
            f"  KL anchor      {gb(self.anchor)}",
            f"  activations    {gb(self.activations)}  (gradient checkpointing {checkpointing}; "
            f"{'off' if layout.grad_checkpointing else 'on'}: {alternative / GIB:.2f} GB)",
            f"  rollout        {gb(work.rollout)}  (the latents of every step)",
            f"  KL references  {gb(work.references)}  (the anchor's and lagged policy's means for one update)",
            f"  reserve        {gb(self.reserve)}  (CUDA context, NCCL, fragmentation, VAE and reward model)",
            f"  total          {gb(self.total)}  of {layout.gpu_mem_gb:g} GB: {verdict}",
            f"host memory per node (DeepSpeed's estimate): {self.states.cpu_per_node / GIB:.2f} GB",
        ]
        return "\n".join(lines + self._advice())

    def _advice(self) -> list[str]:
        if self.fits:
            return [f"also fits: {s.change} ({s.plan.total / GIB:.2f} GB, {s.why})" for s in self.suggestions]
        if not self.suggestions:
            largest = sequence_parallel_sizes(self.workload, self.layout.gpus_per_node)[-1]
            least = dataclasses.replace(self.layout, sequence_parallel=largest, grad_checkpointing=True, **OFFLOAD)
            return [
                f"nothing fits: even at K={largest} with gradient checkpointing and zero3_offload a GPU needs "
                f"{budget(self.workload, least).total / GIB:.2f} GB, mostly activations, rollout, KL references and "
                "reserve, which more nodes do not shrink (lower the resolution, frames or micro-batch)"
            ]
        return ["what fits instead:"] + [
            f"  {s.change}: {s.plan.total / GIB:.2f} GB per GPU ({s.why})" for s in self.suggestions
        ]


@dataclass(frozen=True)
class Suggestion:
    """A layout that fits, as the changes that lead to it and what they cost."""

    change: str  # in the words of the command line and the config
    why: str
    plan: MemoryPlan


def budget(workload: Workload, layout: Layout) -> MemoryPlan:
    """The per-GPU bytes of ``workload`` on ``layout``, without suggestions. Model states and the anchor are
    partitioned over all GPUs by ZeRO-3; activations are those of one rank's share of the tokens."""
    if layout.gpus_per_node < 1 or layout.nodes < 1:
        raise UserError(f"--gpus-per-node and --nodes must be >= 1, got {layout.gpus_per_node} and {layout.nodes}")
    shape = workload.shape
    if not 0 < shape.trainable_count <= shape.param_count:
        raise UserError(f"trainable parameters ({shape.trainable_count}) must be in 1..{shape.param_count}")
    check_sequence_parallel(workload, layout)
    tokens = tokens_per_rank(workload, layout.sequence_parallel)
    activations = {
        ckpt: activation_bytes(tokens, workload.batch, shape.hidden_size, shape.num_layers, ckpt)
        for ckpt in (True, False)
    }
    return MemoryPlan(
        workload=workload,
        layout=layout,
        states=model_states(
            shape.param_count,
            shape.trainable_count,
            shape.largest_layer_params,
            layout.zero_stage,
            layout.offload_optimizer,
            layout.offload_param,
            layout.gpus_per_node,
            layout.nodes,
        ),
        anchor=anchor_bytes(
            shape.trainable_count, layout.zero_stage, layout.offload_param, workload.anchor_offload, layout.gpus
        ),
        activations_with_checkpointing=activations[True],
        activations_without_checkpointing=activations[False],
    )


# The largest setup the planner considers: its searches for what fits walk node counts one by one.
MAX_GPUS_PER_NODE, MAX_NODES = 64, 1024

# What DeepSpeed config the planner suggests for offload: deepspeed_configs/zero3_offload.json, optimizer and
# parameters in host memory.
OFFLOAD = {"zero_stage": 3, "offload_optimizer": True, "offload_param": True}


def plan(workload: Workload, layout: Layout, max_nodes: int = 1024) -> MemoryPlan:
    """``budget`` with ``suggest``'s suggestions."""
    return dataclasses.replace(budget(workload, layout), suggestions=suggest(workload, layout, max_nodes))


def suggest(workload: Workload, asked: Layout, max_nodes: int = 1024) -> tuple[Suggestion, ...]:
    """What fits instead of ``asked``, cheapest change first, from sizes K that ``sequence_parallel_sizes`` allows.

    On the same GPUs, the first that fits of: the smallest K (its price, an all-to-all per attention); then with
    gradient checkpointing on, if it was off (a recomputed forward). Only when neither fits, both of: ZeRO-3 with
    optimizer and parameters offloaded to host memory (``deepspeed.config=zero3_offload``) at the smallest K, and
    the fewest nodes (up to ``max_nodes``) at which some K fits. More nodes shrink only the partitioned states and
    anchor, never activations, the rollout or the references, so they are suggested only where that is enough.

    When ``asked`` fits: a smaller K and fewer nodes that also fit.
    """
    sizes = sequence_parallel_sizes(workload, asked.gpus_per_node)
    fitting = lambda layouts: next((p for p in (budget(workload, lay) for lay in layouts) if p.fits), None)
    at_sizes = lambda layout: [dataclasses.replace(layout, sequence_parallel=k) for k in sizes]
    if budget(workload, asked).fits:
        smaller = [dataclasses.replace(asked, sequence_parallel=k) for k in sizes if k < asked.sequence_parallel]
        fewer = [dataclasses.replace(asked, nodes=n) for n in range(1, asked.nodes)]
        found = [
            (fitting(smaller), "a smaller K: less all-to-all"),
            (fitting(fewer), "fewer nodes, fewer videos per iteration"),
        ]
    else:
        steps = [asked] + (
            [dataclasses.replace(asked, grad_checkpointing=True)] if not asked.grad_checkpointing else []
        )
        same_gpus = fitting(layout for step in steps for layout in at_sizes(step))
        if same_gpus is not None:
            return (_suggestion(asked, same_gpus, "on the same GPUs"),)
        offloaded = dataclasses.replace(steps[-1], **OFFLOAD)
        found = [
            (fitting(at_sizes(offloaded)), "optimizer and parameters in host memory: slower steps"),
            (_fewest_nodes(workload, steps[-1], sizes, max_nodes), "more GPUs for the ZeRO-partitioned states"),
        ]
    return tuple(_suggestion(asked, found_plan, why) for found_plan, why in found if found_plan is not None)


def _fewest_nodes(workload: Workload, layout: Layout, sizes: list[int], max_nodes: int) -> MemoryPlan | None:
    """The plan at the fewest nodes above ``layout``'s, and the smallest K there, that fits; None when not even
    ``max_nodes`` do (totals only fall with more nodes, so that one look settles it)."""
    fits_at = lambda nodes, k: budget(workload, dataclasses.replace(layout, nodes=nodes, sequence_parallel=k))
    if not any(fits_at(max_nodes, k).fits for k in sizes):
        return None
    candidates = (fits_at(n, k) for n in range(layout.nodes + 1, max_nodes + 1) for k in sizes)
    return next(p for p in candidates if p.fits)


def _suggestion(asked: Layout, found: MemoryPlan, why: str) -> Suggestion:
    """``found`` as the command-line and config changes that turn ``asked`` into its layout."""
    layout = found.layout
    changes = []
    if layout.sequence_parallel != asked.sequence_parallel:
        changes.append(f"--sequence-parallel {layout.sequence_parallel}")
    if layout.nodes != asked.nodes:
        changes.append(f"--nodes {layout.nodes}")
    if layout.grad_checkpointing != asked.grad_checkpointing:
        changes.append("update.gradient_checkpointing=true")
    zero = lambda lay: (lay.zero_stage, lay.offload_optimizer, lay.offload_param)
    if zero(layout) != zero(asked):
        changes.append("deepspeed.config=zero3_offload")
        why += f", {found.states.cpu_per_node / GIB:.0f} GB of host memory per node"
    return Suggestion(change=" ".join(changes), why=why, plan=found)


def _zero_settings(name_or_path: str) -> tuple[int, bool, bool]:
    """(stage, offload_optimizer, offload_param) of a DeepSpeed config, loaded and checked as a run loads it."""
    try:
        ds_config = engine.load_deepspeed_json(name_or_path)
    except ValueError as error:
        raise UserError(f"deepspeed.config {name_or_path}: {error}") from None
    zero = ds_config.get("zero_optimization", {})
    offloaded = lambda key: zero.get(key, {}).get("device", "none") != "none"
    return engine.zero_stage(ds_config), offloaded("offload_optimizer"), offloaded("offload_param")


def _transformer_config(pretrained: str | None) -> dict | None:
    """The transformer config of a local diffusers checkpoint; None (diffusers' defaults) for anything else."""
    config_path = Path(pretrained or "") / "transformer" / "config.json"
    if not pretrained or not config_path.is_file():
        return None
    return json.loads(config_path.read_text())


def plan_from_config(
    config_path: str | Path,
    gpus_per_node: int,
    nodes: int,
    gpu_mem_gb: float,
    overrides: list[str] = (),
    sequence_parallel: int | None = None,
) -> MemoryPlan:
    """The plan for a run config, validated by the run schema (``pipeline.config``) with ``key=value`` overrides;
    ``sequence_parallel`` (``--sequence-parallel``) replaces the config's ``parallel.sequence_parallel_size``."""
    from sage_grpo.pipeline.config import load_run_config

    return plan_for(load_run_config(config_path, overrides), gpus_per_node, nodes, gpu_mem_gb, sequence_parallel)


def model_family(config) -> str:
    """``hunyuan15`` or ``wan``: the transformers the planners model; UserError for any other model."""
    name = config.model.name.lower()
    if name in ("hunyuan15", "wan"):
        return name
    raise UserError(
        f"model.name {config.model.name!r}: the planner only models the HunyuanVideo 1.5 transformer (hunyuan15) "
        "and Wan (wan)"
    )


def plan_for(
    config, gpus_per_node: int, nodes: int, gpu_mem_gb: float, sequence_parallel: int | None = None
) -> MemoryPlan:
    """The plan, with suggestions, for a validated run config (``pipeline.config.RunConfig``)."""
    if not (1 <= gpus_per_node <= MAX_GPUS_PER_NODE and 1 <= nodes <= MAX_NODES):
        raise UserError(
            f"--gpus-per-node must be 1..{MAX_GPUS_PER_NODE} and --nodes 1..{MAX_NODES}, "
            f"got {gpus_per_node} and {nodes}"
        )
    model, update = config.model, config.update
    leaves = config.deepspeed.zero3_leaf_modules
    if model_family(config) == "wan":
        checkpoint = wan_checkpoint(model.pretrained)
        shape = wan_shape(checkpoint, config.lora, model.train_experts, leaves)
        steps, video, context = schedule(config, checkpoint.boundary_ratio), WAN_VIDEO_DEFAULTS, 0
    else:
        shape = hunyuanvideo15_shape(_transformer_config(model.pretrained), config.lora, leaves)
        steps, video, context = schedule(config), VIDEO_DEFAULTS, HUNYUANVIDEO15_CONTEXT_TOKENS
    zero_stage, offload_optimizer, offload_param = _zero_settings(config.deepspeed.config)
    video = {**video, **model.kwargs}
    frames, height, width = (int(video[key]) for key in ("num_frames", "height", "width"))
    cfg_branches = 2 if model.guidance_scale > 1 else 1
    samples = config.rollout.samples_per_rank
    latent_elements = shape.latent_channels * math.prod(shape.patch) * video_tokens(frames, height, width)
    trained = steps.trained_count * samples // update.updates_per_rollout
    region = config.trust_region
    lagged = region.uses_stepwise_kl and config.trust_region.velocity_estimator == "lagged"
    workload = Workload(
        shape=shape,
        lora=config.lora.enabled,
        frames=frames,
        height=height,
        width=width,
        context_tokens=context,
        batch=update.micro_batch_size * cfg_branches,
        anchor_offload=config.trust_region.anchor_offload,
        rollout=rollout_bytes(
            samples, config.sde.steps, latent_elements, means=lagged and update.updates_per_rollout > 1
        ),
        references=reference_bytes(trained, latent_elements, int(region.needs_anchor) + int(lagged)),
    )
    layout = Layout(
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        gpu_mem_gb=gpu_mem_gb,
        sequence_parallel=config.parallel.sequence_parallel_size if sequence_parallel is None else sequence_parallel,
        zero_stage=zero_stage,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        grad_checkpointing=update.gradient_checkpointing,
    )
    return plan(workload, layout)
