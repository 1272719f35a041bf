"""GRPO updates on a tiny two-expert Wan 2.2 under DeepSpeed ZeRO-3, run by torchrun (gloo on CPU).

Both experts live in one module and one engine, as ``sagegrpo run`` builds them. Each rank rolls out its own prompt's
group and trains on it. Every rank writes a JSON report: per expert whether its trainable and frozen weights changed
(gathered from the ZeRO-3 partitions, compared bit for bit), the update metrics and the final weights' sha256. The
DeepSpeed checkpoint written after the first update lets ``--resume-from`` repeat the second in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from sage_grpo.core import distributed
from sage_grpo.core.grpo import group_advantages
from sage_grpo.core.lora import LoraConfig, add_lora
from sage_grpo.core.models.tiny import tiny_wan22
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.engine import build_engine
from sage_grpo.stages.rollout import SDEConfig, generate, trained_steps
from sage_grpo.stages.update import UpdateConfig, Updater

PROMPTS = ["a red ball bouncing", "a blue car driving at night"]
GROUP_SIZE = 2
REWARDS = [0.1, 0.9, 0.7, 0.2]
# shift 5, 6 steps: steps 0-2 are the high-noise expert's, 3-4 the low-noise expert's (5, to sigma 0, has no noise).
SDE = SDEConfig(variant="sage", eta=0.7, steps=6, shift=5.0)


def expert_weights(module: torch.nn.Module, expert: str) -> dict[str, torch.Tensor]:
    """Every weight of one expert, whole (gathered from ZeRO-3 partitions), by name."""
    import deepspeed

    params = [(name, p) for name, p in module.named_parameters() if name.startswith(f"{expert}.")]
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        return {name: p.detach().clone() for name, p in params}


def changed(before: dict, after: dict, trainable: set[str]) -> dict[str, bool]:
    """Whether any trainable and any frozen weight of ``before`` differs in ``after``, bit for bit."""
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    return {"trainable": bool(moved & trainable), "frozen": bool(moved - trainable)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--train-experts", nargs="+", default=None)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--resume-from", help="a first run's --out: load its checkpoint, repeat the second update")
    args = parser.parse_args()

    distributed.init()
    rank, world = distributed.rank(), distributed.world_size()
    torch.manual_seed(0)
    adapter = tiny_wan22(guidance_scale=3.0, guidance_scale_2=2.0, train_experts=args.train_experts)
    adapter.transformer.requires_grad_(False)  # as pipeline.recipe.build_policy
    for module in adapter.trainable_modules():
        if args.lora:
            add_lora(module, LoraConfig(enabled=True, rank=4, alpha=4.0))
        else:
            module.requires_grad_(True)

    per_rank = len(PROMPTS) // world
    mine = list(range(rank * per_rank, (rank + 1) * per_rank))
    rollout = generate(adapter, [PROMPTS[i] for i in mine], GROUP_SIZE, SDE, seed=7, prompt_ids=mine, batch_size=1)
    rewards = torch.tensor(REWARDS).view(len(PROMPTS), GROUP_SIZE)[mine].flatten()
    advantages = group_advantages(rewards, rollout.group_ids)

    update_config = UpdateConfig(learning_rate=1e-3, micro_batch_size=1, weight_decay=args.weight_decay)
    steps = int(trained_steps(SDE, adapter, rollout.sigmas).sum())
    engine = build_engine(
        adapter.transformer,
        update_config,
        accumulation_steps=update_config.accumulation_steps(per_rank * GROUP_SIZE, steps),
    )
    names = {name for name, p in engine.module.named_parameters() if p.requires_grad}
    before = {expert: expert_weights(engine.module, expert) for expert in ("high", "low")}
    updater = Updater(engine, adapter, update_config, TrustRegionConfig(strategy="moving", anchor_interval=5), seed=3)
    anchored = {id(p) for p in updater.anchor.params}

    if args.resume_from:  # a fresh process continues from the checkpoint written after the first update
        engine.load_checkpoint(args.resume_from, tag="after-first")
        updater.load_state_dict(torch.load(Path(args.resume_from, f"updater_rank{rank}.pt"), weights_only=True))
        updater.update(rollout, advantages)
        report = {"weights_sha256": distributed.weights_fingerprint(engine.module)}
        Path(args.out, f"resumed_rank{rank}.json").write_text(json.dumps(report))
        return

    history = [updater.update(rollout, advantages)]
    engine.save_checkpoint(args.out, tag="after-first")
    torch.save(updater.state_dict(), Path(args.out, f"updater_rank{rank}.pt"))
    history.append(updater.update(rollout, advantages))
    after = {expert: expert_weights(engine.module, expert) for expert in ("high", "low")}
    report = {
        "trained_steps": torch.nonzero(rollout.trained_steps).flatten().tolist(),
        "weights_sha256": distributed.weights_fingerprint(engine.module),
    }
    report |= {
        "history": history,
        "changed": {expert: changed(before[expert], after[expert], names) for expert in before},
        "anchored": {
            expert: sum(id(p) in anchored for name, p in engine.module.named_parameters() if name.startswith(expert))
            for expert in ("high", "low")
        },
        "trainable": {expert: sum(name.startswith(f"{expert}.") for name in names) for expert in ("high", "low")},
    }
    Path(args.out, f"report_rank{rank}.json").write_text(json.dumps(report, allow_nan=True))


if __name__ == "__main__":
    main()
    sys.exit(distributed.exit_launched(0))
