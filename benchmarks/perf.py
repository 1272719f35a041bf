"""Overhead ratios of the pipeline, each from side-by-side runs on the same model, at two sizes: the tiny HunyuanVideo
1.5 (per-call overhead exaggerated) and a compute-bound one (the same classes, 6.1M weights, 768 video tokens: about
0.7 s per forward+backward of a 4-sample micro-step on one CPU thread):

  rollout / diffusers pipeline     our SDE rollout vs the pipeline's own call (benchmarks/rollout.py), target <= 1.05
  update / bare fwd+bwd            Updater on a 1-process ZeRO-3 / ZeRO-2 engine vs plain PyTorch doing the same model
                                   work (anchor and lagged forwards, policy forward + backward per micro-step, the
                                   gradient clipped, one AdamW step); targets <= 1.10 compute-bound, <= 1.3 tiny
  iteration split                  rollout, reward, advantages, update; and the share spent outside model compute
                                   (transformer and VAE), target <= 10% compute-bound
  overlapped scoring               a reward sleeping as long as the rollout: generate-then-score vs scoring each batch
                                   while the next is generated (Scorer.overlapped); ideal max(rollout, scoring)
  ZeRO-3 memory 2 ranks / 1 rank   partitioned param + master + grad + optimizer bytes per rank (torchrun), <= 0.55
  SDE window w of T                update time with w trained steps relative to all trained steps (expect ~ w / T)

    python -m benchmarks.perf [--repeats 3] [--update-repeats 9] [--sizes tiny compute]

Timings alternate between the compared sides and report medians, so drifting machine load hits both alike; the
update and rollout ratios are medians of adjacent (ours, baseline) pairs after two warm-ups, with their quartiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.ranks import launch
from benchmarks.rollout import diffusers_pipeline, median_seconds, ours
from sage_grpo.core import distributed
from sage_grpo.core.grpo import group_advantages
from sage_grpo.core.models.tiny import tiny_hunyuan15
from sage_grpo.core.rewards import RewardSpec
from sage_grpo.core.rewards.base import VideoBatch, weighted_total
from sage_grpo.core.rewards.simple import Brightness, TemporalSmoothness
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.engine import build_engine
from sage_grpo.stages.rollout import SDEConfig, generate, in_groups
from sage_grpo.stages.score import Scorer
from sage_grpo.stages.update import UpdateConfig, Updater

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ("a red ball bouncing", "a blue car driving at night")
GROUP = 2


# A HunyuanVideo 1.5 transformer wider and deeper than the tiny one, so a micro-step's time is the model's.
COMPUTE_BOUND_TRANSFORMER = {
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "num_layers": 2,
    "mlp_ratio": 4.0,
    "rope_axes_dim": (8, 12, 12),
}


def compute_bound_hunyuan15():
    """The tiny pipeline (encoders, VAE) with the compute-bound transformer at 64x64: 6.1M weights, 3 x 16 x 16 = 768
    video tokens, so a micro-step's time is the model's, not Python's."""
    return tiny_hunyuan15(seed=0, height=64, width=64, num_frames=5, transformer=COMPUTE_BOUND_TRANSFORMER)


@dataclass(frozen=True)
class Size:
    name: str
    build: Callable
    sde: SDEConfig


SIZES = {
    "tiny": Size("tiny", lambda: tiny_hunyuan15(seed=0), SDEConfig(variant="sage", eta=0.5, steps=8, shift=3.0)),
    "compute": Size("compute-bound", compute_bound_hunyuan15, SDEConfig(variant="sage", eta=0.5, steps=4, shift=3.0)),
}
TINY = SIZES["tiny"]


def _trainable(size: Size):
    adapter = size.build()
    adapter.transformer.requires_grad_(True)
    return adapter


def _updater(adapter, rollout, strategy: str = "dual", deepspeed_config: str = "zero3") -> Updater:
    config = UpdateConfig(learning_rate=1e-5, micro_batch_size=rollout.num_samples)
    engine = build_engine(
        adapter.transformer,
        config,
        deepspeed_config_name=deepspeed_config,
        accumulation_steps=config.accumulation_steps(rollout.num_samples, int(rollout.trained_steps.sum())),
    )
    return Updater(engine, adapter, config, TrustRegionConfig(strategy=strategy))


def _rollout(adapter, sde_config: SDEConfig, decode: bool = False):
    return generate(
        adapter,
        list(PROMPTS),
        GROUP,
        sde_config,
        seed=0,
        batch_size=len(PROMPTS) * GROUP,
        decode=decode,
        progress=False,
    )


def _advantages(rollout):
    return group_advantages(torch.linspace(0, 1, rollout.num_samples), rollout.group_ids)


