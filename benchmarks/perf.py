"""Overhead ratios of the pipeline on the tiny HunyuanVideo 1.5, each from side-by-side runs on the same model:

  rollout / diffusers pipeline     our SDE rollout vs the pipeline's own call (benchmarks/rollout.py), target <= 1.05
  update / bare fwd+bwd            Updater on a 1-process ZeRO-3 engine vs plain PyTorch doing the same model work
                                   (anchor forward, policy forward + backward per micro-step, one AdamW step), <= 1.10
  iteration split                  rollout, reward, advantages, update; and the share spent outside model compute
  ZeRO-3 memory 2 ranks / 1 rank   partitioned param + master + grad + optimizer bytes per rank (torchrun), <= 0.55
  SDE window w of T                update time with w trained steps relative to all trained steps (expect ~ w / T)

    python -m benchmarks.perf [--repeats 5]

Timings alternate between the compared sides and report medians, so drifting machine load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.rollout import diffusers_pipeline, median_seconds, ours
from core import distributed
from core.grpo import group_advantages
from core.models.tiny import tiny_hunyuan15
from core.rewards.base import VideoBatch, weighted_total
from core.rewards.simple import Brightness, TemporalSmoothness
from stages.rollout import SDEConfig, generate
from stages.update import TrustRegionConfig, UpdateConfig, Updater, accumulation_steps, build_engine

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["a red ball bouncing", "a blue car driving at night"]
GROUP = 2
STEPS = 8
SDE = SDEConfig(variant="sage", eta=0.5, steps=STEPS, shift=3.0)


def _trainable_tiny():
    adapter = tiny_hunyuan15(seed=0)
    adapter.transformer.requires_grad_(True)
    return adapter


def _updater(adapter, rollout, strategy: str = "dual", deepspeed_config: str = "zero3") -> Updater:
    config = UpdateConfig(learning_rate=1e-5, micro_batch_size=rollout.num_samples)
    engine = build_engine(adapter.transformer, config, deepspeed_config_name=deepspeed_config,
                          accumulation_steps=accumulation_steps(rollout.num_samples, rollout.num_samples,
                                                                int(rollout.trained_steps.sum())))
    return Updater(engine, adapter, config, TrustRegionConfig(strategy=strategy))


def _rollout(adapter, sde_config: SDEConfig = SDE, decode: bool = False):
    return generate(adapter, PROMPTS, GROUP, sde_config, seed=0, batch_size=len(PROMPTS) * GROUP, decode=decode,
                    progress=False)


def _advantages(rollout):
    return group_advantages(torch.linspace(0, 1, rollout.num_samples), rollout.group_ids)


def bare_update(adapter, rollout, optimizer, anchor: bool = True):
    """The model work of one update in plain PyTorch: per trained step, the anchor's forward (no grad) and the
    policy's forward and backward on the whole batch; then one optimizer step."""
    embeddings = rollout.sample_embeddings(torch.arange(rollout.num_samples))
    for t in torch.nonzero(rollout.trained_steps).flatten().tolist():
        sigma = rollout.sigmas[t].expand(rollout.num_samples).float()
        latents = rollout.latents[:, t]
        if anchor:
            with torch.no_grad():
                adapter.predict_velocity(latents, sigma, embeddings)
        adapter.predict_velocity(latents, sigma, embeddings).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bare_rollout(adapter, rollout):
    """The model work of one rollout: T batched forwards."""
    embeddings = rollout.sample_embeddings(torch.arange(rollout.num_samples))
    with torch.no_grad():
        for t in range(STEPS):
            adapter.predict_velocity(rollout.latents[:, t], rollout.sigmas[t].expand(rollout.num_samples).float(),
                                     embeddings)


# ----------------------------------------------------------------------------------------------------------------
# The measurements
# ----------------------------------------------------------------------------------------------------------------


def rollout_ratio(repeats: int) -> float:
    adapter = tiny_hunyuan15(guidance_scale=1.0)
    prompts = [f"a short video, number {i}" for i in range(4)]
    with torch.no_grad():
        medians = median_seconds({"ours": ours(adapter, prompts, 20),
                                  "diffusers": diffusers_pipeline(adapter, prompts, 20)}, repeats)
    return medians["ours"] / medians["diffusers"]


def update_ratio(repeats: int, deepspeed_config: str) -> tuple[float, float, float]:
    ours_adapter, bare_adapter = _trainable_tiny(), _trainable_tiny()
    rollout = _rollout(ours_adapter)
    updater = _updater(ours_adapter, rollout, deepspeed_config=deepspeed_config)
    optimizer = torch.optim.AdamW(bare_adapter.transformer.parameters(), lr=1e-5, foreach=False)
    advantages = _advantages(rollout)
    medians = median_seconds({"ours": lambda: updater.update(rollout, advantages),
                              "bare": lambda: bare_update(bare_adapter, rollout, optimizer)}, repeats)
    return medians["ours"] / medians["bare"], medians["ours"], medians["bare"]


