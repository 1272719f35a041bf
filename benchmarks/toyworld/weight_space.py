"""The trust region's strength in output space (``update/kl_grad_ratio``, what lambda is steered by) and in weight
space (``update/kl_grad_ratio/weight_space``, what the optimizer steps on), on the ToyWorld's default arm at 8 and 96
samples per update, lr 1e-4 and 1e-5, and lr 1e-4 warmed up over 10 updates:

    python -m benchmarks.toyworld.weight_space [--iterations 14] [--out benchmarks/toyworld/results/weight_space.json]

Each setting trains one seed for ``--iterations`` iterations (a whole anchor cycle measured, and the warm-up) through
``compare``'s own iteration (rollout, ToyWorld reward, group advantages, one update of ``stages.update.Updater`` on a
ZeRO-2 engine) with ``trust_region.measure_weight_space`` on. It prints, per setting, the geometric means over the
measured updates of both ratios and of their quotient, lambda, and lambda x lr, and writes every update's values as
JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from sage_grpo.core import distributed
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.engine import build_engine
from sage_grpo.stages.update import Updater

from . import world
from .compare import DEFAULT_OUT, Config, _iteration, update_config_of, write_atomically
from .model import train_used_weights
from .pretrain import pretrained_adapter

# (name, captions, samples per caption, lr, warm-up updates, measured in weight space)
SETTINGS = [
    ("8 samples, lr 1e-4", 1, 8, 1e-4, 0, True),
    ("96 samples, lr 1e-4", 12, 8, 1e-4, 0, True),
    ("96 samples, lr 1e-5", 12, 8, 1e-5, 0, True),
    ("8 samples, lr 1e-5", 1, 8, 1e-5, 0, True),
    ("96 samples, lr 1e-4, warm-up 10", 12, 8, 1e-4, 10, True),
    # The same run as the second, unmeasured: what the measurement costs per update.
    ("96 samples, lr 1e-4, weights not measured", 12, 8, 1e-4, 0, False),
]


def measure(
    captions: int, group: int, lr: float, warmup: int, in_weight_space: bool, iterations: int, seed: int = 0
) -> list[dict]:
    config = dataclasses.replace(
        Config(),
        captions=tuple(world.TRAIN_CAPTIONS[:captions]),
        group_size=group,
        learning_rate=lr,
        lr_warmup_steps=warmup,
        iterations=iterations,
    )
    torch.manual_seed(seed)
    adapter = pretrained_adapter(config.pretrain)
    train_used_weights(adapter.transformer)
    update_config = update_config_of(config)
    engine = build_engine(
        adapter.transformer,
        update_config,
        deepspeed_config_name=config.deepspeed_config,
        accumulation_steps=update_config.accumulation_steps(captions * group, config.sde().trained_step_count),
    )
    trust = TrustRegionConfig(
        strategy=config.kl, anchor_interval=config.anchor_interval, measure_weight_space=in_weight_space
    )
    updater = Updater(engine, adapter, update_config, trust, seed=seed)
    return [_iteration(adapter, updater, config, seed, i) for i in range(iterations)]


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def summary(history: list[dict], lr: float) -> dict:
    measured = [h for h in history if h.get("kl_grad_ratio") and h.get("kl_grad_ratio/weight_space")]
    output = [h["kl_grad_ratio"] for h in measured]
    weights = [h["kl_grad_ratio/weight_space"] for h in measured]
    last_cycle = history[len(history) // 2 :]
    return {
        "measured_updates": len(measured),
        "output_ratio": geometric_mean(output),
        "weight_ratio": geometric_mean(weights),
        "weight_over_output": geometric_mean([w / o for w, o in zip(weights, output)]),
        "lambda_max": max(h["lambda_kl"] for h in history),
        "lambda_second_half": geometric_mean([h["lambda_kl"] for h in last_cycle]),
        "lambda_x_lr_second_half": geometric_mean([h["lambda_kl"] for h in last_cycle]) * lr,
        "update_s": sum(h["update_s"] for h in history) / len(history),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=14)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "weight_space.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    distributed.init()
    results = []
    for name, captions, group, lr, warmup, in_weight_space in SETTINGS:
        start = time.perf_counter()
        history = measure(captions, group, lr, warmup, in_weight_space, args.iterations)
        results.append({"setting": name, "lr": lr, "history": history, **summary(history, lr)})
        row = results[-1]
        print(
            f"{name:34s} output {row['output_ratio']:.3g}  weight {row['weight_ratio']:.3g}  "
            f"weight/output {row['weight_over_output']:.1f}  lambda max {row['lambda_max']:.3g}, "
            f"2nd half {row['lambda_second_half']:.3g} (x lr {row['lambda_x_lr_second_half']:.3g})  "
            f"update {row['update_s']:.2f}s  "
            f"[{time.perf_counter() - start:.0f}s]",
            flush=True,
        )
    write_atomically(args.out, json.dumps({"iterations": args.iterations, "results": results}, indent=1))


if __name__ == "__main__":
    main()
