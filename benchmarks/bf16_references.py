"""Why the KL references and the EMA copy the bf16 weights, not DeepSpeed's fp32 master partitions.

    python -m benchmarks.bf16_references

The KL references (anchor, lagged policy) are only ever used through forwards, and a forward runs on the bf16
weights, which DeepSpeed re-casts from the fp32 master after every step: a snapshot of the master would be cast back
to exactly the bf16 values the anchor already holds, so every reference forward (and every KL) is bit-identical
either way, at twice the memory. That many bf16 weights stand still in a step is a property of the policy's own
forward, not an artefact of the copy. The EMA keeps float32 values blended from the bf16 weights; this simulates
AdamW-sized steps (lr 1e-5 per weight, a persistent direction plus sign noise) on 1M fp32 master weights of scale
0.02 for 2,000 steps and compares that EMA with one blended from the master: the difference is a fraction of one
bf16 ulp of each weight, far below the EMA's own lag behind the weights.
"""

from __future__ import annotations

import torch

STEPS, WEIGHTS, LR, DECAY = 2000, 1_000_000, 1e-5, 0.999


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    master = torch.randn(WEIGHTS, generator=generator) * 0.02
    ema_of_master, ema_of_bf16 = master.clone(), master.bfloat16().float()
    unchanged = 0.0
    for _ in range(STEPS):
        step = 0.5 + 0.5 * torch.sign(torch.randn(WEIGHTS, generator=generator))
        before = master.bfloat16()
        master -= LR * step
        after = master.bfloat16()
        unchanged += float((before == after).float().mean()) / STEPS
        ema_of_master.lerp_(master, 1 - DECAY)
        ema_of_bf16.lerp_(after.float(), 1 - DECAY)
    ulp = torch.exp2(torch.floor(torch.log2(master.abs().clamp(min=1e-30))) - 7)  # bf16 keeps 8 significant bits
    rounding = ((ema_of_bf16 - ema_of_master).abs() / ulp).quantile(torch.tensor([0.5, 0.99]))
    lag = ((ema_of_master - master).abs() / ulp).median()
    print(f"bf16 weights unchanged per step: {unchanged:.1%}")
    print(
        f"EMA of bf16 - EMA of the fp32 master, in bf16 ulps: median {rounding[0]:.3f}, "
        f"99th percentile {rounding[1]:.2f}"
    )
    print(f"the EMA's own lag behind the master, in bf16 ulps: median {lag:.1f}")


if __name__ == "__main__":
    main()