def iteration_split(repeats: int) -> tuple[dict[str, float], float]:
    """Median seconds per stage of full iterations, and the share of the iteration outside model compute (the bare
    rollout forwards and bare update of the same batch, timed right after)."""
    adapter, bare_adapter = _trainable_tiny(), _trainable_tiny()
    updater = _updater(adapter, _rollout(adapter))
    rewards, weights = [Brightness(), TemporalSmoothness()], {"brightness": 1.0, "temporal_smoothness": 1.0}
    optimizer = torch.optim.AdamW(bare_adapter.transformer.parameters(), lr=1e-5, foreach=False)
    stages = {"rollout": [], "reward": [], "advantages": [], "update": [], "bare model": []}
    for _ in range(repeats + 1):  # the first iteration warms up
        marks = [time.perf_counter()]
        rollout = _rollout(adapter, decode=True)
        marks.append(time.perf_counter())
        videos = VideoBatch.from_tensor(rollout.videos, adapter.fps)
        scores = {k: v for reward in rewards for k, v in reward(videos, rollout.sample_prompts).items()}
        totals = weighted_total(scores, weights, rollout.num_samples)
        marks.append(time.perf_counter())
        advantages = group_advantages(totals, rollout.group_ids)
        marks.append(time.perf_counter())
        updater.update(rollout, advantages)
        marks.append(time.perf_counter())
        bare_rollout(bare_adapter, rollout)
        bare_update(bare_adapter, rollout, optimizer)
        marks.append(time.perf_counter())
        for name, begin, end in zip(stages, marks, marks[1:]):
            stages[name].append(end - begin)
    medians = {name: statistics.median(values[1:]) for name, values in stages.items()}
    iteration = sum(v for k, v in medians.items() if k != "bare model")
    return medians, 1.0 - medians["bare model"] / iteration


def window_ratios(repeats: int, windows: tuple[int, ...] = (2, 4)) -> list[tuple[int, int, float]]:
    """(w, trained steps without a window, update time with w trained steps / with all of them)."""
    times = {}
    for window in (None, *windows):
        adapter = _trainable_tiny()
        rollout = _rollout(adapter, SDE.model_copy(update={"window": None if window is None else (0, window)}))
        updater = _updater(adapter, rollout, strategy="none")
        advantages = _advantages(rollout)
        times[window] = median_seconds({"update": lambda: updater.update(rollout, advantages)}, repeats)["update"]
    all_trained = STEPS - 1  # the last step is deterministic
    return [(w, all_trained, times[w] / times[None]) for w in windows]


def zero3_memory_ratio() -> tuple[float, dict, dict]:
    worker = Path(__file__).with_name("zero3_memory_worker.py")
    per_world = {}
    with tempfile.TemporaryDirectory() as out:
        for world in (1, 2):
            env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--nnodes=1",
                       f"--master-port={distributed._free_port()}", str(worker), "--out", out]
            result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
            if result.returncode:
                raise RuntimeError(f"memory worker failed with {world} ranks:\n{result.stderr[-4000:]}")
            reports = [json.loads(Path(out, f"memory_rank{r}_world{world}.json").read_text()) for r in range(world)]
            per_world[world] = max(reports, key=lambda r: sum(r["bytes"].values()))["bytes"]
    return sum(per_world[2].values()) / sum(per_world[1].values()), per_world[1], per_world[2]


def report_update(repeats: int) -> None:
    # ZeRO-2 beside ZeRO-3 separates our update's own overhead from ZeRO-3's parameter gathering.
    for name in ("zero3", "zero2"):
        ratio, ours_s, bare_s = update_ratio(repeats, name)
        print(f"update / bare fwd+bwd+anchor fwd ({name}, dual KL): {ratio:.3f}  (target <= 1.10; "
              f"{ours_s * 1000:.0f} ms vs {bare_s * 1000:.0f} ms)")


def report_memory() -> None:
    memory, one, two = zero3_memory_ratio()
    print(f"ZeRO-3 model-state bytes per rank, 2 ranks / 1 rank: {memory:.3f}  (target <= 0.55; "
          f"1 rank {one}, 2 ranks {two})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    distributed.init()
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, "
          f"{'CUDA' if torch.cuda.is_available() else 'no GPU'}; 1 torch thread; tiny HunyuanVideo 1.5, "
          f"{len(PROMPTS)} prompts x {GROUP} samples, {STEPS} SDE steps ({SDE.variant}), full fine-tuning")
    print(f"rollout / diffusers pipeline (20 steps, batch 4):   {rollout_ratio(args.repeats):.3f}  (target <= 1.05)")
    report_update(args.repeats)
    stages, outside = iteration_split(args.repeats)
    total = sum(v for k, v in stages.items() if k != "bare model")
    split = ", ".join(f"{k} {v * 1000:.0f} ms ({v / total:.0%})" for k, v in stages.items() if k != "bare model")
    print(f"iteration split: {split}; share outside model compute {outside:.0%} "
          f"(bare model work {stages['bare model'] * 1000:.0f} ms of {total * 1000:.0f} ms)")
    report_memory()
    for w, trained, ratio in window_ratios(args.repeats):
        print(f"SDE window {w} of {trained} trained steps: update time ratio {ratio:.3f}  (w/T = {w / trained:.3f})")


if __name__ == "__main__":
    main()
