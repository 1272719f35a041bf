"""The update's throughput options on a tiny HunyuanVideo 1.5 under a 1-process DeepSpeed engine (run by torchrun):
several updates per rollout, several transitions per forward, and the EMA with an exact resume through the run's
Checkpointer. Writes a JSON report for tests/distributed/test_throughput.py."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from sage_grpo.core import distributed
from sage_grpo.core.grpo import group_advantages
from sage_grpo.core.lora import LoraConfig, add_lora
from sage_grpo.core.models.tiny import tiny_hunyuan15
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.pipeline.checkpointer import Checkpointer, for_run
from sage_grpo.pipeline.config import RunConfig
from sage_grpo.stages.engine import build_engine
from sage_grpo.stages.rollout import SDEConfig, generate
from sage_grpo.stages.update import UpdateConfig, Updater

PROMPTS = ["a red ball bouncing", "a blue car driving at night"]
REWARDS = [0.1, 0.9, 0.7, 0.2]
SDE = SDEConfig(variant="sage", eta=0.7, steps=3, shift=3.0)  # 3 trained steps: 4 chunks x 3 = 12 transitions


def gathered(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        return {n: p.detach().clone().float() for n, p in params}


def build(
    deepspeed_config: str,
    zero3_leaf_modules="auto",
    trust: dict | None = None,
    lora: bool = False,
    measured: bool = True,
    **options,
) -> tuple[Updater, object]:
    adapter = tiny_hunyuan15(seed=0)
    if lora:
        add_lora(adapter.transformer, LoraConfig(enabled=True, rank=4))
    else:
        adapter.transformer.requires_grad_(True)
    rollout = generate(adapter, PROMPTS, 2, SDE, seed=7, batch_size=1, progress=False)
    config = UpdateConfig(**{"learning_rate": 1e-2, "micro_batch_size": 1, **options})
    engine = build_engine(
        adapter.transformer,
        config,
        deepspeed_config_name=deepspeed_config,
        accumulation_steps=config.accumulation_steps(rollout.num_samples, int(rollout.trained_steps.sum())),
        zero3_leaf_modules=zero3_leaf_modules,
    )
    trust_region = TrustRegionConfig(**{"strategy": "dual", **(trust or {})})
    updater = Updater(engine, adapter, config, trust_region, seed=3)
    if not measured:  # the gradient ratio's autograd passes left out, to show they change nothing of the training
        updater._strength_measurable = lambda: False
    return updater, rollout


def advantages(rollout):
    return group_advantages(torch.tensor(REWARDS), rollout.group_ids)


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _checkpointer(updater: Updater, deepspeed_config: str, out: Path, name: str) -> Checkpointer:
    """The run's Checkpointer around this updater's engine (the Updater registered as the recipe registers it), its
    root under ``out/name``. The config holds the settings the updater was built with, so a resume under others is
    refused as a run's would be."""
    config = RunConfig(
        run={"output_dir": str(out / name)},
        data={"source": "prompts.txt"},  # never read: the rollout is fixed
        sde=SDE,
        rollout={"group_size": 2, "prompts_per_rank": len(PROMPTS)},
        update=updater.config,
        trust_region=updater.trust,
        deepspeed={"config": deepspeed_config},
    )
    return for_run(config, updater.engine, {"updater": updater})


def _checkpoint(updater: Updater, deepspeed_config: str, out: Path, name: str) -> None:
    """The Checkpointer's save of this step (the updates done so far): the engine and the Updater's state."""
    checkpointer = _checkpointer(updater, deepspeed_config, out, name)
    checkpointer.claim()
    checkpointer.save(updater.updates_done, force=True)


def _resumed(deepspeed_config: str, out: Path, name: str, **options) -> Updater:
    """A fresh Updater and engine restored by the Checkpointer from :func:`_checkpoint`'s step."""
    resumed, _ = build(deepspeed_config, **options)
    _checkpointer(resumed, deepspeed_config, out, name).load("auto", require=True)
    return resumed


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
            _checkpoint(updater, deepspeed_config, out, "ema")
        updater.update(rollout, advantages(rollout))
        policy = gathered(module)
        expected = {k: decay * expected[k] + (1 - decay) * policy[k] for k in expected}
        with updater.ema_swapped_in():
            ema = gathered(module)
        restored_exactly &= all(torch.equal(policy[k], v) for k, v in gathered(module).items())
        formula_error = max(formula_error, max_difference(ema, expected))
    resumed = _resumed(deepspeed_config, out, "ema", ema_decay=decay)
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


def _resumed_third_update(deepspeed_config: str, out: Path, name: str, **options) -> tuple[Updater, dict, dict, dict]:
    """Three updates straight, and the third again from a checkpoint of the second (the first whose Adam bias
    correction, beta^3, rounds differently when recomputed): the straight run's updater and weights at the start
    and after one update, and the resumed run's weights after three."""
    updater, rollout = build(deepspeed_config, **options)
    start = gathered(updater.engine.module)
    updater.update(rollout, advantages(rollout))
    after_one = gathered(updater.engine.module)
    updater.update(rollout, advantages(rollout))
    _checkpoint(updater, deepspeed_config, out, name)
    updater.update(rollout, advantages(rollout))
    resumed = _resumed(deepspeed_config, out, name, **options)
    resumed.update(rollout, advantages(rollout))
    return updater, start, after_one, gathered(resumed.engine.module)


