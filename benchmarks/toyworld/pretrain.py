"""Fit the tiny HunyuanVideo 1.5 transformer to ToyWorld with flow matching, or load the weights cached for these
settings. The default, 5000 steps, took 15 minutes on a shared 2-core CPU (one thread, load average ~4) and moves the
square the captioned way: on 8-step ODE samples of the 4 held-out captions (16 each) gold 0.519, 95.3% of squares
moving the captioned way, 1.6% static, none the wrong way (direction 0.786, colour 0.833, VQ 0.782, MQ 0.441). The
earlier 1500 steps reached colour 0.76 but direction 0.12: gold 0.060, 12.5% the captioned way, 35.9% static, 28.1%
the wrong way, too rare for gold to be learnable. Much shorter pretraining is not a cheaper stand-in: 150 steps give
a model (reward 0.12) that GRPO only degrades.

    python -m benchmarks.toyworld.pretrain [--steps N] [--force] [--ship]

The default weights ship with the repository (``SHIPPED_DIR``): without --force this loads them.

Flow matching, as the model samples: x_t = (1 - sigma) x_0 + sigma * noise, sigma drawn uniformly in time and then
shifted exactly like the sampling schedule, so training covers the sigmas rollouts visit. The transformer predicts x_0
(``model.py`` says why), so the loss is the MSE of x_0; sampling uses the velocity (x_t - x0_hat) / sigma.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sage_grpo.core.rewards.base import VideoBatch
from sage_grpo.core.sde import shift_sigmas
from sage_grpo.stages.rollout import SDEConfig, generate

from . import world
from .model import (
    CACHE_DIR,
    UNUSED_BRANCHES,
    ToyWorldAdapter,
    build_transformer,
    train_used_weights,
    weights_key,
    weights_sha256,
)
from .rewards import GoldJudge, ToyWorldReward, manifold_drift

SHIFT = 3.0  # the flow shift of both pretraining and every rollout on ToyWorld


@dataclass(frozen=True)
class PretrainConfig:
    steps: int = 5000  # 1500 left the direction unlearnt (module docstring)
    batch_size: int = 32
    learning_rate: float = 2e-3
    warmup_steps: int = 50
    shift: float = SHIFT
    seed: int = 0


def pretrain_config(steps: int | None = None) -> PretrainConfig:
    """The default pretraining, or the same with ``steps`` optimizer steps."""
    return PretrainConfig() if steps is None else dataclasses.replace(PretrainConfig(), steps=steps)


# The default pretraining's weights ship with the repository: 21 minutes of fitting is no part of checking a number,
# and pretraining on another CPU gives other weights (float reductions differ), so a fresh machine could not
# reproduce RESULTS.md's ToyWorld tables otherwise. Only the trained weights ship: the unused branches never leave
# their initialisation (``build_transformer(seed)``), which rebuilds them bit for bit, and so the cache file's sha256.
SHIPPED_DIR = Path(__file__).resolve().parent / "pretrained"


def cache_path(config: PretrainConfig):
    return CACHE_DIR / f"{weights_key(dataclasses.asdict(config))}.safetensors"


def shipped_path(config: PretrainConfig) -> Path:
    return SHIPPED_DIR / f"{weights_key(dataclasses.asdict(config))}.safetensors"


def cached_weights(config: PretrainConfig) -> Path:
    """The cache file of ``config``'s weights, written from the shipped weights where the cache has none yet (the
    path is returned either way: whoever reads it says what to do when it is missing)."""
    path, shipped = cache_path(config), shipped_path(config)
    if not path.exists() and shipped.exists():
        trained = load_file(str(shipped))
        initial = build_transformer(config.seed).state_dict()
        state = {name: trained.get(name, value).contiguous() for name, value in initial.items()}
        _write_atomically(state, path)
    return path


def ship(config: PretrainConfig) -> Path:
    """Write the trained part of the cached weights where the repository ships them."""
    state = load_file(str(cache_path(config)))
    trained = {name: value for name, value in state.items() if not name.startswith(UNUSED_BRANCHES)}
    _write_atomically(trained, shipped_path(config))
    return shipped_path(config)


def _write_atomically(state: dict[str, torch.Tensor], path: Path) -> None:
    # Write then rename: a run killed mid-write must not leave a truncated file under the final name.
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".partial-{os.getpid()}")
    save_file(state, str(partial))
    os.replace(partial, path)


def _learning_rate(config: PretrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to zero."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.learning_rate * 0.5 * (1 + math.cos(math.pi * progress))


def fit(config: PretrainConfig, log_every: int = 100) -> dict[str, torch.Tensor]:
    """Train from the seed and return the transformer's weights."""
    transformer = train_used_weights(build_transformer(config.seed)).train()
    adapter = ToyWorldAdapter(transformer)
    videos, scenes = world.manifold()
    latents = world.encode(videos)
    embeddings = adapter.encode_prompts([scene.caption for scene in scenes])
    optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=config.learning_rate)
    generator = torch.Generator().manual_seed(config.seed)
    start = time.perf_counter()
    for step in range(config.steps):
        index = torch.randint(len(latents), (config.batch_size,), generator=generator)
        x0 = latents[index]
        noise = torch.randn(x0.shape, generator=generator)
        sigma = shift_sigmas(torch.rand(config.batch_size, generator=generator), config.shift).float()
        s = sigma.view(-1, 1, 1, 1, 1)
        x0_hat = adapter.predict_clean((1 - s) * x0 + s * noise, sigma, embeddings.select(index))
        loss = torch.nn.functional.mse_loss(x0_hat, x0)
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(config, step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        if log_every and (step % log_every == 0 or step == config.steps - 1):
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - start:6.1f}s", flush=True)
    return {name: value.detach().contiguous() for name, value in transformer.state_dict().items()}


