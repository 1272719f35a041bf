"""The pipeline as a recipe.

    ingest -> for each iteration: rollout -> score -> advantages -> update (anchor refresh inside) ->
              (every k) evaluate -> (every m) checkpoint

Works the same in one process, under the ``deepspeed`` launcher and under ``torchrun``: every rank runs this
function; rank 0 logs. Ranks agree on stop decisions (preemption, time budget) through a collective, so no rank
leaves a collective the others are still in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core import distributed
from pipeline.config import RunConfig
from core.errors import RETRYABLE_EXIT_CODE, UserError
from core.grpo import group_advantages
from core.lora import add_lora
from core.models import build_adapter
from core.models.base import PromptEmbeddings
from core.rewards.base import VideoBatch
from core.storage import CheckpointStore, load_torch
from core.tracking import Tracker, masked_config
from stages import evaluate as evaluation
from stages.ingest import EmbeddingCache, PromptSampler, ingest
from stages.rollout import generate
from stages.score import Scorer
from stages.update import Updater, accumulation_steps, build_engine

logger = logging.getLogger(__name__)

ENGINE_TAG = "engine"


@dataclass
class RunSummary:
    status: str                     # "completed", "preempted" or "time_budget"
    iterations: int
    output_dir: Path
    checkpoint: str | None
    tracking_uri: str | None
    run_id: str | None
    history: list[dict[str, float]] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return RETRYABLE_EXIT_CODE if self.status == "preempted" else 0


@dataclass
class Policy:
    """Everything that trains or generates: the model adapter, its DeepSpeed engine and the update state."""

    adapter: object
    engine: object
    updater: Updater


def run(config: RunConfig, *, resume: str | None = None) -> RunSummary:
    distributed.init(config.deepspeed.collective_timeout_minutes)
    output_dir = config.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    if distributed.is_main():
        (output_dir / "config.json").write_text(json.dumps(masked_config(config), indent=2))

    prompts = ingest(config.data)
    logger.info("prompts: %s", prompts.report.summary())
    train_prompts = [p.text for p in prompts.train]
    eval_prompts = [p.text for p in prompts.eval][: config.eval.num_prompts]
    if len(train_prompts) < config.rollout.prompts_per_rank * distributed.world_size():
        raise UserError(f"{len(train_prompts)} training prompts cannot fill rollout.prompts_per_rank="
                        f"{config.rollout.prompts_per_rank} on {distributed.world_size()} rank(s)")

    policy = build_policy(config)
    embeddings = CachedEmbeddings(EmbeddingCache(output_dir / "embedding-cache"), policy.adapter)
    scorer = build_scorer(config)
    scorer.setup(distributed.device())
    eval_scorer = build_scorer(config, evaluation=True) if eval_prompts and config.eval.every else None
    sampler = PromptSampler(len(train_prompts), config.rollout.prompts_per_rank, distributed.rank(),
                            distributed.world_size(), config.seed)
    store = config.checkpoint.build(output_dir)
    state = RunState()
    if resume:
        restore(store, resume, config, policy, sampler, state)
    tracker = Tracker(config.tracking, output_dir)
    state.mlflow_run_id = tracker.start(config, run_id=state.mlflow_run_id) if distributed.is_main() else None

    audit = Audit(output_dir / "audit" / f"rank-{distributed.rank()}.jsonl")
    status, started = "completed", time.monotonic()
    with preemption_signals() as preempted:
        while state.iteration < config.run.max_iterations:
            metrics = train_iteration(config, policy, embeddings, scorer, sampler, train_prompts, state.iteration,
                                      audit)
            state.iteration += 1
            if eval_scorer and state.iteration % config.eval.every == 0:
                metrics |= run_evaluation(config, policy, embeddings, eval_scorer, eval_prompts, state, tracker)
            metrics["iteration"] = state.iteration
            state.history.append(metrics)
            tracker.log_metrics(metrics, step=state.iteration)
            log_progress(metrics)

            out_of_time = config.run.time_budget_minutes is not None and \
                time.monotonic() - started > 60 * config.run.time_budget_minutes
            stop = distributed.any_rank(preempted() or out_of_time)
            last = state.iteration == config.run.max_iterations
            due = config.checkpoint.every and state.iteration % config.checkpoint.every == 0
            if stop or last or due:
                # Late: a run opened after a tracking outage has its id only now.
                state.mlflow_run_id = tracker.run_id or state.mlflow_run_id
                save_checkpoint(store, config, policy, sampler, state)
            if stop:
                status = "preempted" if preempted() else "time_budget"
                break

    fingerprint = distributed.weights_fingerprint(policy.engine.module)
    audit.write({"iteration": state.iteration, "weights_sha256": fingerprint, "status": status})
    if status == "completed" and config.registry.model_name:
        publish(config, policy, embeddings, eval_scorer or build_scorer(config, evaluation=True), eval_prompts, state,
                tracker)
    if distributed.is_main():
        tracker.set_tag("weights_sha256", fingerprint)
        curve = evaluation.plot_reward_curves(state.history, output_dir / "plots" / "reward_curves.png")
        tracker.log_artifact(curve, "plots")
        tracker.log_artifact(output_dir / "config.json")
        tracker.finish("KILLED" if status == "preempted" else "FINISHED")
    return RunSummary(status, state.iteration, output_dir, store.uri if state.last_checkpoint is not None else None,
                      tracker.tracking_uri if distributed.is_main() else None, state.mlflow_run_id, state.history)


# ----------------------------------------------------------------------------------------------------------------
# One iteration
# ----------------------------------------------------------------------------------------------------------------


def train_iteration(config: RunConfig, policy: Policy, embeddings, scorer: Scorer, sampler: PromptSampler,
                    train_prompts: list[str], iteration: int, audit: "Audit") -> dict[str, float]:
    timings = {}
    clock = time.perf_counter()
    prompt_ids = next(sampler)
    audit.write({"iteration": iteration + 1, "prompt_ids": prompt_ids})
    batch_prompts = [train_prompts[i] for i in prompt_ids]
    rollout = generate(policy.adapter, batch_prompts, config.rollout.group_size, config.sde,
                       iteration_seed(config.seed, iteration), prompt_ids=prompt_ids,
                       batch_size=config.update.micro_batch_size, embeddings=embeddings(batch_prompts))
    timings["time/rollout"], clock = time.perf_counter() - clock, time.perf_counter()

    scored = scorer.score(VideoBatch.from_tensor(rollout.videos, policy.adapter.fps), rollout.sample_prompts)
    timings["time/score"], clock = time.perf_counter() - clock, time.perf_counter()

    advantages = group_advantages(scored.total, rollout.group_ids, global_std=config.update.global_std,
                                  clip=config.update.advantage_clip)
    update_metrics = policy.updater.update(rollout, advantages)
    timings["time/update"] = time.perf_counter() - clock

    metrics = reward_metrics(scored) | {f"update/{k}": v for k, v in update_metrics.items()}
    metrics["advantage/abs_mean"] = distributed.all_reduce_mean(
        {"a": float(advantages.values[advantages.valid].abs().mean()) if advantages.valid.any() else 0.0})["a"]
    metrics["advantage/valid_fraction"] = distributed.all_reduce_mean(
        {"v": float(advantages.valid.float().mean())})["v"]
    metrics |= distributed.all_reduce_mean(timings)
    seconds = sum(timings.values())
    metrics["samples_per_second"] = rollout.num_samples * distributed.world_size() / seconds
    return metrics


def reward_metrics(scored) -> dict[str, float]:
    """Mean and std of the total and of every dimension over all ranks' samples; missing scores are left out."""
    sums = {}
    for name, values in [("reward", scored.total)] + [(f"reward/{k}", v) for k, v in scored.dimensions.items()]:
        present = [v for v in values if v is not None and not math.isnan(v)]
        sums[f"{name}|n"] = len(present)
        sums[f"{name}|s"] = sum(present)
        sums[f"{name}|ss"] = sum(v * v for v in present)
    sums["failed|n"] = sum(scored.failed.values())
    means = distributed.all_reduce_mean(sums)  # equal factors on every key: ratios of means are ratios of sums
    metrics = {"reward/failed_samples": means["failed|n"] * distributed.world_size()}
    for key in {k.split("|")[0] for k in sums if k != "failed|n"}:
        n = means[f"{key}|n"]
        mean = means[f"{key}|s"] / n if n else float("nan")
        variance = means[f"{key}|ss"] / n - mean**2 if n else float("nan")
        name = "reward/mean" if key == "reward" else f"{key}/mean"
        metrics[name] = mean
        metrics[name.replace("/mean", "/std")] = math.sqrt(max(variance, 0.0)) if n else float("nan")
    return metrics


