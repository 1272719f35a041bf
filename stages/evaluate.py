"""Stage 6, evaluation: held-out prompts, fixed seeds, deterministic sampling, every reward dimension and the
independent metrics; sample videos, frame grids and a per-prompt table (the run's plots: ``pipeline/report.py``).

Recipe: sample each held-out prompt once with the ODE sampler (the same seeds every time, so evaluations are
comparable across iterations and runs) -> score with the training rewards and the extra metrics -> write a few
videos (MP4 where an encoder is installed, else GIF) -> return the mean of every dimension, each prompt's scores and
its first, middle and last frames. :func:`log_samples` sends those to MLflow as an image series (a step slider in
the UI) and a table that grows by one block of rows per evaluation.

Sharded over data-parallel ranks: each (prompt, seed) is sampled once, by one data-parallel group, in whole batches of
the single-rank order, so every video and score is bit for bit a single-rank evaluation's (under sequence
parallelism the group's K ranks sample every batch together, then each decodes and scores every K-th one); the
scores and key frames are gathered to rank 0 alone (``write`` is true there), which computes the metrics and writes
the videos. Every rank runs as many batches as the busiest one (under ZeRO-3 a
forward is a collective, so all ranks must take part): a rank with fewer samples its first batch again and discards
it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from sage_grpo.core import distributed, plotting
from sage_grpo.core.distributed import ParallelLayout
from sage_grpo.core.errors import UserError
from sage_grpo.core.hacking_guard import Divergence, divergence
from sage_grpo.core.lazy import lazy_module
from sage_grpo.core.rewards.base import VideoBatch
from sage_grpo.core.rewards.registry import RewardSpec
from sage_grpo.core.storage import CheckpointError
from sage_grpo.stages.rollout import SDEConfig, generate
from sage_grpo.stages.score import Scorer

torch = lazy_module("torch", globals())


JUDGE_PREFIX = "judge/"  # a judge's dimensions are logged as eval/judge/<dimension>
GUARD_FIRED = "guard/fired"  # in an iteration's metrics when the hacking guard fired there
# The exit status of a run the hacking guard stopped: not 0 (it did not complete and registered nothing), not 75
# (a restart would not cure it), not 2 (the config is fine).
HACKING_STOP_EXIT_CODE = 3


class HackingGuardConfig(BaseModel):
    """The ``eval.guard`` section: what to do when the training reward rises on the evaluation prompts while a judge
    falls (``core.hacking_guard``). Acts only with ``eval.judges``; after acting it waits for ``window`` new
    evaluations before it can act again."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # warn: a warning and an MLflow tag; tighten: the KL weight's strength x tighten_factor (see core.grpo);
    # stop: the run stops (exit 3, nothing registered) and the best checkpoint by checkpoint.best_metric, a judge
    # metric, is exported to exports/best-by-judge-step-N.
    action: Literal["disabled", "warn", "tighten", "stop"] = "warn"  # not "off": YAML reads that as false
    window: int = Field(3, ge=2)  # evaluations the trends are read over
    min_reward_rise: float = Field(0.0, ge=0)  # eval/reward's fitted change over the window must exceed this
    # and a judge's fitted change must be below minus this. Not 0: a flat judge's change is never exactly 0, and on
    # the ToyWorld's non-hacking run a -3e-5 change of gold (of 0.045) fired it (docs/rewards.md).
    min_judge_drop: float = Field(0.001, ge=0)
    tighten_factor: float = Field(2.0, gt=1)
    # The judge dimensions watched (eval/judge/<name>); empty: every one. A dimension where lower is better (a count
    # of failures, such as the ToyWorld gold judge's "static") falls as a run improves: leave it out.
    judges: list[str] = Field(default_factory=list)


