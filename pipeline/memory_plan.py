"""Per-GPU memory plan for a SAGE-GRPO run: model states under ZeRO/offload/LoRA, the KL anchor, activations.

Model states come from DeepSpeed's own estimators (``estimate_zero3_model_states_mem_needs`` and
``estimate_zero2_model_states_mem_needs``), applied to the trainable parameters; frozen base weights (LoRA) are added
as bf16 tensors placed the way the ZeRO stage places parameters. Activations are an estimate (see
``activation_bytes``), not a measurement: confirm a plan on one node before booking sixty-four.

``sagegrpo plan CONFIG [key=value ...]`` validates the config with the run schema (``pipeline.config``), so the
plan sees exactly the values (and defaults) a run would, and reads:

- ``model.name``: only the HunyuanVideo 1.5 transformer is modelled (``hunyuan15``); tiny and other models are refused.
- ``model.pretrained``: when it is a local diffusers folder, ``transformer/config.json`` gives the architecture;
  otherwise diffusers' default config, which is the 8.3B release, is counted.
- ``model.guidance_scale`` (1.0): above 1 the conditional and unconditional branches run as one batch, which doubles
  the activations.
- ``model.kwargs.num_frames`` / ``height`` / ``width`` (81 x 480 x 848, the adapter's 480p default).
- ``lora``: validated by ``core.lora.LoraConfig``; the adapter is really attached, on the meta device, so the
  trainable count is peft's own.
- ``deepspeed.config`` (``zero3``): a name in ``deepspeed_configs/`` or a JSON path, for ``zero_optimization.stage``
  and the ``offload_optimizer`` / ``offload_param`` devices.
- ``update.micro_batch_size``, ``update.gradient_checkpointing``, ``trust_region.anchor_offload``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from sage_grpo.core.errors import UserError

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

# The model's video size where its config's kwargs do not set it (core/models/hunyuan15.py's defaults).
VIDEO_DEFAULTS = {"num_frames": 81, "height": 480, "width": 848}

# HunyuanVideo 1.5's VAE compresses 4x in time (keeping the first frame) and 16x in space; the patch size is 1.
VAE_TEMPORAL, VAE_SPATIAL = 4, 16

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
    num_layers: int
    latent_channels: int


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
    config = model.config
    return TransformerShape(
        param_count=param_count,
        trainable_count=trainable_count,
        largest_layer_params=largest,
        hidden_size=config.num_attention_heads * config.attention_head_dim,
        num_layers=config.num_layers,
        latent_channels=config.out_channels or config.in_channels,
    )


def video_tokens(frames: int, height: int, width: int) -> int:
    """Latent tokens of one video: (frames-1)/4+1 latent frames of (H/16) x (W/16), patch size 1."""
    if frames < 1 or (frames - 1) % VAE_TEMPORAL:
        raise UserError(f"frames must be 4k+1 for HunyuanVideo 1.5's VAE, got {frames}")
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
    if zero_stage == 3:
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
    if anchor_offload or (zero_stage == 3 and offload_param):
        return 0
    return BF16_BYTES * trainable_count // (gpus if zero_stage == 3 else 1)


def largest_gathered(model, zero3_leaf_modules: str | list[str]) -> int:
    """The most parameters ZeRO-3 holds gathered at once: a leaf block's (all of its parameters) or, outside the
    leaves, one module's own."""
    from sage_grpo.stages.engine import zero3_leaves

    leaves = zero3_leaves(model, zero3_leaf_modules)
    inside = {id(module) for leaf in leaves for module in leaf.modules()}
    blocks = [sum(p.numel() for p in leaf.parameters()) for leaf in leaves]
    others = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules() if id(m) not in inside]
    return max(blocks + others)


def rollout_bytes(samples: int, steps: int, latent_elements: int) -> int:
    """GPU bytes of one rank's rollout, held through its update: each sample's float32 latents before and after every
    step (stages/rollout.py)."""
    return FP32_BYTES * latent_elements * samples * (steps + 1)


def reference_bytes(transitions_per_update: int, latent_elements: int, references: int) -> int:
    """GPU bytes of the KL references held through one optimizer update: the anchor's and the lagged policy's float32
    means of each of its transitions (samples x trained steps / updates_per_rollout), computed before its first
    backward so that each is swapped in once per update (stages/update.py)."""
    return FP32_BYTES * latent_elements * transitions_per_update * references