def muon_scenario(out: Path) -> dict:
    """Muon under ZeRO-3: the first update's step on each matrix Muon trains, over the learning rate and Muon's
    aspect-ratio scale, as singular values (an orthogonalized step's are about 1; a clip norm taken over the updates
    divided them by it); what the auxiliary AdamW moved; and a resume after two updates against three straight."""
    updater, start, after_one, resumed = _resumed_third_update("zero3", out, "muon", optimizer="muon")
    module = updater.engine.module
    trained = {name: param for name, param in module.named_parameters() if param.requires_grad}
    learning_rate = updater.config.learning_rate
    top_singular_values = {}
    for name, param in trained.items():
        step = after_one[name] - start[name]
        if param.use_muon and step.any():
            rows, columns = step.shape
            scaled = step / (learning_rate * max(1.0, rows / columns) ** 0.5)
            top_singular_values[name] = float(torch.linalg.matrix_norm(scaled, ord=2))
    adam_moved = max(float((after_one[n] - start[n]).abs().max()) for n, p in trained.items() if not p.use_muon)
    return {
        "top_singular_values": top_singular_values,
        "muon_matrices": sum(param.use_muon for param in trained.values()),
        "adam_moved": adam_moved,
        "adam": type(updater.engine.optimizer.optimizer.aux_optimizer).__module__,
        "resume_difference": max_difference(gathered(module), resumed),
    }


def offload_scenario(out: Path) -> dict:
    """The shipped zero3_offload config (DeepSpeedCPUAdam steps the host's fp32 partitions): a resume after two
    updates against three straight."""
    updater, start, after_one, resumed = _resumed_third_update("zero3_offload", out, "offload")
    return {
        "weights_moved": max_difference(after_one, start),
        "resume_difference": max_difference(gathered(updater.engine.module), resumed),
    }


LEAF_CASES = {  # each run with the default leaf blocks, and under ZeRO-3 also with its per-module hooks
    "dual": {},
    # the gradient ratio's autograd passes on each micro-step's output before its backward, at a learning rate that
    # leaves the policy term unclipped; anchor_interval 3 so that update 2 is measured
    "kl_grad_ratio_each_update": {"trust": {"anchor_interval": 3}, "learning_rate": 1e-4},
    "unmeasured": {"trust": {"anchor_interval": 3}, "learning_rate": 1e-4, "measured": False},
    "no_trust_region": {"trust": {"strategy": "none"}},  # no no-grad forward before the policy's
    "lora": {"lora": True},  # the first block's inputs need no grad: only the adapters train
    "checkpointed": {"gradient_checkpointing": True},  # as the shipped configs train
}


def leaf_scenario(deepspeed_config: str) -> dict:
    """Two updates per case: which modules are leaves, how far checkpointing moves the weights and, under ZeRO-3, how
    far the weights and metrics of leaf blocks and per-module hooks end apart (ZeRO-2 gathers nothing: its leaf
    setting is inert, so a second run would repeat the first)."""
    from deepspeed.utils import z3_leaf_module

    hook_variants = {"blocks": "auto", "per_module": []} if deepspeed_config == "zero3" else {"blocks": "auto"}
    report, weights = {}, {}
    for case, options in LEAF_CASES.items():
        runs = {}
        for hooks, leaf_modules in hook_variants.items():
            updater, rollout = build(deepspeed_config, zero3_leaf_modules=leaf_modules, **options)
            module = updater.engine.module
            start = gathered(module)
            metrics = [updater.update(rollout, advantages(rollout)) for _ in range(2)]
            runs[hooks] = (gathered(module), metrics[-1], module, start)
        blocks, block_metrics, module, start = runs["blocks"]
        weights[case] = blocks
        report[case] = {
            "leaves": sorted({type(m).__name__ for m in module.modules() if z3_leaf_module(m)}),
            "checkpointing": module.gradient_checkpointing,
            "kl_grad_ratio": block_metrics.get("kl_grad_ratio"),
            "weights_moved": max_difference(blocks, start),
        }
        if "per_module" in runs:
            per_module, module_metrics, *_ = runs["per_module"]
            report[case]["weights_difference"] = max_difference(blocks, per_module)
            report[case]["metrics_differing"] = sorted(
                k for k in block_metrics if block_metrics[k] != module_metrics[k]
            )
    report["checkpointed"]["checkpointing_difference"] = max_difference(weights["dual"], weights["checkpointed"])
    report["kl_grad_ratio_each_update"]["measurement_difference"] = max_difference(
        weights["kl_grad_ratio_each_update"], weights["unmeasured"]
    )
    return report


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
    if args.deepspeed_config == "zero3":  # Muon and the offload config are ZeRO-3's
        report["muon"] = muon_scenario(out)
        report["offload"] = offload_scenario(out)
    report["leaf"] = leaf_scenario(args.deepspeed_config)
    (out / f"report_{args.deepspeed_config}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    sys.exit(distributed.exit_launched(0))