def pretrained_adapter(
    config: PretrainConfig = PretrainConfig(), *, force: bool = False, log_every: int = 0
) -> ToyWorldAdapter:
    """The adapter with weights for ``config``: from the cache, or fitted now and cached."""
    path = cache_path(config) if force else cached_weights(config)
    if force or not path.exists():
        _write_atomically(fit(config, log_every=log_every), path)
    transformer = build_transformer(config.seed)
    transformer.load_state_dict(load_file(str(path)), strict=True)
    return ToyWorldAdapter(transformer.eval())


def evaluate(
    adapter: ToyWorldAdapter,
    *,
    captions: list[str] = world.CAPTIONS,
    samples_per_caption: int = 4,
    steps: int = 8,
    shift: float = SHIFT,
    seed: int = 10_000,
):
    """Mean rewards (with TA's colour and direction halves) and drift of deterministic (ODE) samples of every
    caption (default: all 16), from fixed initial noise: the same evaluation set before and after any training."""
    samples = len(captions) * samples_per_caption
    rollout = generate(
        adapter,
        captions,
        samples_per_caption,
        SDEConfig(variant="ode", steps=steps, shift=shift),
        seed=seed,
        batch_size=samples,
        progress=False,
    )
    videos = VideoBatch.from_tensor(rollout.videos, adapter.fps)
    scores = ToyWorldReward(parts=True)(videos, rollout.sample_prompts) | GoldJudge()(videos, rollout.sample_prompts)
    summary = {name: sum(values) / len(values) for name, values in scores.items()}
    summary["drift"] = sum(manifold_drift(videos)) / len(videos)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, help="override the number of optimizer steps")
    parser.add_argument("--force", action="store_true", help="refit even when cached weights exist")
    parser.add_argument(
        "--ship", action="store_true", help="write the trained weights where the repository ships them (then re-pin)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # on a shared 2-core machine one thread is fastest and steadiest
    config = pretrain_config(args.steps)
    start = time.perf_counter()
    adapter = pretrained_adapter(config, force=args.force, log_every=100)
    print(f"weights: {cache_path(config)}  ({time.perf_counter() - start:.1f}s)")
    if args.ship:
        print(f"shipped: {ship(config)}; pin sha256 {weights_sha256(cache_path(config))} in configs/toyworld.yaml")
    with torch.no_grad():
        for name, captions, samples in (("held-out", world.HELD_OUT_CAPTIONS, 16), ("train", world.TRAIN_CAPTIONS, 4)):
            scores = evaluate(adapter, captions=captions, samples_per_caption=samples)
            print(f"ODE samples, 8 steps, {name} captions:", {k: round(v, 3) for k, v in scores.items()})


if __name__ == "__main__":
    main()