class EvalConfig(BaseModel):
    """The ``eval`` section: every k iterations, the first ``num_prompts`` held-out prompts (or all of a fixed set),
    fixed seeds."""

    model_config = ConfigDict(extra="forbid")

    every: int = Field(0, ge=0)  # iterations between evaluations; 0 disables
    num_prompts: int = Field(4, ge=1)
    # A fixed, versioned evaluation set (a path or s3:// URI, read as data.source is), evaluated whole instead of
    # the held-out split: runs on different prompt files are then scored on the same exam, which the promotion gate
    # requires. The held-out split changes with the prompt file.
    source: str | None = None
    seed: int = Field(1234, ge=0, lt=2**63)
    metrics: list[RewardSpec] = Field(default_factory=list)  # extra metrics (e.g. clipscore) beside the rewards
    # Rewards scored on the evaluation prompts and never trained on, logged as eval/judge/<dimension>: what the
    # hacking guard watches, and what the promotion gate can gate on.
    judges: list[RewardSpec] = Field(default_factory=list)
    guard: HackingGuardConfig = Field(default_factory=HackingGuardConfig)
    write_videos: int = Field(2, ge=0)
    # Evaluate the policy before its first update, and report every later evaluation as a paired difference against
    # it (same prompts, same seeds): eval/<name>/delta and its standard error, eval/<name>/delta_se. Without it a run
    # that lowers its reward looks like one whose reward moved.
    at_start: bool = True


@dataclass
class Evaluation:
    metrics: dict[str, float]
    videos: list[Path] = field(default_factory=list)  # the first ``write_videos`` prompts' videos, in order
    prompts: list[str] = field(default_factory=list)
    scores: dict[str, list[float | None]] = field(default_factory=dict)  # per prompt: each dimension and "reward"
    frames: np.ndarray | None = None  # uint8 [prompts, 3, H, W, 3]: first, middle, last frame


def evaluate(
    adapter,
    prompts: list[str],
    sde_config: SDEConfig,
    scorer: Scorer,
    *,
    seed: int,
    out_dir: Path,
    batch_size: int,
    write_videos: int,
    write: bool,
    embeddings=None,
    prompt_metadata: list[dict] | None = None,
    judges: Scorer | None = None,
    parallel: ParallelLayout | None = None,
) -> Evaluation:
    """``prompt_metadata``: each prompt's extra columns, passed to the rewards that take them (one video per prompt).
    ``judges``: scored beside ``scorer`` into ``judge/<dimension>``, never into the reward total. ``parallel``: the
    run's layout (plain data parallelism over this process's world when left out)."""
    parallel = parallel or ParallelLayout.build()
    deterministic = SDEConfig(variant="ode", steps=sde_config.steps, shift=sde_config.shift)
    positions, rounds = _my_batches(len(prompts), batch_size, parallel)

    def sample(at: list[int], decode: bool = True):
        return generate(
            adapter,
            [prompts[i] for i in at],
            1,
            deterministic,
            seed,
            prompt_ids=at,  # a prompt's noise follows from its position, on whichever rank samples it
            batch_size=batch_size,
            decode=decode,
            progress=False,
            embeddings=None if embeddings is None else embeddings.select(at),
            decode_batches=parallel.sequence_share,
        )

    rollout = sample(positions) if positions else None
    for _ in range(rounds - math.ceil(len(positions) / batch_size)):
        sample(list(range(min(batch_size, len(prompts)))), decode=False)

    def score_mine() -> dict:
        decoded = [] if rollout is None else rollout.decoded_samples
        if not decoded:
            return {"positions": []}
        mine = [positions[k] for k in decoded]
        metadata = None if prompt_metadata is None else [prompt_metadata[i] for i in mine]
        videos = VideoBatch.from_tensor(rollout.videos, adapter.fps)
        prompts_here = [prompts[i] for i in mine]
        scored = scorer.score(videos, prompts_here, metadata)
        judged = judges.score(videos, prompts_here, metadata).dimensions if judges else {}
        return {
            "positions": mine,
            "scores": {
                **scored.dimensions,
                **{JUDGE_PREFIX + name: values for name, values in judged.items()},
                "reward": list(scored.total),
            },
            "frames": key_frames(rollout.videos),
            "videos": {i: rollout.videos[k] for k, i in enumerate(mine) if i < write_videos},
        }

    shards = distributed.gather_to_main_or_raise(score_mine)
    if not write:  # rank 0 writes, and only rank 0 received the videos
        return Evaluation(metrics={})
    return _assembled(shards, prompts, adapter.fps, out_dir)


