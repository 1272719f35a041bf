"""GRPO on ToyWorld for every SDE variant x KL strategy over several seeds: reward gain per dimension, on-manifold
drift, time to a reward threshold, wall time. Writes ``table.md``, ``results.json`` and ``curves.png``.

    python -m benchmarks.toyworld.compare [--iterations K] [--seeds 3] [--variants sage flow] [--kl dual none]
                                          [--jobs 2] [--quick] [--out DIR]
    python -m benchmarks.toyworld.compare --from-results DIR/results.json   # redraw table and plot only

Each run: the cached pretrained model (``pretrain.py``), full fine-tuning of its used weights on a 1-process DeepSpeed
engine (ZeRO-2, see ``Settings``) through ``stages.update.Updater``, K iterations of (rollout of P captions x G
samples, analytic rewards with Setting B weights, group advantages, one optimizer update). Before and after training,
deterministic (ODE) samples of all 16 captions measure the reward gain and the drift; the drift of every training
rollout is logged too.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import torch

from core import distributed
from core.grpo import group_advantages
from core.rewards.base import VideoBatch, weighted_total
from stages.rollout import SDEConfig, generate
from stages.update import TrustRegionConfig, UpdateConfig, Updater, accumulation_steps, build_engine

from . import world
from .model import train_used_weights
from .pretrain import SHIFT, PretrainConfig, evaluate, pretrained_adapter
from .rewards import WEIGHTS, ToyWorldReward, manifold_drift

VARIANTS = ("dance", "flow", "cps", "sage")
KL_STRATEGIES = ("none", "fixed", "dual")
# Each method's own exploration scale (shared/spec/sage-grpo.md): DanceGRPO's on HunyuanVideo, Flow-GRPO's, and the
# SAGE reference default, which CPS (no published default for video) shares.
ETAS = {"dance": 0.25, "flow": 0.7, "cps": 0.5, "sage": 0.5}
DIMENSIONS = ("TA", "VQ", "MQ")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Settings:
    """One sweep's shared settings. The KL weight schedule has the paper's shape (warm-up, then feedback toward a
    target) at the toy's scale: with the paper's [1e-7, 1e-5] the KL gradient would be about 1e-5 of the policy
    gradient here, i.e. no KL at all; the target is the position KL that calibration runs settle at."""

    iterations: int = 40
    prompts: int = 4  # drawn from caption_pool every iteration
    caption_pool: tuple[str, ...] = tuple(world.CAPTIONS)
    group_size: int = 4
    steps: int = 8
    # Full fine-tuning with Adam: 1e-4 learns steadily, 3e-4 collapses VQ within a few updates without a KL term
    # (calibration runs with sage); in between, where stability is at stake, is where the strategies can differ.
    learning_rate: float = 2e-4
    anchor_interval: int = 10
    kl_initial: float = 1e-2
    kl_maximum: float = 1.0
    kl_warmup_steps: int = 5
    kl_target: float = 3e-3
    threshold_gain: float = 0.05
    # ZeRO-2 on one process is the same optimizer maths as ZeRO-3 without its per-layer gather hooks, which on a
    # CPU make a model this small about 3x slower (benchmarks/perf.py measures ZeRO-3 itself).
    deepspeed_config: str = "zero2"
    pretrain: PretrainConfig = PretrainConfig()

    def quick(self) -> "Settings":
        return dataclasses.replace(self, iterations=8)


@dataclass(frozen=True)
class Run:
    variant: str
    kl: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant}/{self.kl}"


# ----------------------------------------------------------------------------------------------------------------
# One run
# ----------------------------------------------------------------------------------------------------------------


def _captions(settings: Settings, seed: int, iteration: int) -> list[str]:
    generator = torch.Generator().manual_seed(seed * 100_003 + iteration)
    pool = settings.caption_pool
    return [pool[i] for i in torch.randperm(len(pool), generator=generator)[:settings.prompts].tolist()]


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def _updater(adapter, run: Run, settings: Settings) -> Updater:
    samples = settings.prompts * settings.group_size
    update_config = UpdateConfig(learning_rate=settings.learning_rate, micro_batch_size=samples, seed=run.seed)
    trust_config = TrustRegionConfig(
        strategy=run.kl, anchor_interval=settings.anchor_interval, kl_initial=settings.kl_initial,
        kl_maximum=settings.kl_maximum, kl_warmup_steps=settings.kl_warmup_steps, kl_target=settings.kl_target)
    trained_steps = settings.steps - 1  # the last step (sigma_next = 0) is deterministic
    engine = build_engine(adapter.transformer, update_config, deepspeed_config_name=settings.deepspeed_config,
                          accumulation_steps=accumulation_steps(samples, samples, trained_steps))
    return Updater(engine, adapter, update_config, trust_config)


def _iteration(adapter, updater: Updater, run: Run, settings: Settings, iteration: int) -> dict:
    """Rollout, rewards, advantages, one update; returns the iteration's rollout metrics and stage times."""
    sde_config = SDEConfig(variant=run.variant, eta=ETAS[run.variant], steps=settings.steps, shift=SHIFT)
    captions = _captions(settings, run.seed, iteration)
    ids = [iteration * settings.prompts + j for j in range(settings.prompts)]  # unique groups: fresh samples
    samples = settings.prompts * settings.group_size
    start = time.perf_counter()
    rollout = generate(adapter, captions, settings.group_size, sde_config, seed=run.seed, prompt_ids=ids,
                       batch_size=samples, progress=False)
    videos = VideoBatch.from_tensor(rollout.videos, adapter.fps)
    scores = ToyWorldReward()(videos, rollout.sample_prompts)
    totals = weighted_total(scores, WEIGHTS, samples)
    drift = manifold_drift(videos)
    update_start = time.perf_counter()
    metrics = updater.update(rollout, group_advantages(totals, rollout.group_ids))
    return {
        "iteration": iteration, "reward": _mean(totals), **{d: _mean(scores[d]) for d in DIMENSIONS},
        "drift": _mean(drift), "kl": metrics["kl"], "lambda_kl": metrics["lambda_kl"],
        "grad_norm": metrics["grad_norm"], "rollout_s": update_start - start,
        "update_s": time.perf_counter() - update_start,
    }


