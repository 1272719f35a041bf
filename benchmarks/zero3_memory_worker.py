"""Per-rank model-state bytes of the tiny HunyuanVideo 1.5 under DeepSpeed ZeRO-3, after one GRPO update (so that
gradients and Adam states exist). Run by ``benchmarks/perf.py`` through torchrun with 1 and 2 processes; each rank
writes ``memory_rank{R}_world{W}.json`` into ``--out``.

Counted: this rank's parameter partitions, its fp32 master partitions, its gradient partition buffer and its
optimizer states: exactly what ZeRO-3 promises to divide by the number of ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from sage_grpo.core import distributed
from sage_grpo.core.grpo import group_advantages
from sage_grpo.core.models.tiny import tiny_hunyuan15
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.engine import build_engine
from sage_grpo.stages.rollout import SDEConfig, generate
from sage_grpo.stages.update import UpdateConfig, Updater


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def model_state_bytes(engine) -> dict[str, int]:
    zero = engine.optimizer  # DeepSpeedZeroOptimizer_Stage3
    params = [p.ds_tensor for p in engine.module.parameters()]
    states = [value for state in zero.optimizer.state.values() for value in state.values()]
    return {
        "params": _bytes(params),
        "fp32_master": _bytes(zero.fp32_partitioned_groups_flat),
        "grads": _bytes([zero.grad_partitions_flat_buffer]),
        "optimizer_states": _bytes(states),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    distributed.init()
    rank, world = distributed.rank(), distributed.world_size()
    adapter = tiny_hunyuan15(seed=0)
    adapter.transformer.requires_grad_(True)
    prompts, group = ["a red ball", "a blue car"], 2
    mine = list(range(rank * len(prompts) // world, (rank + 1) * len(prompts) // world))
    sde_config = SDEConfig(variant="sage", eta=0.5, steps=4, shift=3.0)
    config = UpdateConfig(learning_rate=1e-4, micro_batch_size=group)
    rollout = generate(
        adapter,
        [prompts[i] for i in mine],
        group,
        sde_config,
        seed=0,
        prompt_ids=mine,
        batch_size=group,
        progress=False,
    )
    engine = build_engine(
        adapter.transformer,
        config,
        accumulation_steps=config.accumulation_steps(len(mine) * group, int(rollout.trained_steps.sum())),
    )
    updater = Updater(engine, adapter, config, TrustRegionConfig(strategy="none"))
    rewards = torch.arange(rollout.num_samples, dtype=torch.float32)
    updater.update(rollout, group_advantages(rewards, rollout.group_ids))
    report = {"rank": rank, "world": world, "bytes": model_state_bytes(engine)}
    Path(args.out, f"memory_rank{rank}_world{world}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    sys.exit(distributed.exit_launched(0))