def paired_deltas(start: dict[str, list[float | None]], now: dict[str, list[float | None]]) -> dict[str, float]:
    """Each dimension's change since ``start`` as a paired difference over the prompts both scored (same prompts,
    same seeds: the prompt-to-prompt spread cancels): ``eval/<name>/delta``, the mean difference, and
    ``eval/<name>/delta_se``, its standard error (sample standard deviation / sqrt(n); NaN below two pairs)."""
    deltas = {}
    for name in sorted(start.keys() & now.keys()):
        pairs = [(b, a) for b, a in zip(start[name], now[name]) if _finite(b) and _finite(a)]
        differences = [a - b for b, a in pairs]  # type: ignore[operator]
        count = len(differences)
        mean = math.fsum(differences) / count if count else math.nan
        spread = math.sqrt(math.fsum((d - mean) ** 2 for d in differences) / (count - 1)) if count > 1 else math.nan
        deltas[f"eval/{name}/delta"] = mean
        deltas[f"eval/{name}/delta_se"] = spread / math.sqrt(count) if count > 1 else math.nan
    return deltas


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _my_batches(count: int, batch_size: int, parallel: ParallelLayout) -> tuple[list[int], int]:
    """This data-parallel rank's prompt positions, every n-th batch of the single-rank batches (n ranks), and the
    number of batches the busiest rank runs."""
    batches = [list(range(start, min(start + batch_size, count))) for start in range(0, count, batch_size)]
    ranks = parallel.data_parallel_size
    mine = batches[parallel.data_parallel_rank :: ranks]
    return [i for batch in mine for i in batch], math.ceil(len(batches) / ranks)


def _assembled(shards: list[dict], prompts: list[str], fps: int, out_dir: Path) -> Evaluation:
    """The ranks' shards in prompt order: metrics, written videos, per-prompt scores and key frames."""
    order = sorted((position, shard, k) for shard in shards for k, position in enumerate(shard["positions"]))
    names = next(shard["scores"] for shard in shards if shard["positions"])
    scores = {name: [shard["scores"][name][k] for _, shard, k in order] for name in names}
    metrics = {f"eval/{name}": _mean(values) for name, values in scores.items() if name != "reward"}
    metrics["eval/reward"] = _mean(scores["reward"])
    out_dir.mkdir(parents=True, exist_ok=True)
    videos = {i: video for shard in shards for i, video in shard.get("videos", {}).items()}
    written = [write_video(videos[i], fps, out_dir / f"eval_{i:02d}") for i in sorted(videos)]
    return Evaluation(
        metrics=metrics,
        videos=written,
        prompts=[prompts[position] for position, _, _ in order],
        scores=scores,
        frames=np.stack([shard["frames"][k] for _, shard, k in order]),
    )


def hacking_divergence(history: list[dict[str, float]], guard: HackingGuardConfig) -> Divergence | None:
    """The guard's signal on a run's metric history: eval/reward and every eval/judge/* over the evaluations since
    the guard last fired (so one episode acts once). A name in ``guard.judges`` that the last evaluation's judges do
    not report is a UserError: the guard would watch nothing."""
    _check_watched_names(history[-1] if history else {}, guard)
    since = max((i for i, metrics in enumerate(history) if GUARD_FIRED in metrics), default=-1) + 1
    evaluations = [metrics for metrics in history[since:] if "eval/reward" in metrics]
    judges = sorted({key for metrics in evaluations for key in metrics if _watched(key, guard)})
    return divergence(
        [metrics["eval/reward"] for metrics in evaluations],
        {name: [metrics.get(name, math.nan) for metrics in evaluations] for name in judges},
        window=guard.window,
        min_reward_rise=guard.min_reward_rise,
        min_judge_drop=guard.min_judge_drop,
    )


