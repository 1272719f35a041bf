"""K GRPO updates of a tiny HunyuanVideo 1.5 under a strong reward (the mean of the final latents), once per trust
region setting, in one process on a DeepSpeed engine; writes each run's KL to the starting policy and its metrics.

The KL to the start is measured on a fixed probe rollout at every trained step, against a never-refreshed snapshot
of the initial weights swapped in (stages/anchor.py), so it is the same yardstick for every setting.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from sage_grpo.core import distributed
from sage_grpo.core.grpo import gaussian_mean_kl, group_advantages
from sage_grpo.core.models.tiny import tiny_hunyuan15
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.anchor import Anchor
from sage_grpo.stages.engine import build_engine
from sage_grpo.stages.rollout import SDEConfig, generate, score_transition
from sage_grpo.stages.update import UpdateConfig, Updater

PROMPTS = ["a red ball bouncing", "a blue car driving at night"]
GROUP = 4
SDE = SDEConfig(variant="sage", eta=0.7, steps=4, shift=3.0)


def kl_to(start: Anchor, adapter, engine, probe) -> float:
    index = torch.arange(probe.num_samples)
    values = []
    with torch.no_grad():
        for t in torch.nonzero(probe.trained_steps).flatten().tolist():
            now = score_transition(adapter, probe, index, t, module=engine)
            with start.swapped_in():
                then = score_transition(adapter, probe, index, t, module=engine)
            values.append(float(gaussian_mean_kl(now.mean, then.mean, now.std).mean()))
    return sum(values) / len(values)


def train(trust: dict, updates: int) -> dict:
    torch.manual_seed(0)
    adapter = tiny_hunyuan15(seed=0)
    adapter.transformer.requires_grad_(True)
    config = UpdateConfig(learning_rate=3e-3, micro_batch_size=GROUP)
    samples = len(PROMPTS) * GROUP
    engine = build_engine(
        adapter.transformer,
        config,
        accumulation_steps=config.accumulation_steps(samples, SDE.trained_step_count),
    )
    start = Anchor.snapshot(engine.module)
    updater = Updater(engine, adapter, config, TrustRegionConfig(**trust), seed=1)
    probe = generate(adapter, PROMPTS, 2, SDE, seed=999, batch_size=GROUP, decode=False, progress=False)
    history = []
    for k in range(updates):
        rollout = generate(adapter, PROMPTS, GROUP, SDE, seed=100 + k, batch_size=GROUP, decode=False, progress=False)
        rewards = rollout.latents[:, -1].mean(dim=(1, 2, 3, 4)).cpu()
        metrics = updater.update(rollout, group_advantages(rewards, rollout.group_ids))
        history.append(metrics | {"reward": float(rewards.mean())})
    return {
        "kl_to_start": kl_to(start, adapter, engine, probe),
        "history": history,
        "state": updater.state_dict()["lagged"] is not None,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--settings", required=True, help="JSON: name -> TrustRegionConfig kwargs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    distributed.init()
    report = {name: train(trust, args.updates) for name, trust in json.loads(args.settings).items()}
    Path(args.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    sys.exit(distributed.exit_launched(0))