def run_grpo(run: Run, settings: Settings) -> dict:
    """Train one configuration and return its per-iteration history and before/after evaluations."""
    torch.set_num_threads(1)  # one thread per run: on a shared 2-core machine more threads only add contention
    distributed.init()
    torch.manual_seed(run.seed)
    adapter = pretrained_adapter(settings.pretrain)
    train_used_weights(adapter.transformer)
    updater = _updater(adapter, run, settings)
    before = evaluate(adapter)
    history, start = [], time.perf_counter()
    for iteration in range(settings.iterations):
        history.append(_iteration(adapter, updater, run, settings, iteration))
        history[-1]["elapsed_s"] = time.perf_counter() - start
    after = evaluate(adapter)
    del updater
    gc.collect()  # the engine holds the model and optimizer states: free them before the next run in this process
    return {"variant": run.variant, "kl": run.kl, "seed": run.seed, "before": before, "after": after,
            "history": history, "wall_s": time.perf_counter() - start}


# ----------------------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------------------


def time_to_threshold(history: list[dict], gain: float) -> tuple[float, float]:
    """(iterations, seconds) until the 3-iteration moving average of the training reward first exceeds its start by
    ``gain``; NaN when it never does."""
    rewards = [h["reward"] for h in history]
    start = statistics.mean(rewards[:3])
    for i in range(2, len(rewards)):
        if statistics.mean(rewards[i - 2:i + 1]) >= start + gain:
            return float(i + 1), history[i]["elapsed_s"]
    return float("nan"), float("nan")


def _spread(values: list[float]) -> tuple[float, float]:
    finite = [v for v in values if v == v]
    if not finite:
        return float("nan"), float("nan")
    return statistics.mean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0


def summarise(results: list[dict], settings: Settings) -> list[dict]:
    """One row per configuration: mean and standard deviation over seeds of every reported quantity."""
    rows = []
    for key, group in itertools.groupby(sorted(results, key=lambda r: (r["variant"], r["kl"])),
                                        key=lambda r: (r["variant"], r["kl"])):
        group = list(group)
        columns = {f"{d} gain": [r["after"][d] - r["before"][d] for r in group] for d in DIMENSIONS}
        columns["reward gain"] = [sum(WEIGHTS[d] * (r["after"][d] - r["before"][d]) for d in DIMENSIONS) for r in group]
        columns["eval drift change"] = [r["after"]["drift"] - r["before"]["drift"] for r in group]
        columns["rollout drift"] = [_mean(h["drift"] for h in r["history"]) for r in group]
        columns["rollout reward first 5"] = [_mean(h["reward"] for h in r["history"][:5]) for r in group]
        columns["rollout reward last 5"] = [_mean(h["reward"] for h in r["history"][-5:]) for r in group]
        thresholds = [time_to_threshold(r["history"], settings.threshold_gain) for r in group]
        columns["iters to +gain"] = [t[0] for t in thresholds]
        columns["s to +gain"] = [t[1] for t in thresholds]
        columns["reached"] = [float(t[0] == t[0]) for t in thresholds]
        columns["wall s"] = [r["wall_s"] for r in group]
        rows.append({"variant": key[0], "kl": key[1], "seeds": len(group),
                     **{name: _spread(values) for name, values in columns.items()}})
    return rows