def _watched(key: str, guard: HackingGuardConfig) -> bool:
    prefix = "eval/" + JUDGE_PREFIX
    return key.startswith(prefix) and (not guard.judges or key.removeprefix(prefix) in guard.judges)


def _check_watched_names(metrics: dict[str, float], guard: HackingGuardConfig) -> None:
    prefix = "eval/" + JUDGE_PREFIX
    reported = sorted(key.removeprefix(prefix) for key in metrics if key.startswith(prefix))
    unknown = [name for name in guard.judges if name not in reported]
    if "eval/reward" in metrics and unknown:
        raise UserError(
            f"eval.guard.judges names {', '.join(unknown)}, which no judge reports (they report: "
            f"{', '.join(reported) or 'nothing'})"
        )


def best_step(store, metric: str) -> int | None:
    """The committed step of ``store`` (a ``core.storage`` checkpoint store) whose manifest records the highest
    finite ``metric``, the newer on a tie; None when none records it. A step with an unreadable manifest is passed
    over (restoring a step verifies it anyway)."""
    scored = {}
    for step in store.list_steps():
        try:
            value = store.read_manifest(step).extra.get(metric)
        except CheckpointError:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            scored[step] = value
    return max(scored, key=lambda step: (scored[step], step), default=None)


def eval_set_digest(prompts: list[str], metadata: list[dict]) -> str:
    """Identifies an evaluation set: its prompts with their metadata, in order (each prompt's seed follows from
    its position). 32 hex digits, what MLflow stores as a metric's dataset digest."""
    rows = "".join(
        json.dumps([text, meta], sort_keys=True, ensure_ascii=False) + "\n" for text, meta in zip(prompts, metadata)
    )
    return hashlib.sha256(rows.encode()).hexdigest()[:32]


def eval_sampler(sde: SDEConfig, guidance_scale: float, guidance_scale_2: float | None = None) -> dict:
    """The sampler settings that shape the scored videos: evaluation samples with the ODE (so the run's variant and
    eta do not apply) at the run's steps and shift, under the model's CFG scale(s)."""
    settings = {"variant": "ode", "steps": sde.steps, "shift": sde.shift, "guidance_scale": guidance_scale}
    return settings | ({} if guidance_scale_2 is None else {"guidance_scale_2": guidance_scale_2})


