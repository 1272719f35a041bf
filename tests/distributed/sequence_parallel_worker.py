"""One rollout and two GRPO updates of a tiny model under DeepSpeed ZeRO-3, with sequence parallelism of size K, run
by torchrun: world/K data-parallel groups, group d holding the prompts d, d + world/K, ... of ``PROMPTS`` (each
prompt's noise follows from its position), so two layouts with as many groups see the same samples.

Rank 0 writes what layouts with as many groups must agree on: every group's velocity of a batch and rollout latents
and log-probs, the full gradient of the first update (gathered from ZeRO-3 partitions), the update metrics and the
weights after it, in files named by ``layout_name``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from deepspeed.utils import safe_get_full_grad
from safetensors.torch import save_file

from sage_grpo.core import distributed
from sage_grpo.core.grpo import group_advantages
from sage_grpo.core.lora import LoraConfig, add_lora
from sage_grpo.core.models.tiny import tiny_hunyuan15, tiny_wan, tiny_wan22
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.engine import build_engine
from sage_grpo.stages.rollout import SDEConfig, generate
from sage_grpo.stages.update import UpdateConfig, Updater

PROMPTS = ["a red ball bouncing", "a blue car driving at night"]
SIGMAS = [0.9, 0.4]  # each prompt's noise level in the velocity check
GROUP_SIZE = 2
REWARDS = torch.tensor([[0.1, 0.9], [0.7, 0.2]])  # per prompt, per group member


def hunyuan15_odd_text(**kwargs):
    """The tiny HunyuanVideo 1.5 with 33 Qwen tokens: 45 text tokens in all, which K = 2 pads to 46."""
    adapter = tiny_hunyuan15(**kwargs)
    adapter.pipeline.tokenizer_max_length = 33
    return adapter


# Each model's factory and its first transformer block, where the tokens are split.
MODELS = {
    "hunyuan15": (hunyuan15_odd_text, "transformer_blocks.0"),
    "wan": (tiny_wan, "blocks.0"),
    "wan22": (tiny_wan22, "low.blocks.0"),  # two experts: the velocity's batch mixes both, the update trains both
}


def record_first_gradient(engine, into: dict[str, torch.Tensor]) -> None:
    """Have ``engine.step`` copy the full gradients at the first accumulation boundary, before the optimizer."""
    step = engine.step

    def recording_step():
        if engine.is_gradient_accumulation_boundary() and not into:
            for name, param in engine.module.named_parameters():
                gradient = safe_get_full_grad(param)  # a collective: every rank calls it
                if gradient is not None:
                    into[name] = gradient.detach().float().clone()
        step()

    engine.step = recording_step


def record_block_tokens(block: torch.nn.Module, into: list[int]) -> None:
    """Append the sequence length of the video tokens each call of ``block`` returns (this rank's share)."""

    def hook(module, inputs, output):
        into.append((output[0] if isinstance(output, tuple) else output).shape[1])

    block.register_forward_hook(hook)


def gathered_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        return {n: p.detach().float().clone() for n, p in params}


def layout_name(world: int, size: int, lora: bool) -> str:
    """The stem of a layout's result files: ``outputs_<stem>.safetensors`` and the like."""
    return f"world{world}_k{size}" + ("_lora" if lora else "")


def one_per_group(parallel: distributed.ParallelLayout, tensor: torch.Tensor) -> torch.Tensor:
    """Every data-parallel group's ``tensor`` (gathered to every rank), concatenated in group order."""
    return torch.cat(parallel.one_per_sequence_group(distributed.gather_or_raise(lambda: tensor)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sequence-parallel", type=int, required=True)
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters, not the whole transformer")
    args = parser.parse_args()

    distributed.init()
    parallel = distributed.ParallelLayout.build(args.sequence_parallel)
    torch.manual_seed(0)
    factory, first_block = MODELS[args.model]
    adapter = factory(guidance_scale=2.0, seed=0)  # CFG: two branches per forward
    if args.lora:  # the attention projections, as a run's lora section trains
        add_lora(adapter.transformer, LoraConfig(enabled=True, rank=4, alpha=8.0))
    else:
        adapter.transformer.requires_grad_(True)
    adapter.enable_sequence_parallel(parallel)  # after LoRA, as build_policy does
    block_tokens: list[int] = []
    record_block_tokens(adapter.transformer.get_submodule(first_block), block_tokens)

    mine = list(range(len(PROMPTS)))[parallel.data_parallel_rank :: parallel.data_parallel_size]
    prompts = [PROMPTS[i] for i in mine]
    embeddings = adapter.encode_prompts(prompts)
    noise = torch.cat(
        [torch.randn(1, *adapter.latent_shape(), generator=torch.Generator().manual_seed(i)) for i in mine]
    )
    with torch.no_grad():
        velocity = adapter.predict_velocity(noise, torch.tensor([SIGMAS[i] for i in mine]), embeddings)

    sde_config = SDEConfig(variant="sage", eta=0.7, steps=3, shift=3.0)
    rollout = generate(
        adapter, prompts, GROUP_SIZE, sde_config, seed=7, prompt_ids=mine, batch_size=1, decode=False, progress=False
    )
    advantages = group_advantages(REWARDS[mine].flatten(), rollout.group_ids)

    # LoRA at ten times full fine-tuning's rate, as LoRA runs train: the policy moves enough that the second update's
    # logprob_mismatch (a log-ratio, whose float error is the log-probs', ~1e-7) is compared at rel 1e-4.
    update_config = UpdateConfig(learning_rate=1e-2 if args.lora else 1e-3, micro_batch_size=1)
    trust_config = TrustRegionConfig(strategy="dual", anchor_interval=1)  # anchor and lagged-policy forwards
    trained = int(rollout.trained_steps.sum())
    engine = build_engine(
        adapter.transformer,
        update_config,
        accumulation_steps=update_config.accumulation_steps(rollout.num_samples, trained),
    )
    gradients: dict[str, torch.Tensor] = {}
    record_first_gradient(engine, gradients)
    updater = Updater(engine, adapter, update_config, trust_config, parallel=parallel)
    history = [updater.update(rollout, advantages) for _ in range(2)]
    weights = gathered_weights(engine.module)
    outputs = {
        "velocity": one_per_group(parallel, velocity),
        "latents": one_per_group(parallel, rollout.latents),
        "log_probs": one_per_group(parallel, rollout.log_probs),
    }

    if distributed.rank() == 0:
        out, name = Path(args.out), layout_name(distributed.world_size(), args.sequence_parallel, args.lora)
        save_file({k: v.contiguous() for k, v in outputs.items()}, str(out / f"outputs_{name}.safetensors"))
        save_file(gradients, str(out / f"gradients_{name}.safetensors"))
        save_file(weights, str(out / f"weights_{name}.safetensors"))
        report = {
            "history": history,
            "block_tokens": sorted(set(block_tokens)),
            "video_tokens": adapter.attention_layout()[1],
        }
        (out / f"report_{name}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    sys.exit(distributed.exit_launched(0))