@dataclass(frozen=True)
class MemoryPlan:
    """A plan's inputs and per-GPU numbers (bytes); ``str(plan)`` is the table ``sagegrpo plan`` prints.
    ``min_nodes``: the smallest node count at which the same setup fits, None when none up to the search limit does."""

    param_count: int
    trainable_count: int
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    lora: bool
    gpus_per_node: int
    nodes: int
    gpu_mem_gb: float
    frames: int
    height: int
    width: int
    tokens: int
    batch: int
    grad_checkpointing: bool
    states: ModelStates
    anchor: int
    activations_with_checkpointing: int
    activations_without_checkpointing: int
    rollout: int
    references: int
    reserve: int
    min_nodes: int | None

    @property
    def activations(self) -> int:
        if self.grad_checkpointing:
            return self.activations_with_checkpointing
        return self.activations_without_checkpointing

    @property
    def total(self) -> int:
        s = self.states
        held = self.anchor + self.activations + self.rollout + self.references
        return s.params + s.gradients + s.optimizer + held + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_mem_gb * GIB

    def __str__(self) -> str:
        gb = lambda n: f"{n / GIB:8.2f} GB"
        offload = [name for name, on in (("optimizer", self.offload_optimizer), ("params", self.offload_param)) if on]
        mode = f"LoRA ({self.trainable_count / 1e6:.1f}M trainable)" if self.lora else "full fine-tuning"
        checkpointing = "on" if self.grad_checkpointing else "off"
        alternative = (
            self.activations_without_checkpointing if self.grad_checkpointing else self.activations_with_checkpointing
        )
        lines = [
            f"model: {self.param_count / 1e9:.2f}B parameters, {mode}",
            f"setup: {self.nodes} node(s) x {self.gpus_per_node} GPU(s) of {self.gpu_mem_gb:g} GB, "
            f"ZeRO-{self.zero_stage}"
            f", offload: {', '.join(offload) or 'none'}",
            f"video: {self.frames} frames {self.height}x{self.width} -> {self.tokens} tokens per sequence, "
            f"{self.batch} sequence(s) per forward",
            "per GPU:",
            f"  parameters     {gb(self.states.params)}",
            f"  gradients      {gb(self.states.gradients)}",
            f"  optimizer      {gb(self.states.optimizer)}",
            f"  KL anchor      {gb(self.anchor)}",
            f"  activations    {gb(self.activations)}  (gradient checkpointing {checkpointing}; "
            f"{'off' if self.grad_checkpointing else 'on'}: {alternative / GIB:.2f} GB)",
            f"  rollout        {gb(self.rollout)}  (the latents of every step)",
            f"  KL references  {gb(self.references)}  (the anchor's and lagged policy's means for one update)",
            f"  reserve        {gb(self.reserve)}  (CUDA context, NCCL, fragmentation, VAE and reward model)",
            f"  total          {gb(self.total)}  of {self.gpu_mem_gb:g} GB: {'fits' if self.fits else 'does NOT fit'}",
            f"host memory per node (DeepSpeed's estimate): {self.states.cpu_per_node / GIB:.2f} GB",
        ]
        if self.min_nodes is None:
            lines.append("smallest node count that fits: none (what more GPUs do not shrink already exceeds one)")
        else:
            lines.append(f"smallest node count that fits: {self.min_nodes}")
        return "\n".join(lines)


def plan(
    param_count: int,
    trainable_count: int,
    zero_stage: int,
    offload_optimizer: bool,
    offload_param: bool,
    lora: bool,
    gpus_per_node: int,
    nodes: int,
    gpu_mem_gb: float,
    frames: int,
    height: int,
    width: int,
    grad_checkpointing: bool,
    *,
    largest_layer_params: int,
    hidden_size: int,
    num_layers: int,
    context_tokens: int = HUNYUANVIDEO15_CONTEXT_TOKENS,
    batch: int = 1,
    anchor_offload: bool = False,
    rollout: int = 0,
    references: int = 0,
    reserve_gb: float = DEFAULT_RESERVE_GB,
    max_nodes: int = 1024,
) -> MemoryPlan:
    """Per-GPU memory for a run; ``batch`` is the sequences in one transformer call (micro-batch x CFG branches),
    ``rollout`` the bytes of one rank's rollout (``rollout_bytes``), ``references`` those of its KL references
    (``reference_bytes``).

    ``min_nodes`` is the smallest node count up to ``max_nodes`` at which the same setup fits. Only model states
    and the anchor shrink with more GPUs; activations, the rollout, the KL references and the reserve do
    not, so they alone can make it None.
    """
    if gpus_per_node < 1 or nodes < 1:
        raise UserError(f"--gpus-per-node and --nodes must be >= 1, got {gpus_per_node} and {nodes}")
    if not 0 < trainable_count <= param_count:
        raise UserError(f"trainable parameters ({trainable_count}) must be in 1..{param_count}")
    tokens = video_tokens(frames, height, width) + context_tokens
    activations = {ckpt: activation_bytes(tokens, batch, hidden_size, num_layers, ckpt) for ckpt in (True, False)}

    def at(node_count: int) -> MemoryPlan:
        return MemoryPlan(
            param_count=param_count,
            trainable_count=trainable_count,
            zero_stage=zero_stage,
            offload_optimizer=offload_optimizer,
            offload_param=offload_param,
            lora=lora,
            gpus_per_node=gpus_per_node,
            nodes=node_count,
            gpu_mem_gb=gpu_mem_gb,
            frames=frames,
            height=height,
            width=width,
            tokens=tokens,
            batch=batch,
            grad_checkpointing=grad_checkpointing,
            states=model_states(
                param_count,
                trainable_count,
                largest_layer_params,
                zero_stage,
                offload_optimizer,
                offload_param,
                gpus_per_node,
                node_count,
            ),
            anchor=anchor_bytes(trainable_count, zero_stage, offload_param, anchor_offload, gpus_per_node * node_count),
            activations_with_checkpointing=activations[True],
            activations_without_checkpointing=activations[False],
            rollout=rollout,
            references=references,
            reserve=int(reserve_gb * GIB),
            min_nodes=None,
        )

    min_nodes = next((n for n in range(1, max_nodes + 1) if at(n).fits), None)
    return dataclasses.replace(at(nodes), min_nodes=min_nodes)