def eval_definition(rewards: list[RewardSpec], config: EvalConfig, set_digest: str, sampler: dict) -> tuple[str, str]:
    """What an evaluation's scores mean: the digest (32 hex digits) of the rewards with their weights (a preset
    expanded) and kwargs, the extra metrics, the judges, the evaluation set's digest, the seed and the sampler
    settings (``eval_sampler``); and a short account for people (names and weights only: kwargs may hold what a log
    must not). Two versions with one digest were scored the same way on the same exam. ``batch_size`` is left out:
    it changes how rewards are called, not what they say."""

    def described(spec: RewardSpec) -> dict:
        return {"name": spec.name, "kwargs": spec.kwargs, "weights": spec.explicit_weights()}

    definition = {
        "rewards": [described(spec) for spec in rewards],
        "metrics": [described(spec) for spec in config.metrics],
        "judges": [described(spec) for spec in config.judges],
        "prompt_set": set_digest,
        "seed": config.seed,
        "sampler": sampler,
    }
    digest = hashlib.sha256(json.dumps(definition, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def names(specs: list[RewardSpec]) -> str:
        return ", ".join(spec.name + ("" if spec.weights is None else f" {spec.explicit_weights()}") for spec in specs)

    summary = f"rewards {names(rewards)}"
    summary += f"; metrics {names(config.metrics)}" if config.metrics else ""
    summary += f"; judges {', '.join(spec.name for spec in config.judges)}" if config.judges else ""
    settings = ", ".join(f"{key} {value:g}" for key, value in sampler.items() if key != "variant")
    return digest, f"{summary}; seed {config.seed}; {sampler['variant']} {settings}"


def key_frames(videos: torch.Tensor) -> np.ndarray:
    """uint8 [N, F, H, W, 3] -> [N, 3, H, W, 3]: each video's first, middle and last frame."""
    count = videos.shape[1]
    return videos[:, [0, count // 2, count - 1]].cpu().numpy()


# MLflow
# ----------------------------------------------------------------------------------------------------------------


EVAL_TABLE = "eval_samples.json"


def log_samples(tracker, evaluation: Evaluation, iteration: int, video_dir: str) -> None:
    """The evaluation's frame grid as MLflow image series ``eval/frames`` at step ``iteration``, and its rows
    (iteration, prompt, every score, the video's artifact path under ``video_dir`` or "" when it was not written)
    appended to the table ``eval_samples.json``. ``tracker``: a ``core.tracking.Tracker``."""
    if evaluation.frames is None:
        return
    rewards = evaluation.scores.get("reward", [None] * len(evaluation.prompts))
    labels = [f"{prompt[:60]}  reward {score_text(reward)}" for prompt, reward in zip(evaluation.prompts, rewards)]
    tracker.log_image(frame_grid(evaluation.frames, labels), key="eval/frames", step=iteration)
    tracker.log_table(eval_table(evaluation, iteration, video_dir), EVAL_TABLE)


def eval_table(evaluation: Evaluation, iteration: int, video_dir: str) -> dict[str, list]:
    """Columns: iteration, prompt, one per score (None where a reward gave none), video."""
    count = len(evaluation.prompts)
    videos = [f"{video_dir}/{path.name}" for path in evaluation.videos]
    return {
        "iteration": [iteration] * count,
        "prompt": list(evaluation.prompts),
        **{name: [finite_or_none(v) for v in values] for name, values in evaluation.scores.items()},
        "video": videos + [""] * (count - len(videos)),
    }


def finite_or_none(value: float | None) -> float | None:
    # JSON has no nan: a missing score is null in the table, as the reward contract spells it.
    return None if value is None or not math.isfinite(value) else float(value)


def score_text(value: float | None) -> str:
    """A score as a label shows it: three significant digits, or "none" where there is none."""
    return "none" if finite_or_none(value) is None else f"{value:.3g}"


def _mean(values: list[float | None]) -> float:
    scored = [v for v in values if v is not None and not math.isnan(v)]
    return sum(scored) / len(scored) if scored else float("nan")


def write_video(frames: torch.Tensor, fps: int, stem: Path) -> Path:
    """uint8 [F, H, W, 3] to ``stem.mp4`` when imageio has an ffmpeg backend, else ``stem.gif``."""
    import imageio.v3 as iio

    array = frames.cpu().numpy()
    try:
        path = stem.with_suffix(".mp4")
        iio.imwrite(path, array, fps=fps, codec="libx264")
    except Exception:  # no ffmpeg plugin installed: GIF needs only Pillow
        path = stem.with_suffix(".gif")
        iio.imwrite(path, array, duration=1000 / fps, loop=0)
    return path


# Frames
# ----------------------------------------------------------------------------------------------------------------


def frame_grid(frames: np.ndarray, labels: list[str]) -> np.ndarray:
    """uint8 [N, 3, H, W, 3] key frames -> one RGB image: a row per video (first, middle, last frame) under its
    label."""
    plt = plotting.pyplot()
    rows = len(frames)
    fig, axes = plt.subplots(rows, 3, figsize=(7.5, 2.8 * rows), squeeze=False)
    for row, (video, label) in enumerate(zip(frames, labels)):
        for column, (frame, name) in enumerate(zip(video, ("first", "middle", "last"))):
            axes[row, column].imshow(frame)
            axes[row, column].set_axis_off()
            axes[row, column].set_title(name, fontsize=7)
        axes[row, 0].text(0, 1.15, label, transform=axes[row, 0].transAxes, fontsize=8, va="bottom")
    fig.tight_layout()
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return image