def markdown_table(rows: list[dict], settings: Settings) -> str:
    names = [k for k in rows[0] if k not in ("variant", "kl", "seeds")]
    header = ["variant", "KL"] + [n.replace("+gain", f"+{settings.threshold_gain:g}") for n in names]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["variant"], row["kl"]]
        for name in names:
            mean, std = row[name]
            if name == "reached":
                cells.append(f"{round(mean * row['seeds'])}/{row['seeds']}")
                continue
            digits = 0 if name in ("wall s", "s to +gain") else 1 if name == "iters to +gain" else 3
            cells.append("—" if mean != mean else f"{mean:.{digits}f} ± {std:.{digits}f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kls = sorted({r["kl"] for r in results}, key=KL_STRATEGIES.index)
    figure, axes = plt.subplots(2, len(kls), figsize=(5 * len(kls), 7), squeeze=False, sharex=True)
    for column, kl in enumerate(kls):
        for variant in VARIANTS:
            group = [r for r in results if r["kl"] == kl and r["variant"] == variant]
            if not group:
                continue
            for row, quantity in enumerate(("reward", "drift")):
                curves = torch.tensor([[h[quantity] for h in r["history"]] for r in group])
                mean, std = curves.mean(0), curves.std(0) if len(group) > 1 else torch.zeros(curves.shape[1])
                x = range(len(mean))
                axes[row, column].plot(x, mean, label=variant)
                axes[row, column].fill_between(x, mean - std, mean + std, alpha=0.2)
        axes[0, column].set_title(f"KL: {kl}")
        axes[0, column].set_ylabel("rollout reward (Setting B)")
        axes[1, column].set_ylabel("rollout drift (RMS to manifold)")
        axes[1, column].set_xlabel("iteration")
        axes[0, column].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def _run_all(runs: list[Run], settings: Settings, jobs: int) -> list[dict]:
    if jobs == 1:
        return [_logged(run, settings) for run in runs]
    # Each worker is its own 1-process DeepSpeed world; spawn, because a forked child inherits torch's thread pools.
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        return list(pool.map(_logged, runs, [settings] * len(runs)))


def _logged(run: Run, settings: Settings) -> dict:
    result = run_grpo(run, settings)
    first, last = result["history"][0], result["history"][-1]
    print(f"{run.name:12s} seed {run.seed}: reward {first['reward']:.3f} -> {last['reward']:.3f}, "
          f"drift {first['drift']:.3f} -> {last['drift']:.3f}, {result['wall_s']:.0f}s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, help=f"GRPO iterations per run (default {Settings.iterations})")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--kl", nargs="+", choices=KL_STRATEGIES, default=list(KL_STRATEGIES))
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel, one process each")
    parser.add_argument("--quick", action="store_true", help=f"{Settings().quick().iterations} iterations per run")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--from-results", type=Path, help="only rewrite the table and plot from a results.json")
    args = parser.parse_args()
    if args.from_results:
        _report(*_load_results(args.from_results), args.out)
        return

    settings = Settings().quick() if args.quick else Settings()
    if args.iterations:
        settings = dataclasses.replace(settings, iterations=args.iterations)
    torch.set_num_threads(1)
    pretrained_adapter(settings.pretrain, log_every=100)  # fit once here, not in every worker
    runs = [Run(v, k, s) for s in range(args.seeds) for v in args.variants for k in args.kl]
    start = time.perf_counter()
    results = _run_all(runs, settings, args.jobs)
    _report(results, settings, time.perf_counter() - start, args.out)


def _load_results(path: Path) -> tuple[list[dict], Settings, float | None]:
    saved = json.loads(path.read_text())
    fields = saved["settings"]
    # Results written before the caption pool existed drew from every caption.
    settings = Settings(**{**fields, "caption_pool": tuple(fields.get("caption_pool", world.CAPTIONS)),
                           "pretrain": PretrainConfig(**fields["pretrain"])})
    return saved["runs"], settings, saved.get("wall_s")


def _report(results: list[dict], settings: Settings, wall_s: float | None, out: Path) -> None:
    rows = summarise(results, settings)
    table = markdown_table(rows, settings)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"settings": dataclasses.asdict(settings), "etas": ETAS,
                                                  "wall_s": wall_s, "runs": results, "summary": rows}, indent=1))
    (out / "table.md").write_text(table + "\n")
    plot(results, out / "curves.png")
    print(table)
    print(f"total wall time {wall_s:.0f}s; wrote {out}" if wall_s else f"wrote {out}")


if __name__ == "__main__":
    main()
