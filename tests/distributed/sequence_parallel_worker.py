"""One rollout and two GRPO updates of a tiny model under DeepSpeed ZeRO-3, with sequence parallelism of size K, run
by torchrun with K processes (one sequence-parallel group, so every run sees the same samples).

Rank 0 writes what K = 1 and K = 2 must agree on: the velocity of a batch, the rollout's latents and log-probs, the
full gradient of the first update (gathered from ZeRO-3 partitions), the update metrics and the weights after it.
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
from sage_grpo.core.models.tiny import tiny_hunyuan15, tiny_wan, tiny_wan22
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.engine import build_engine
from sage_grpo.stages.rollout import SDEConfig, generate
from sage_grpo.stages.update import UpdateConfig, Updater

PROMPTS = ["a red ball bouncing", "a blue car driving at night"]
GROUP_SIZE = 2
REWARDS = torch.tensor([0.1, 0.9, 0.7, 0.2])


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    distributed.init()
    size = distributed.world_size()
    mesh = distributed.init_sequence_parallel(size)
    torch.manual_seed(0)
    factory, first_block = MODELS[args.model]
    adapter = factory(guidance_scale=2.0, seed=0)  # CFG: two branches per forward
    adapter.transformer.requires_grad_(True)
    if mesh is not None:
        adapter.enable_sequence_parallel(mesh)
    block_tokens: list[int] = []
    record_block_tokens(adapter.transformer.get_submodule(first_block), block_tokens)

    embeddings = adapter.encode_prompts(PROMPTS)
    noise = torch.randn(len(PROMPTS), *adapter.latent_shape(), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        velocity = adapter.predict_velocity(noise, torch.tensor([0.9, 0.4]), embeddings)

    sde_config = SDEConfig(variant="sage", eta=0.7, steps=3, shift=3.0)
    rollout = generate(adapter, PROMPTS, GROUP_SIZE, sde_config, seed=7, batch_size=1, decode=False, progress=False)
    advantages = group_advantages(REWARDS, rollout.group_ids)

    update_config = UpdateConfig(learning_rate=1e-3, micro_batch_size=1)
    trust_config = TrustRegionConfig(strategy="dual", anchor_interval=1)  # anchor and lagged-policy forwards
    trained = int(rollout.trained_steps.sum())
    engine = build_engine(
        adapter.transformer, update_config, accumulation_steps=update_config.accumulation_steps(4, trained)
    )
    gradients: dict[str, torch.Tensor] = {}
    record_first_gradient(engine, gradients)
    updater = Updater(engine, adapter, update_config, trust_config)
    history = [updater.update(rollout, advantages) for _ in range(2)]
    weights = gathered_weights(engine.module)

    if distributed.rank() == 0:
        out = Path(args.out)
        tensors = {"velocity": velocity, "latents": rollout.latents, "log_probs": rollout.log_probs}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"outputs_k{size}.safetensors"))
        save_file(gradients, str(out / f"gradients_k{size}.safetensors"))
        save_file(weights, str(out / f"weights_k{size}.safetensors"))
        report = {
            "history": history,
            "block_tokens": sorted(set(block_tokens)),
            "video_tokens": adapter.attention_layout()[1],
        }
        (out / f"report_k{size}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    sys.exit(distributed.exit_launched(0))
