"""The update's throughput options on a tiny HunyuanVideo 1.5 under a 1-process DeepSpeed engine (run by torchrun):
several updates per rollout, several transitions per forward, and the EMA with an exact resume. Writes a JSON
report for tests/distributed/test_throughput.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from core import distributed
from core.grpo import group_advantages
from core.models.tiny import tiny_hunyuan15
from stages.rollout import SDEConfig, generate
from stages.update import TrustRegionConfig, UpdateConfig, Updater, build_engine

PROMPTS = ["a red ball bouncing", "a blue car driving at night"]
REWARDS = [0.1, 0.9, 0.7, 0.2]
SDE = SDEConfig(variant="sage", eta=0.7, steps=4, shift=3.0)  # 3 trained steps: 4 chunks x 3 = 12 transitions


def gathered(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        return {n: p.detach().clone().float() for n, p in params}


def build(deepspeed_config: str, zero3_leaf_modules="auto", **options) -> tuple[Updater, object]:
    adapter = tiny_hunyuan15(seed=0)
    adapter.transformer.requires_grad_(True)
    rollout = generate(adapter, PROMPTS, 2, SDE, seed=7, batch_size=1, progress=False)
    config = UpdateConfig(learning_rate=1e-2, micro_batch_size=1, seed=3, **options)
    engine = build_engine(
        adapter.transformer,
        config,
        deepspeed_config_name=deepspeed_config,
        accumulation_steps=config.accumulation_steps(rollout.num_samples, int(rollout.trained_steps.sum())),
        zero3_leaf_modules=zero3_leaf_modules,
    )
    updater = Updater(engine, adapter, config, TrustRegionConfig(strategy="dual", kl_grad_ratio_every=0))
    return updater, rollout


def advantages(rollout):
    return group_advantages(torch.tensor(REWARDS), rollout.group_ids)


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def ema_scenario(deepspeed_config: str, out: Path) -> dict:
    """EMA (decay 0.5) over 3 updates checked against its formula on the gathered weights; then a resume from the
    checkpoint after update 2 must end bit-identical (weights and EMA) to the uninterrupted run."""
    decay = 0.5
    updater, rollout = build(deepspeed_config, ema_decay=decay)
    module = updater.engine.module
    expected = gathered(module)
    formula_error, restored_exactly = 0.0, True
    for update in range(1, 4):
        if update == 3:
            updater.engine.save_checkpoint(str(out / "ckpt"), tag="two")
            torch.save(updater.state_dict(), out / "updater.pt")
        updater.update(rollout, advantages(rollout))
        policy = gathered(module)
        expected = {k: decay * expected[k] + (1 - decay) * policy[k] for k in expected}
        with updater.ema_swapped_in():
            ema = gathered(module)
        restored_exactly &= all(torch.equal(policy[k], v) for k, v in gathered(module).items())
        formula_error = max(formula_error, max_difference(ema, expected))
    resumed, _ = build(deepspeed_config, ema_decay=decay)
    resumed.engine.load_checkpoint(str(out / "ckpt"), tag="two")
    resumed.load_state_dict(torch.load(out / "updater.pt", weights_only=False))
    resumed.update(rollout, advantages(rollout))
    with updater.ema_swapped_in():
        ema = gathered(module)
    with resumed.ema_swapped_in():
        resumed_ema = gathered(resumed.engine.module)
    resumed_policy = gathered(resumed.engine.module)
    return {
        "ema_formula_error": formula_error,
        "ema_moved": max_difference(ema, policy),
        "policy_restored_after_swap": restored_exactly,
        "resume_weights_identical": all(torch.equal(v, policy[k]) for k, v in resumed_policy.items()),
        "resume_ema_identical": all(torch.equal(v, ema[k]) for k, v in resumed_ema.items()),
    }


def leaf_scenario(deepspeed_config: str) -> dict:
    """Two updates with the default leaf blocks (each gathered whole) against two with ZeRO-3's per-module hooks and
    two with the blocks recomputed in the backward (gradient checkpointing, as the shipped configs train): which
    modules are leaves, and how far the weights end apart."""
    from deepspeed.utils import z3_leaf_module

    weights, leaves, checkpointing = {}, {}, {}
    for name, options in {
        "blocks": {},
        "per_module": {"zero3_leaf_modules": []},
        "checkpointed": {"gradient_checkpointing": True},
    }.items():
        updater, rollout = build(deepspeed_config, **options)
        for _ in range(2):
            updater.update(rollout, advantages(rollout))
        weights[name] = gathered(updater.engine.module)
        checkpointing[name] = updater.engine.module.gradient_checkpointing
        leaves[name] = sorted({type(m).__name__ for m in updater.engine.module.modules() if z3_leaf_module(m)})
    return {
        "leaves": leaves,
        "checkpointing": checkpointing,
        "per_module_difference": max_difference(weights["blocks"], weights["per_module"]),
        "checkpointed_difference": max_difference(weights["blocks"], weights["checkpointed"]),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--deepspeed-config", default="zero3")
    args = parser.parse_args()
    distributed.init()
    out = Path(args.out)
    report = {}
    for name, options in {
        "one": {},
        "two_updates": {"updates_per_rollout": 2},
        "three_per_forward": {"transitions_per_micro_step": 3},
    }.items():
        updater, rollout = build(args.deepspeed_config, **options)
        report[name] = updater.update(rollout, advantages(rollout))
        report[name]["micro_steps_per_update"] = updater.engine.gradient_accumulation_steps()
    report["ema"] = ema_scenario(args.deepspeed_config, out)
    report["leaf"] = leaf_scenario(args.deepspeed_config)
    (out / f"report_{args.deepspeed_config}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