def build_scorer(config: RunConfig, *, evaluation: bool = False) -> Scorer:
    specs = config.rewards + (config.eval.metrics if evaluation else [])
    return Scorer(specs, retries=config.scoring.retries, retry_delay_s=config.scoring.retry_delay_s)


def iteration_seed(seed: int, iteration: int) -> int:
    """A distinct sampling seed per iteration, stable across runs and resumes."""
    return int.from_bytes(hashlib.sha256(f"{seed}/iteration/{iteration}".encode()).digest()[:8], "little") >> 1


def run_evaluation(config, policy, embeddings, scorer, eval_prompts, state, tracker) -> dict[str, float]:
    out_dir = config.output_dir / "eval" / f"iteration-{state.iteration:05d}"
    result = evaluation.evaluate(policy.adapter, eval_prompts, config.sde, scorer, seed=config.eval.seed,
                                 out_dir=out_dir, batch_size=config.update.micro_batch_size,
                                 write_videos=config.eval.write_videos, write=distributed.is_main(),
                                 embeddings=embeddings(eval_prompts))
    for video in result.videos:
        tracker.log_artifact(video, f"eval/iteration-{state.iteration:05d}")
    metrics = distributed.all_reduce_mean(result.metrics) if distributed.world_size() == 1 else \
        _broadcast_from_main(result.metrics)
    state.last_eval = metrics | {"iteration": state.iteration}
    return metrics


