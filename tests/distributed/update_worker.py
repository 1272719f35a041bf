"""One GRPO scenario on a tiny HunyuanVideo 1.5 under DeepSpeed, run by torchrun with 1 or 2 processes.

Every rank builds the same tiny model and the same rollout of all samples (determinism makes that cheap and exact),
then trains on its own slice, so a run with 2 ranks and a run with 1 see the same data. Rank 0 writes a JSON report
and the trainable weights (gathered from ZeRO-3 partitions) for the test to compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from sage_grpo.core import distributed
from sage_grpo.core.grpo import group_advantages
from sage_grpo.core.lora import LoraConfig, add_lora
from sage_grpo.core.models.tiny import tiny_hunyuan15
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.engine import build_engine
from sage_grpo.stages.rollout import SDEConfig, generate
from sage_grpo.stages.update import UpdateConfig, Updater

PROMPTS = ["a red ball bouncing", "a blue car driving at night"]
GROUP_SIZE = 2
REWARDS = [0.1, 0.9, 0.7, 0.2]


def gathered_state(module: torch.nn.Module, trainable: bool) -> dict[str, torch.Tensor]:
    import deepspeed

    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad == trainable]
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        return {n: p.detach().clone().float().contiguous() for n, p in params}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--nan-update", type=int, default=4, help="1-based update whose loss is NaN on the last rank")
    parser.add_argument("--deepspeed-config", default="zero3")
    args = parser.parse_args()

    distributed.init()
    rank, world = distributed.rank(), distributed.world_size()
    torch.manual_seed(0)
    adapter = tiny_hunyuan15(seed=0)
    if args.lora:
        add_lora(adapter.transformer, LoraConfig(enabled=True, rank=4, alpha=4.0))
    else:
        adapter.transformer.requires_grad_(True)

    sde_config = SDEConfig(variant="sage", eta=0.7, steps=4, shift=3.0)
    # Each rank rolls out its own prompts' groups; per-sample seeds make them the samples a single process draws.
    per_rank = len(PROMPTS) // world
    mine = list(range(rank * per_rank, (rank + 1) * per_rank))
    local_rollout = generate(
        adapter, [PROMPTS[i] for i in mine], GROUP_SIZE, sde_config, seed=7, prompt_ids=mine, batch_size=1
    )
    rewards = torch.tensor(REWARDS).view(len(PROMPTS), GROUP_SIZE)[mine].flatten()
    local_advantages = group_advantages(rewards, local_rollout.group_ids)
    samples_per_rank = per_rank * GROUP_SIZE

    update_config = UpdateConfig(learning_rate=1e-3, micro_batch_size=1)
    trust_config = TrustRegionConfig(strategy="dual", anchor_interval=2)
    steps = int(local_rollout.trained_steps.sum())
    engine = build_engine(
        adapter.transformer,
        update_config,
        deepspeed_config_name=args.deepspeed_config,
        accumulation_steps=update_config.accumulation_steps(samples_per_rank, steps),
    )
    frozen_before = gathered_state(engine.module, trainable=False)
    trainable_before = gathered_state(engine.module, trainable=True)
    updater = Updater(engine, adapter, update_config, trust_config, seed=3)

    history = []
    for update in range(1, args.updates + 1):
        values = local_advantages.values.clone()
        if update == args.nan_update and rank == world - 1:
            values[0] = float("nan")
        before = gathered_state(engine.module, trainable=True) if update == args.nan_update else None
        metrics = updater.update(local_rollout, dataclasses.replace(local_advantages, values=values))
        if before is not None:
            after = gathered_state(engine.module, trainable=True)
            metrics["weights_unchanged"] = float(all(torch.equal(before[k], after[k]) for k in before))
        history.append(metrics)
        if update == 1:
            save_path = Path(args.out) / f"after_first_update_world{world}.safetensors"
            state = gathered_state(engine.module, trainable=True)
            if rank == 0:
                save_file(state, str(save_path))

    frozen_after = gathered_state(engine.module, trainable=False)
    trainable_after = gathered_state(engine.module, trainable=True)
    report = {
        "rank": rank,
        "world": world,
        "history": history,
        "frozen_identical": all(torch.equal(frozen_before[k], frozen_after[k]) for k in frozen_before),
        "frozen_count": len(frozen_before),
        "trainable_changed": any(not torch.equal(trainable_before[k], trainable_after[k]) for k in trainable_before),
    }
    Path(args.out, f"report_rank{rank}_world{world}.json").write_text(json.dumps(report, allow_nan=True))


if __name__ == "__main__":
    main()
    sys.exit(distributed.exit_launched(0))
