"""Rollout overhead: our SDE rollout (recording latents, means and log-probs at every step) against diffusers' own
pipeline call on the same tiny model, prompts, steps and batch. Target: ours / diffusers <= 1.05.

Both sides encode the prompts and run the denoising loop; neither decodes (HunyuanVideo 1.5's VAE cannot decode
batches larger than one in diffusers, see diffusers PR #13133). Runs alternate between the two sides and the median
of each is reported, so drifts in machine load hit both alike.

    python benchmarks/rollout.py [--model tiny-hunyuan15] [--steps 20] [--batch 4] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sage_grpo.core.models import build_adapter
from sage_grpo.stages.rollout import SDEConfig, generate


def ours(adapter, prompts, steps):
    config = SDEConfig(variant="sage", eta=0.5, steps=steps)
    return lambda: generate(adapter, prompts, 1, config, seed=0, batch_size=len(prompts), decode=False, progress=False)


def diffusers_pipeline(adapter, prompts, steps):
    kwargs = dict(
        prompt=prompts,
        num_inference_steps=steps,
        height=adapter.height,
        width=adapter.width,
        num_frames=adapter.num_frames,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    )
    if hasattr(adapter, "max_sequence_length"):  # WanPipeline takes these per call, HunyuanVideo 1.5 from its guider
        kwargs.update(guidance_scale=adapter.guidance_scale, max_sequence_length=adapter.max_sequence_length)
    adapter.pipeline.set_progress_bar_config(disable=True)
    return lambda: adapter.pipeline(**kwargs)


def median_seconds(runs: dict, repeats: int) -> dict[str, float]:
    for run in runs.values():  # warm-up: first calls allocate and pick kernels
        run()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-hunyuan15", choices=["tiny-hunyuan15", "tiny-wan"])
    parser.add_argument("--guidance-scales", type=float, nargs="+", default=[1.0, 6.0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 gives the steadiest timings)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    prompts = [f"a short video, number {i}" for i in range(args.batch)]
    print(f"{args.model}: {args.steps} steps, batch {args.batch}, median of {args.repeats}")
    print(f"{'guidance':>8} {'ours (s)':>9} {'diffusers (s)':>13} {'ratio':>6}")
    for scale in args.guidance_scales:
        adapter = build_adapter(args.model, guidance_scale=scale)
        with torch.no_grad():
            runs = {
                "ours": ours(adapter, prompts, args.steps),
                "diffusers": diffusers_pipeline(adapter, prompts, args.steps),
            }
            medians = median_seconds(runs, args.repeats)
        ratio = medians["ours"] / medians["diffusers"]
        print(f"{scale:>8.1f} {medians['ours']:>9.3f} {medians['diffusers']:>13.3f} {ratio:>6.3f}")


if __name__ == "__main__":
    main()