def _broadcast_from_main(metrics: dict[str, float]) -> dict[str, float]:
    box = [metrics]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def log_progress(metrics: dict[str, float]) -> None:
    if distributed.is_main():
        shown = {k: metrics[k] for k in ("reward/mean", "update/kl", "update/lambda_kl", "update/grad_norm",
                                         "eval/reward") if k in metrics}
        logger.info("iteration %d: %s", metrics["iteration"],
                    "  ".join(f"{k}={v:.4g}" for k, v in shown.items()))


class Audit:
    """Each rank's record of what it trained on (prompt ids per iteration) and the weights it ended with: the
    provenance a team needs to answer "which data made this model", one JSON line per event."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def write(self, record: dict) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")


def publish(config: RunConfig, policy: Policy, embeddings, scorer: Scorer, eval_prompts: list[str],
            state: RunState, tracker: Tracker) -> None:
    """Export the policy, register it as the ``challenger`` with its eval metrics, and run the promotion gate."""
    from core import export, registry

    if state.last_eval.get("iteration") != state.iteration:
        tracker.log_metrics(run_evaluation(config, policy, embeddings, scorer, eval_prompts, state, tracker),
                            step=state.iteration)
    export_dir = config.output_dir / "exports" / f"step-{state.iteration}"
    if config.lora.enabled:
        export.export_lora(policy.engine.module, export_dir)
    else:
        export.export_full(policy.engine, export_dir)
    if not distributed.is_main():
        return
    client = tracker.client()
    run_id = state.mlflow_run_id
    base_model = config.registry.base_model or config.model.pretrained or config.model.name
    metrics = {k: v for k, v in state.last_eval.items() if k != "iteration"}
    version = registry.register_export(client, config.registry.model_name, export_dir, run_id, metrics,
                                       registry.export_key(run_id, state.iteration), base_model=base_model)
    logger.info("registered %s version %s as challenger", config.registry.model_name, version.version)
    if config.registry.promote:
        decision = registry.promote(client, config.registry.model_name, version=version.version,
                                    primary_metric=config.registry.primary_metric,
                                    min_improvement=config.registry.margin, guarded=config.registry.guards)
        logger.info("%s", decision.summary())


# ----------------------------------------------------------------------------------------------------------------
# Building the policy
# ----------------------------------------------------------------------------------------------------------------


def build_policy(config: RunConfig) -> Policy:
    torch.manual_seed(config.seed)
    dtype = getattr(torch, config.model.dtype)
    kwargs = dict(config.model.kwargs)
    if config.model.pretrained:
        kwargs["path_or_hub_id"] = config.model.pretrained
        kwargs["device"] = str(distributed.device())
    adapter = build_adapter(config.model.name, guidance_scale=config.model.guidance_scale, dtype=dtype, **kwargs)
    if config.lora.enabled:
        add_lora(adapter.transformer, config.lora)
    else:
        adapter.transformer.requires_grad_(True)
    trained = int(timestep_weights_mask(config).sum())
    samples = config.rollout.prompts_per_rank * config.rollout.group_size
    engine = build_engine(adapter.transformer, config.update,
                          accumulation_steps=accumulation_steps(samples, config.update.micro_batch_size, trained),
                          deepspeed_config_name=config.deepspeed.config, bf16=_use_bf16(config))
    return Policy(adapter, engine, Updater(engine, adapter, config.update, config.trust_region))


def timestep_weights_mask(config: RunConfig) -> torch.Tensor:
    """Which steps of the schedule train: stochastic steps in the SDE window, never the final step to sigma 0."""
    etas = torch.tensor(config.sde.step_etas())
    trained = etas > 0
    trained[-1] = False
    return trained


def _use_bf16(config: RunConfig) -> bool:
    if config.deepspeed.precision == "auto":
        return torch.cuda.is_available()
    return config.deepspeed.precision == "bf16"


class CachedEmbeddings:
    """Prompt embeddings through the on-disk cache, keyed by (encoder identity, prompt hash)."""

    def __init__(self, cache: EmbeddingCache, adapter):
        self.cache, self.adapter = cache, adapter

    def __call__(self, prompts: list[str]) -> PromptEmbeddings:
        rows = self.cache.get_or_encode(self.adapter.encoder_identity, prompts, self._encode_flat)
        device = self.adapter.device
        positive = {k[4:]: v.to(device) for k, v in rows.items() if k.startswith("pos.")}
        negative = {k[4:]: v.to(device) for k, v in rows.items() if k.startswith("neg.")} or None
        return PromptEmbeddings(positive, negative)

    def _encode_flat(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeddings = self.adapter.encode_prompts(prompts)
        flat = {f"pos.{k}": v for k, v in embeddings.tensors.items()}
        flat |= {f"neg.{k}": v for k, v in (embeddings.negative or {}).items()}
        return flat


# ----------------------------------------------------------------------------------------------------------------
# Run state, checkpoints and resume
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class RunState:
    iteration: int = 0
    mlflow_run_id: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    last_eval: dict[str, float] = field(default_factory=dict)
    last_checkpoint: int | None = None


def config_hash(config: RunConfig) -> str:
    """What must match for a checkpoint to continue this run: everything but how long it runs and where it logs."""
    data = config.model_dump(mode="json", exclude={"run": {"max_iterations", "time_budget_minutes"},
                                                   "tracking": True, "checkpoint": True})
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _rank_state(policy: Policy, sampler: PromptSampler, state: RunState) -> dict:
    return {
        "iteration": state.iteration,
        "mlflow_run_id": state.mlflow_run_id or "",
        "history": state.history,
        "last_eval": state.last_eval,
        "sampler": sampler.state_dict(),
        "updater": policy.updater.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }


def save_checkpoint(store: CheckpointStore, config: RunConfig, policy: Policy, sampler: PromptSampler,
                    state: RunState) -> None:
    """All ranks write into one staging folder (a node-local disk for one node, shared storage for several); one
    committer uploads it and writes the manifest last; ``latest`` moves only after that."""
    staging = config.output_dir / "checkpoint-staging" / f"step-{state.iteration}"
    if distributed.is_main():
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    distributed.barrier()
    # save_latest=False: DeepSpeed's own "latest" would be written before every rank finished; our manifest commits.
    policy.engine.save_checkpoint(str(staging), tag=ENGINE_TAG, save_latest=False)
    torch.save(_rank_state(policy, sampler, state), staging / f"pipeline_state_rank{distributed.rank()}.pt")
    distributed.barrier()
    if distributed.is_main():
        # Flat, so checkpoint.best_metric (e.g. eval/reward) names a key the retention policy can read.
        evaluated_now = state.last_eval.get("iteration") == state.iteration
        extra = {**(state.last_eval if evaluated_now else {}), "iteration": state.iteration}
        store.commit(staging, state.iteration, world_size=distributed.world_size(), config_hash=config_hash(config),
                     extra=extra)
        store.prune(keep_last=config.checkpoint.keep_last, best_metric=config.checkpoint.best_metric,
                    higher_is_better=config.checkpoint.higher_is_better)
        shutil.rmtree(staging, ignore_errors=True)
        logger.info("checkpoint step-%d committed to %s", state.iteration, store.uri)
    distributed.barrier()
    state.last_checkpoint = state.iteration


def load_checkpoint(store: CheckpointStore, resume: str, config: RunConfig, policy: Policy, *,
                    require: bool = False, same_run: bool = True) -> dict | None:
    """Load the policy (DeepSpeed engine, anchor, KL controller) from a verified checkpoint; return this rank's
    saved pipeline state, or None when ``resume`` is ``auto`` and nothing is there yet. ``same_run`` (resuming)
    demands the config the checkpoint was written with; evaluating or sampling may change the sampler."""
    step = store.resolve(resume) if distributed.is_main() else None
    if distributed.world_size() > 1:
        step = _broadcast_from_main({"step": step})["step"]
    if step is None:
        if require:
            raise UserError(f"no verified checkpoint for {resume!r} in {store.uri}")
        logger.info("resume %s: no checkpoint found, starting a new run", resume)
        return None
    manifest = store.read_manifest(step)
    if manifest.world_size != distributed.world_size():
        raise UserError(f"checkpoint step-{step} was written by {manifest.world_size} rank(s); resume it with the "
                        f"same number (ZeRO-3 partitions are per rank), not {distributed.world_size()}")
    if same_run and manifest.config_hash != config_hash(config):
        raise UserError(f"checkpoint step-{step} was written with a different config; only run.max_iterations, "
                        "run.time_budget_minutes, tracking and checkpoint may change on resume")
    local = config.output_dir / "checkpoint-restore" / f"step-{step}"
    if distributed.is_main():
        shutil.rmtree(local, ignore_errors=True)
        store.download(step, local)  # verifies every file's size and sha256 before anything loads it
    distributed.barrier()
    # DeepSpeed's own loader reads its files (verified above); everything of ours loads with weights_only=True.
    policy.engine.load_checkpoint(str(local), tag=ENGINE_TAG, load_module_strict=True)
    saved = load_torch(local / f"pipeline_state_rank{distributed.rank()}.pt")
    policy.updater.load_state_dict(saved["updater"])
    distributed.barrier()
    if distributed.is_main():
        shutil.rmtree(local, ignore_errors=True)
        logger.info("loaded checkpoint step-%d of %s", step, store.uri)
    return saved | {"step": step}


def restore(store: CheckpointStore, resume: str, config: RunConfig, policy: Policy, sampler: PromptSampler,
            state: RunState) -> None:
    """Continue a run exactly: the policy, and the sampler position, RNG states, counters and MLflow run."""
    saved = load_checkpoint(store, resume, config, policy)
    if saved is None:
        return
    sampler.load_state_dict(saved["sampler"])
    torch.set_rng_state(saved["torch_rng"])
    random.setstate(_as_python_rng_state(saved["python_rng"]))
    state.iteration, state.history, state.last_eval = saved["iteration"], saved["history"], saved["last_eval"]
    state.mlflow_run_id = saved["mlflow_run_id"] or None
    state.last_checkpoint = saved["step"]


def _as_python_rng_state(saved) -> tuple:
    version, internal, gauss = saved
    return version, tuple(internal), gauss


@contextmanager
def preemption_signals():
    """SIGTERM (Kubernetes, torchrun) and SIGUSR1 (Slurm's pre-timeout signal) ask the run to finish the current
    iteration, checkpoint and exit with the retryable code; yields a function telling whether one arrived."""
    received = []
    handled = (signal.SIGTERM, signal.SIGUSR1)
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in handled}
    try:
        yield lambda: bool(received)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