def _references(updater: Updater) -> int:
    """No-grad forwards per micro-step besides the policy's: the anchor's and the lagged policy's."""
    return (updater.anchor is not None) + (updater.lagged is not None)


def bare_update(adapter, rollout, optimizer, references: int):
    """The model work of one update in plain PyTorch: per trained step, ``references`` no-grad forwards (anchor,
    lagged policy) and the policy's forward and backward on the whole batch; then the gradient clipped to the
    Updater's max norm (DeepSpeed's gradient_clipping there) and one optimizer step."""
    embeddings = rollout.sample_embeddings(torch.arange(rollout.num_samples))
    for t in torch.nonzero(rollout.trained_steps).flatten().tolist():
        sigma = rollout.sigmas[t].expand(rollout.num_samples).float()
        latents = rollout.latents[:, t]
        with torch.no_grad():
            for _ in range(references):
                adapter.predict_velocity(latents, sigma, embeddings)
        adapter.predict_velocity(latents, sigma, embeddings).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(adapter.transformer.parameters(), UpdateConfig().max_grad_norm, foreach=False)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bare_rollout(adapter, rollout):
    """The model work of one rollout: T batched forwards and the decode."""
    embeddings = rollout.sample_embeddings(torch.arange(rollout.num_samples))
    with torch.no_grad():
        for t in range(len(rollout.step_etas)):
            adapter.predict_velocity(
                rollout.latents[:, t], rollout.sigmas[t].expand(rollout.num_samples).float(), embeddings
            )
        adapter.decode(rollout.latents[:, -1])


# ----------------------------------------------------------------------------------------------------------------
# The measurements
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairedRatio:
    """ours / baseline over runs taken in adjacent pairs: the median of the pairs' ratios, and their quartiles (the
    spread one run of this script carries: single updates vary by +-15% on a shared CPU)."""

    median: float
    quartiles: tuple[float, float]
    ours_s: float
    baseline_s: float

    def __str__(self) -> str:
        low, high = self.quartiles
        return (
            f"{self.median:.3f} (quartiles {low:.3f}-{high:.3f}; {self.ours_s * 1000:.0f} ms vs "
            f"{self.baseline_s * 1000:.0f} ms)"
        )


def paired_ratio(ours: Callable, baseline: Callable, repeats: int, warmups: int = 2) -> PairedRatio:
    """Each pair runs ``ours`` then ``baseline`` back to back, so load drifting over the run slows both alike; the
    warm-ups let both settle (optimizer state, allocator pools, the lagged policy's first commit)."""
    for _ in range(warmups):
        ours(), baseline()
    times = []
    for _ in range(repeats):
        pair = []
        for run in (ours, baseline):
            start = time.perf_counter()
            run()
            pair.append(time.perf_counter() - start)
        times.append(pair)
    ratios = [o / b for o, b in times]
    low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return PairedRatio(
        statistics.median(ratios),
        (low, high),
        statistics.median(o for o, _ in times),
        statistics.median(b for _, b in times),
    )


def rollout_ratio(repeats: int) -> PairedRatio:
    adapter = tiny_hunyuan15(guidance_scale=1.0)
    prompts = [f"a short video, number {i}" for i in range(4)]
    with torch.no_grad():
        return paired_ratio(ours(adapter, prompts, 20), diffusers_pipeline(adapter, prompts, 20), repeats)


def update_ratio(size: Size, repeats: int, deepspeed_config: str) -> PairedRatio:
    ours_adapter, bare_adapter = _trainable(size), _trainable(size)
    rollout = _rollout(ours_adapter, size.sde)
    updater = _updater(ours_adapter, rollout, deepspeed_config=deepspeed_config)
    optimizer = torch.optim.AdamW(bare_adapter.transformer.parameters(), lr=1e-5, foreach=False)
    advantages = _advantages(rollout)
    return paired_ratio(
        lambda: updater.update(rollout, advantages),
        lambda: bare_update(bare_adapter, rollout, optimizer, _references(updater)),
        repeats,
    )


def batched_transitions_ratio(repeats: int) -> tuple[float, float, float]:
    """Update time with every trained step of the micro-batch in one forward (transitions_per_micro_step = T - 1)
    against one step per forward, both on ZeRO-3: what batching transitions saves in per-call overhead."""
    times = {}
    for k in (1, TINY.sde.steps - 1):
        adapter = _trainable(TINY)
        rollout = _rollout(adapter, TINY.sde)
        config = UpdateConfig(learning_rate=1e-5, micro_batch_size=rollout.num_samples, transitions_per_micro_step=k)
        engine = build_engine(
            adapter.transformer,
            config,
            accumulation_steps=config.accumulation_steps(rollout.num_samples, int(rollout.trained_steps.sum())),
        )
        updater = Updater(engine, adapter, config, TrustRegionConfig())
        run = lambda updater=updater, rollout=rollout: updater.update(rollout, _advantages(rollout))  # noqa: E731
        times[k] = median_seconds({"update": run}, repeats)["update"]
    batched, single = times[TINY.sde.steps - 1], times[1]
    return batched / single, batched, single