def _zero_settings(name_or_path: str) -> tuple[int, bool, bool]:
    """(stage, offload_optimizer, offload_param) of a DeepSpeed config, found the way stages/engine.py finds it."""
    from sage_grpo.stages.engine import DEEPSPEED_CONFIGS

    path = Path(name_or_path)
    if not path.suffix:
        path = DEEPSPEED_CONFIGS / f"{name_or_path}.json"
    if not path.is_file():
        raise UserError(f"deepspeed.config {name_or_path}: {path} does not exist")
    zero = json.loads(path.read_text()).get("zero_optimization", {})
    offloaded = lambda key: (zero.get(key) or {}).get("device", "none") != "none"
    return int(zero.get("stage", 0)), offloaded("offload_optimizer"), offloaded("offload_param")


def _transformer_config(pretrained: str | None) -> dict | None:
    """The transformer config of a local diffusers checkpoint; None (diffusers' defaults) for anything else."""
    config_path = Path(pretrained or "") / "transformer" / "config.json"
    if not pretrained or not config_path.is_file():
        return None
    return json.loads(config_path.read_text())


def plan_from_config(
    config_path: str | Path, gpus_per_node: int, nodes: int, gpu_mem_gb: float, overrides: list[str] = ()
) -> MemoryPlan:
    """The plan for a run config, validated by the run schema (``pipeline.config``) with ``key=value`` overrides."""
    from sage_grpo.pipeline.config import load_run_config

    return plan_for(load_run_config(config_path, overrides), gpus_per_node, nodes, gpu_mem_gb)


def plan_for(config, gpus_per_node: int, nodes: int, gpu_mem_gb: float) -> MemoryPlan:
    """The plan for a validated run config (``pipeline.config.RunConfig``)."""
    model, update = config.model, config.update
    if "hunyuan" not in model.name.lower() or model.name.lower().startswith("tiny"):
        raise UserError(
            f"model.name {model.name!r}: the planner only models the HunyuanVideo 1.5 transformer (hunyuan15)"
        )
    shape = hunyuanvideo15_shape(
        _transformer_config(model.pretrained), config.lora, config.deepspeed.zero3_leaf_modules
    )
    zero_stage, offload_optimizer, offload_param = _zero_settings(config.deepspeed.config)
    video = model.kwargs
    frames, height, width = (
        int(video.get("num_frames", 81)),
        int(video.get("height", 480)),
        int(video.get("width", 848)),
    )
    cfg_branches = 2 if model.guidance_scale > 1 else 1
    samples = config.rollout.samples_per_rank
    latent_elements = shape.latent_channels * video_tokens(frames, height, width)
    rollout = rollout_bytes(samples, config.sde.steps, latent_elements)
    trained = config.sde.trained_step_count * samples // update.updates_per_rollout
    region = config.trust_region.region()
    lagged = region.uses_stepwise_kl and config.trust_region.velocity_estimator == "lagged"
    references = reference_bytes(trained, latent_elements, int(region.needs_anchor) + int(lagged))
    return plan(
        shape.param_count,
        shape.trainable_count,
        zero_stage,
        offload_optimizer,
        offload_param,
        config.lora.enabled,
        gpus_per_node,
        nodes,
        gpu_mem_gb,
        frames,
        height,
        width,
        update.gradient_checkpointing,
        largest_layer_params=shape.largest_layer_params,
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        batch=update.micro_batch_size * cfg_branches,
        anchor_offload=config.trust_region.anchor_offload,
        rollout=rollout,
        references=references,
    )