def iteration_split(size: Size, repeats: int, deepspeed_config: str) -> tuple[dict[str, float], float]:
    """Median seconds per stage of full iterations, and the median share of an iteration outside model compute (the
    bare rollout forwards and decode and the bare update of the same batch, timed right after it)."""
    adapter, bare_adapter = _trainable(size), _trainable(size)
    updater = _updater(adapter, _rollout(adapter, size.sde), deepspeed_config=deepspeed_config)
    rewards, weights = [Brightness(), TemporalSmoothness()], {"brightness": 1.0, "temporal_smoothness": 1.0}
    optimizer = torch.optim.AdamW(bare_adapter.transformer.parameters(), lr=1e-5, foreach=False)
    stages = {"rollout": [], "reward": [], "advantages": [], "update": [], "bare model": []}
    for _ in range(repeats + 1):  # the first iteration warms up
        marks = [time.perf_counter()]
        rollout = _rollout(adapter, size.sde, decode=True)
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
        bare_update(bare_adapter, rollout, optimizer, _references(updater))
        marks.append(time.perf_counter())
        for name, begin, end in zip(stages, marks, marks[1:]):
            stages[name].append(end - begin)
    medians = {name: statistics.median(values[1:]) for name, values in stages.items()}
    # Per iteration, then the median: an iteration and its bare model work run back to back (as paired_ratio pairs).
    outside = [
        1.0 - bare / sum(stages[name][i] for name in stages if name != "bare model")
        for i, bare in enumerate(stages["bare model"])
    ][1:]
    return medians, statistics.median(outside)


class SleepingReward:
    """A reward that takes ``seconds_per_video`` per video (a stand-in for a reward model) and scores 0."""

    def __init__(self, seconds_per_video: float):
        self.seconds_per_video = seconds_per_video

    def __call__(self, videos, prompts):
        time.sleep(self.seconds_per_video * len(videos))
        return {"sleep": [0.0] * len(videos)}


def overlap_ratio(repeats: int, samples: int = 8) -> dict[str, float]:
    """Generate-then-score against scoring batch i while batch i+1 is generated, with a reward as slow as the rollout
    (one sample per batch, so ``samples`` batches). Ideal overlapped time: max(rollout, scoring) plus the last batch's
    scoring, which nothing can hide."""
    adapter = tiny_hunyuan15(seed=0)
    prompts = [f"a short video, number {i}" for i in range(samples // GROUP)]
    sample_prompts = in_groups(prompts, GROUP)
    config = TINY.sde

    def rollout(on_batch=None):
        return generate(adapter, prompts, GROUP, config, seed=0, batch_size=1, progress=False, on_batch=on_batch)

    rollout_s = median_seconds({"rollout": rollout}, repeats)["rollout"]
    scorer = Scorer(
        [RewardSpec(name="benchmarks.perf:SleepingReward", kwargs={"seconds_per_video": rollout_s / samples})],
        timeout_s=None,
    )

    def sequential():
        generated = rollout()
        scorer.score(VideoBatch.from_tensor(generated.videos, adapter.fps), sample_prompts)

    def overlapped():
        with scorer.overlapped(sample_prompts, fps=adapter.fps) as sink:
            rollout(on_batch=sink.submit)
            sink.result()

    medians = median_seconds({"sequential": sequential, "overlapped": overlapped}, repeats)
    return medians | {"rollout": rollout_s, "scoring": rollout_s}


def window_ratios(repeats: int, windows: tuple[int, ...] = (2, 4)) -> list[tuple[int, int, float]]:
    """(w, trained steps without a window, update time with w trained steps / with all of them)."""
    times = {}
    for window in (None, *windows):
        adapter = _trainable(TINY)
        rollout = _rollout(adapter, TINY.sde.model_copy(update={"window": None if window is None else (0, window)}))
        updater = _updater(adapter, rollout, strategy="none")
        advantages = _advantages(rollout)
        run = lambda updater=updater, rollout=rollout, advantages=advantages: updater.update(rollout, advantages)  # noqa: E731
        times[window] = median_seconds({"update": run}, repeats)["update"]
    all_trained = TINY.sde.steps - 1  # the last step is deterministic
    return [(w, all_trained, times[w] / times[None]) for w in windows]


def zero3_memory_ratio() -> tuple[float, dict, dict]:
    worker = Path(__file__).with_name("zero3_memory_worker.py")
    per_world = {}
    with tempfile.TemporaryDirectory() as out:
        for world in (1, 2):
            launch([str(worker), "--out", out], world=world, timeout_s=600)
            reports = [json.loads(Path(out, f"memory_rank{r}_world{world}.json").read_text()) for r in range(world)]
            per_world[world] = max(reports, key=lambda r: sum(r["bytes"].values()))["bytes"]
    return sum(per_world[2].values()) / sum(per_world[1].values()), per_world[1], per_world[2]


# ----------------------------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------------------------


def report_update(repeats: int, size: Size = TINY) -> None:
    # ZeRO-2 beside ZeRO-3 separates our update's own overhead from ZeRO-3's parameter gathering.
    target = 1.3 if size is TINY else 1.10
    for name in ("zero3", "zero2"):
        ratio = update_ratio(size, repeats, name)
        print(
            f"[{size.name}] update / bare (anchor + lagged fwd, policy fwd+bwd) ({name}, dual KL): {ratio}  "
            f"(target <= {target})",
            flush=True,
        )


def report_split(repeats: int, size: Size) -> None:
    for name in ("zero3", "zero2"):
        stages, outside = iteration_split(size, repeats, name)
        total = sum(v for k, v in stages.items() if k != "bare model")
        split = ", ".join(f"{k} {v * 1000:.0f} ms ({v / total:.0%})" for k, v in stages.items() if k != "bare model")
        target = "" if size is TINY else " (target <= 10%)"
        print(
            f"[{size.name}] iteration split ({name}): {split}; share outside model compute {outside:.0%}{target} "
            f"(bare model work {stages['bare model'] * 1000:.0f} ms of {total * 1000:.0f} ms)",
            flush=True,
        )


def report_overlap(repeats: int) -> None:
    times = overlap_ratio(repeats)
    ideal = max(times["rollout"], times["scoring"])
    print(
        f"[tiny] overlapped scoring, reward as slow as the rollout ({times['rollout'] * 1000:.0f} ms each, "
        "8 batches): "
        f"overlapped / sequential {times['overlapped'] / times['sequential']:.3f} (ideal 0.5 + 1/16), overlapped / "
        f"max(rollout, scoring) {times['overlapped'] / ideal:.3f} (ideal 1.125: the last batch's scoring; "
        f"{times['overlapped'] * 1000:.0f} ms vs {times['sequential'] * 1000:.0f} ms)",
        flush=True,
    )


def report_memory() -> None:
    memory, one, two = zero3_memory_ratio()
    print(
        f"ZeRO-3 model-state bytes per rank, 2 ranks / 1 rank: {memory:.3f}  (target <= 0.55; "
        f"1 rank {one}, 2 ranks {two})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--update-repeats",
        type=int,
        default=9,
        help="pairs for the update and rollout ratios and the iteration splits (the targets)",
    )
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "compute"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    distributed.init()
    print(
        f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"{'CUDA' if torch.cuda.is_available() else 'no GPU'}; 1 torch thread; {len(PROMPTS)} prompts x {GROUP} "
        f"samples in one micro-batch, full fine-tuning; tiny: {TINY.sde.steps} SDE steps, compute-bound: "
        f"{SIZES['compute'].sde.steps} ({TINY.sde.variant}); median of {args.repeats} "
        f"({args.update_repeats} pairs for the update ratios and splits)",
        flush=True,
    )
    for key in args.sizes:
        report_update(args.update_repeats, SIZES[key])
        report_split(args.update_repeats, SIZES[key])
    if "tiny" in args.sizes:
        print(
            f"[tiny] rollout / diffusers pipeline (20 steps, batch 4): {rollout_ratio(args.update_repeats)}  "
            "(target <= 1.05)",
            flush=True,
        )
        report_overlap(args.repeats)
        ratio, batched, single = batched_transitions_ratio(args.repeats)
        print(
            f"[tiny] update with all {TINY.sde.steps - 1} trained steps in one forward / one step per forward "
            f"(zero3): {ratio:.3f}  ({batched * 1000:.0f} ms vs {single * 1000:.0f} ms)",
            flush=True,
        )
        report_memory()
        for w, trained, ratio in window_ratios(args.repeats):
            print(
                f"[tiny] SDE window {w} of {trained} trained steps: update time ratio {ratio:.3f}  "
                f"(w/T = {w / trained:.3f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
