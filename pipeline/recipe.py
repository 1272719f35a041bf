"""The SAGE-GRPO recipe, read top to bottom like torchtune's recipes:

    setup:      ingest -> policy (model, LoRA, DeepSpeed engine, updater) -> scorers -> sampler -> checkpointer
                (resume) -> tracker
    train:      for each iteration: train_step (rollout -> score -> advantages -> update, anchor refresh inside)
                -> (every k) evaluate -> checkpoint (when due, at the end, or on a stop)
    cleanup:    export and publish a completed run, fingerprint, plots, close the MLflow run

Works the same in one process, under the ``deepspeed`` launcher and under ``torchrun``: every rank runs it; rank 0
logs. Ranks agree on stop decisions (preemption, time budget) through a collective, so no rank leaves a collective
the others are still in. ``eval`` and ``sample`` use the same class through :meth:`setup_policy`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from sage_grpo.core import distributed
from sage_grpo.core.distributed import ParallelLayout
from sage_grpo.core.errors import RETRYABLE_EXIT_CODE, RetryableStop, UserError, out_of_space
from sage_grpo.core.export import STAGING_FOLDER
from sage_grpo.core.files import atomic_write_text, make_writable_folder, remove_abandoned
from sage_grpo.core.lora import add_lora
from sage_grpo.core.models import build_adapter
from sage_grpo.core.progress import progress_bar
from sage_grpo.core.secrets import masked_config
from sage_grpo.core.tracking import Tracker
from sage_grpo.pipeline import checkpointer, report
from sage_grpo.pipeline.checkpointer import RNGState
from sage_grpo.pipeline.config import RunConfig
from sage_grpo.pipeline.signals import preemption_signals
from sage_grpo.stages import evaluate as evaluation
from sage_grpo.stages.engine import build_engine
from sage_grpo.stages.ingest import CachedEmbeddings, EmbeddingCache, PromptSampler, ingest
from sage_grpo.stages.rollout import (
    SDEConfig,
    check_every_trained_expert_trains,
    generate,
    in_groups,
    trained_steps,
)
from sage_grpo.stages.score import Scorer, reward_metrics
from sage_grpo.stages.update import Updater, compute_advantages

logger = logging.getLogger(__name__)


@dataclass
class RunSummary:
    status: str  # "completed", "preempted" or "time_budget"
    iterations: int
    output_dir: Path
    checkpoint: str | None
    tracking_uri: str | None
    run_id: str | None
    history: list[dict[str, float]] = field(default_factory=list)
    export_dir: Path | None = None

    @property
    def exit_code(self) -> int:
        """A run stopped early (preempted, or out of its time budget) checkpointed and is not done: retryable. One
        the hacking guard stopped is done and must not count as completed."""
        if self.status == "hacking":
            return evaluation.HACKING_STOP_EXIT_CODE
        return 0 if self.status == "completed" else RETRYABLE_EXIT_CODE


@dataclass
class Policy:
    """Everything that trains or generates: the model adapter, its DeepSpeed engine and the update state."""

    adapter: Any
    engine: Any
    updater: Updater


@dataclass
class Progress:
    """Where the run stands; saved with every checkpoint so a resumed run continues its counters and MLflow run."""

    iteration: int = 0
    mlflow_run_id: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    last_eval: dict[str, float] = field(default_factory=dict)
    # The evaluation before the first update (``eval.at_start``): its metrics, and its per-prompt scores that every
    # later evaluation is paired against. Empty until it ran.
    start_eval: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "mlflow_run_id": self.mlflow_run_id or "",
            "history": self.history,
            "last_eval": self.last_eval,
            "start_eval": self.start_eval,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration, self.history, self.last_eval = state["iteration"], state["history"], state["last_eval"]
        self.mlflow_run_id = state["mlflow_run_id"] or None
        self.start_eval = state["start_eval"]

    @staticmethod
    def state_problem(state: dict[str, Any], step: int) -> str | None:
        """A checkpoint's step is the iteration it was saved after; any other count would skip or repeat training."""
        return None if state["iteration"] == step else f"its progress says iteration {state['iteration']!r}, not {step}"

    def evaluated_now(self) -> dict[str, float]:
        """The eval metrics of this iteration, if it was evaluated (what the checkpoint manifest records)."""
        return self.last_eval if self.last_eval.get("iteration") == self.iteration else {}


def make_run_folders(config: RunConfig) -> None:
    """The run's output and local checkpoint folders, created and checked writable before anything is written to
    either: a path that cannot be a folder is one line naming its key."""
    make_writable_folder(config.output_dir, "run.output_dir")
    checkpoint_root = config.checkpoint.build(config.output_dir, config.s3).uri
    if not checkpoint_root.startswith("s3://"):
        make_writable_folder(checkpoint_root, "checkpoint.uri")


class SageGRPORecipe:
    def __init__(self, config: RunConfig):
        self.config = config
        self.progress = Progress()
        self.last_batch = None  # the last iteration's (videos, groups, rewards, advantages), on rank 0, for plots

    # ------------------------------------------------------------------------------------------------------------
    # Setup
    # ------------------------------------------------------------------------------------------------------------

    def setup(self, resume: str | None = None, *, fresh_start: bool = False) -> None:
        config = self.config
        distributed.init(config.deepspeed.collective_timeout_minutes)
        self.parallel = ParallelLayout.build(config.parallel.sequence_parallel_size)
        make_run_folders(config)
        if distributed.is_main():
            (config.output_dir / "config.json").write_text(json.dumps(masked_config(config), indent=2))
            remove_abandoned(config.output_dir / "exports", STAGING_FOLDER)  # a full weight copy a kill left
        self._setup_prompts()
        # Before the rewards and the model: too few prompts for every rank stops the run at once.
        self.sampler = PromptSampler(
            len(self.train_prompts),
            config.rollout.prompts_per_rank,
            self.parallel.data_parallel_rank,  # the K ranks of a sequence-parallel group share their prompts
            self.parallel.data_parallel_size,
            config.seed,
        )
        # Rewards before the model: a reward that cannot be built, or needs a column no prompt has, stops the run
        # before minutes of model loading.
        self.scorer = self._build_scorer()
        self.scorer.check_metadata([p.metadata for p in self.prompt_set.train])
        self.eval_scorer = self._build_scorer(evaluation=True) if self.eval_prompts and config.eval.every else None
        self.eval_judges = self._build_judges()
        self._setup_policy()
        self.checkpointer = checkpointer.for_run(
            config,
            self.policy.engine,
            {"updater": self.policy.updater, "sampler": self.sampler, "progress": self.progress, "rng": RNGState()},
        )
        if resume:
            self.checkpointer.load(resume, fresh_start=fresh_start)
        self.checkpointer.claim(fresh_start=fresh_start)
        # run.name names the MLflow run unless tracking.run_name says otherwise.
        tracking = config.tracking.model_copy(update={"run_name": config.tracking.run_name or config.run.name})
        self.tracker = Tracker(tracking, config.output_dir)
        if distributed.is_main():
            self.progress.mlflow_run_id = self.tracker.start(
                config, run_id=self.progress.mlflow_run_id, identity=self.checkpointer.run_id
            )
            self.tracker.describe(tags=self._run_tags(), params=self._derived_params())
            self.tracker.log_prompt_set(
                self.prompt_set, config.data.source, (self.eval_set, config.eval.source or config.data.source)
            )
        # Iterations past the restored one are re-executed (identically): neither MLflow nor the audit repeats them.
        self.logged_through = self.tracker.logged_through("iteration") if distributed.is_main() else 0
        self.audit = Audit(config.output_dir / "audit" / f"rank-{distributed.rank()}.jsonl", self.checkpointer.run_id)
        self.audit.forget_after(self.progress.iteration)
        if distributed.is_main():
            logger.info("%s", self.header())

    def _run_tags(self) -> dict[str, str]:
        config = self.config
        return {
            "model": config.model.pretrained or config.model.name,
            "sampler": config.sde.variant,
            "trust_region.strategy": config.trust_region.strategy.value,
            "trust_region.preset": config.trust_region.preset,
            "finetuning": "lora" if config.lora.enabled else "full",
        }

    def _derived_params(self) -> dict[str, int]:
        """What the config implies at this scale: the numbers a comparison between runs needs."""
        config, module = self.config, self.policy.engine.module
        return {
            "derived.world_size": distributed.world_size(),
            "derived.effective_batch": config.rollout.samples_per_rank * self.parallel.data_parallel_size,
            "derived.trainable_parameters": sum(_numel(p) for p in module.parameters() if p.requires_grad),
            "derived.total_parameters": sum(_numel(p) for p in module.parameters()),
            "derived.trained_steps": _trained_step_count(config, self.policy.adapter),
        }

    def header(self) -> str:
        """What a person checks before walking away from a run: scale, batch, what trains, how long."""
        config, derived = self.config, self._derived_params()
        start = f"resuming after iteration {self.progress.iteration}" if self.progress.iteration else "from the start"
        ranks = f"{self.parallel.data_parallel_size} data-parallel rank(s)"
        if self.parallel.sequence_parallel_size > 1:  # a group of K ranks shares each sample's tokens
            ranks += f" (groups of {self.parallel.sequence_parallel_size} sequence-parallel ranks)"
        return (
            f"run {config.run.name}: {ranks} x {config.rollout.samples_per_rank} samples "
            f"({config.rollout.prompts_per_rank} prompts x G={config.rollout.group_size}) = "
            f"{derived['derived.effective_batch']} videos per iteration; {derived['derived.trained_steps']} of "
            f"{config.sde.steps} steps trained; {derived['derived.trainable_parameters']:,} of "
            f"{derived['derived.total_parameters']:,} parameters trainable "
            f"({'LoRA' if config.lora.enabled else 'full'}); iterations {self.progress.iteration + 1}.."
            f"{config.run.max_iterations} ({start})"
        )

    def setup_policy(self, checkpoint: str | None = None) -> None:
        """Only what evaluating or sampling a (saved) policy needs; nothing is logged to MLflow."""
        distributed.init(self.config.deepspeed.collective_timeout_minutes)
        self.parallel = ParallelLayout.build()  # eval, sample and export run without sequence parallelism
        self._setup_prompts()
        self.eval_scorer = self._build_scorer(evaluation=True)
        self.eval_judges = self._build_judges()
        self._setup_policy()
        self.tracker = Tracker(self.config.tracking.model_copy(update={"enabled": False}), self.config.output_dir)
        self.checkpoint_name = "initial"
        if checkpoint:
            step = checkpointer.for_run(self.config, self.policy.engine, {"updater": self.policy.updater}).load(
                checkpoint, same_run=False, require=True
            )
            self.checkpoint_name = f"step-{step}"

    def _setup_prompts(self) -> None:
        self.prompt_set = ingest(self.config.data, self.config.s3)
        logger.info("prompts: %s", self.prompt_set.report.summary())
        self.train_prompts = [p.text for p in self.prompt_set.train]
        if self.config.eval.source:
            fixed = self.config.data.model_copy(update={"source": self.config.eval.source, "eval_fraction": 0.0})
            held_out = ingest(fixed, self.config.s3).train
        else:
            held_out = self.prompt_set.eval[: self.config.eval.num_prompts]
        self.eval_set = held_out  # what every evaluation scores, and MLflow records as the evaluation dataset
        self.eval_prompts = [p.text for p in held_out]
        self.eval_metadata = [p.metadata for p in held_out]

    def _setup_policy(self) -> None:
        self.policy = build_policy(self.config, self.parallel)
        self.embeddings = CachedEmbeddings(
            EmbeddingCache(self.config.output_dir / "embedding-cache"), self.policy.adapter
        )

    def _build_scorer(self, *, evaluation: bool = False) -> Scorer:
        config = self.config
        specs = config.rewards + (config.eval.metrics if evaluation else [])
        scorer = Scorer(specs, **config.scoring.model_dump())
        scorer.setup(distributed.device())
        return scorer

    def _build_judges(self) -> Scorer | None:
        """``eval.judges``, each dimension reported and none weighted: a judge never enters any total."""
        judges = [spec.model_copy(update={"weights": {}}) for spec in self.config.eval.judges]
        if not judges:
            return None
        scorer = Scorer(judges, **self.config.scoring.model_dump())
        scorer.setup(distributed.device())
        return scorer

    # ------------------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------------------

    def train(self) -> RunSummary:
        try:
            return self._train()
        except BaseException as error:
            if distributed.is_main():  # closed, not left RUNNING; the error itself reaches the CLI
                # A retryable stop is continued by a resume in the same MLflow run, as a preempted one is.
                self.tracker.finish("KILLED" if isinstance(error, RetryableStop) or out_of_space(error) else "FAILED")
            raise

    def _train(self) -> RunSummary:
        config, progress = self.config, self.progress
        status, started = "completed", time.monotonic()
        bar = progress_bar(
            total=config.run.max_iterations,
            initial=progress.iteration,
            desc="iterations",
            unit="it",
            dynamic_ncols=True,
        )
        if self._guard_stopped():  # a restart of a run the hacking guard stopped: it stays stopped
            return self.cleanup("hacking")
        with preemption_signals(config.run.preemption_grace_s) as preempted, bar, logging_redirect_tqdm():
            if progress.iteration == 0 and config.eval.at_start and not progress.start_eval and self.eval_scorer:
                self.evaluate_start()
            while progress.iteration < config.run.max_iterations:
                metrics, hacking = self.train_step(), False
                if self.eval_scorer and progress.iteration % config.eval.every == 0:
                    metrics |= self.evaluate()
                    hacking = self._guard(metrics)
                self._record(metrics)
                bar.update()
                bar.set_postfix(reward=f"{metrics['reward/mean']:.4g}", refresh=False)

                out_of_time = (
                    config.run.time_budget_minutes is not None
                    and time.monotonic() - started > 60 * config.run.time_budget_minutes
                )
                stop = distributed.any_rank(preempted() or out_of_time)
                self.checkpointer.save(
                    progress.iteration,
                    metrics=progress.evaluated_now(),
                    force=stop or hacking or progress.iteration == config.run.max_iterations,
                )
                if hacking:
                    status = "hacking"
                    break
                if stop:
                    status = "preempted" if preempted() else "time_budget"
                    break
        return self.cleanup(status)

    def _guard(self, metrics: dict[str, float]) -> bool:
        """The hacking guard after an evaluation (``eval.guard``): marks ``metrics`` when it fires and acts; True when
        it stops the run. Every rank decides alike: the metrics and the history are the same on all."""
        guard = self.config.eval.guard
        if guard.action == "disabled" or self.eval_judges is None:
            return False
        start = [self.progress.start_eval["metrics"]] if self.progress.start_eval else []
        found = evaluation.hacking_divergence([*start, *self.progress.history, metrics], guard)
        if found is None:
            return False
        metrics[evaluation.GUARD_FIRED] = 1.0
        if distributed.is_main():
            what = f"{guard.action} at iteration {self.progress.iteration}: {found.described()}"
            logger.warning("hacking guard: %s", what)
            self.tracker.set_tag("hacking_guard", what)
        if guard.action == "tighten":
            self.policy.updater.controller.tighten(guard.tighten_factor)
        return guard.action == "stop"

    def _guard_stopped(self) -> bool:
        history = self.progress.history
        return self.config.eval.guard.action == "stop" and bool(history) and evaluation.GUARD_FIRED in history[-1]

    def train_step(self) -> dict[str, float]:
        """One iteration: rollout -> score -> advantages -> update; returns its metrics (averaged over ranks)."""
        config, policy = self.config, self.policy
        timings, clock = {}, time.perf_counter()
        prompt_ids = next(self.sampler)
        self.audit.write({"iteration": self.progress.iteration + 1, "prompt_ids": prompt_ids})
        batch_prompts = [self.train_prompts[i] for i in prompt_ids]
        group_size = config.rollout.group_size
        sample_prompts = in_groups(batch_prompts, group_size)
        sample_metadata = self.prompt_set.metadata_for(in_groups(prompt_ids, group_size))
        # Batch i is scored in a worker thread while batch i+1 is generated; the scores feed this iteration's update
        # only, so the overlap keeps the step on-policy. time/score is the scoring the rollout did not hide.
        # Under sequence parallelism the K ranks of a group hold the same samples: each decodes and scores every K-th
        # batch, and the group shares the scores.
        with self.scorer.overlapped(sample_prompts, sample_metadata, fps=policy.adapter.fps) as sink:
            rollout = generate(
                policy.adapter,
                batch_prompts,
                group_size,
                config.sde.at_iteration(self.progress.iteration),
                iteration_seed(config.seed, self.progress.iteration),
                prompt_ids=prompt_ids,
                batch_size=config.update.micro_batch_size,
                embeddings=self.embeddings(batch_prompts),
                on_batch=sink.submit,
                record_means=policy.updater.reads_rollout_means,
                decode_batches=self.parallel.sequence_share,
            )
            timings["time/rollout"], clock = time.perf_counter() - clock, time.perf_counter()
            scored = sink.result(across=self.parallel.across_sequence_group)
        timings["time/score"], clock = time.perf_counter() - clock, time.perf_counter()

        advantages = compute_advantages(scored.total, rollout.group_ids, config.update, self.parallel)
        update_metrics = policy.updater.update(rollout, advantages)
        if distributed.is_main():  # the samples this rank decoded (every K-th batch under sequence parallelism)
            shown = rollout.decoded_samples
            self.last_batch = (
                rollout.videos,
                rollout.group_ids[shown].tolist(),
                [scored.total[i] for i in shown],
                advantages.values[shown].tolist(),
            )
        timings["time/update"] = time.perf_counter() - clock
        self.progress.iteration += 1
        mfu = policy.updater.mfu(rollout, sum(timings.values()))  # None off a GPU of known peak
        if mfu is not None:
            timings["mfu"] = mfu

        metrics = reward_metrics(scored, self.parallel) | {f"update/{k}": v for k, v in update_metrics.items()}
        metrics |= distributed.all_reduce_mean(
            {
                "advantage/abs_mean": float(advantages.values[advantages.valid].abs().mean())
                if advantages.valid.any()
                else 0.0,
                "advantage/valid_fraction": float(advantages.valid.float().mean()),
                **timings,
            }
        )
        seconds = sum(value for key, value in timings.items() if key.startswith("time/"))
        metrics["samples_per_second"] = rollout.num_samples * self.parallel.data_parallel_size / seconds
        return metrics

    def _record(self, metrics: dict[str, float]) -> None:
        metrics["iteration"] = self.progress.iteration
        self.progress.history.append(metrics)
        if self.progress.iteration > self.logged_through:
            self.tracker.log_metrics(metrics, step=self.progress.iteration)
        # Late: a run opened after a tracking outage has its id only now, and the next checkpoint must carry it.
        self.progress.mlflow_run_id = self.tracker.run_id or self.progress.mlflow_run_id
        if distributed.is_main():
            shown = {
                k: metrics[k]
                for k in ("reward/mean", "update/kl", "update/lambda_kl", "update/grad_norm", "eval/reward")
                if k in metrics
            }
            logger.info("iteration %d: %s", metrics["iteration"], "  ".join(f"{k}={v:.4g}" for k, v in shown.items()))

    # ------------------------------------------------------------------------------------------------------------
    # Evaluation and sampling
    # ------------------------------------------------------------------------------------------------------------

    def evaluate_start(self) -> None:
        """The untrained policy's evaluation (iteration 0, ``eval.at_start``), logged at step 0 and kept (checkpointed
        with the progress) as the baseline every later evaluation's paired deltas and the hacking guard start from."""
        metrics, scores = self._evaluation()
        self.progress.start_eval = {"metrics": metrics, "scores": distributed.broadcast_from_main(scores)}
        if distributed.is_main():
            # A run killed before its first checkpoint evaluates again on restart: the same numbers, logged once.
            if not self.tracker.has_logged("eval/reward", 0):
                self.tracker.log_metrics(metrics, step=0)
            logger.info("iteration 0 (before training): eval/reward=%.4g", metrics["eval/reward"])

    def evaluate(self) -> dict[str, float]:
        """The policy on the held-out prompts with fixed seeds and deterministic sampling, scored by every reward and
        extra metric; videos written under ``eval/iteration-N`` and logged. After the start evaluation, each metric's
        paired difference against it comes too (``evaluation.paired_deltas``)."""
        metrics, scores = self._evaluation()
        if self.progress.start_eval and self.progress.iteration > 0:
            metrics |= distributed.broadcast_from_main(
                evaluation.paired_deltas(self.progress.start_eval["scores"], scores)
            )
        self.progress.last_eval = metrics | {"iteration": self.progress.iteration}
        return metrics

    def _evaluation(self) -> tuple[dict[str, float], dict[str, list[float | None]]]:
        """Every rank's metrics, and rank 0's per-prompt scores (empty elsewhere)."""
        iteration = self.progress.iteration
        out_dir = self.config.output_dir / "eval" / f"iteration-{iteration:05d}"
        with self.policy.updater.ema_swapped_in():  # the EMA weights when update.ema_decay is set
            result = evaluation.evaluate(
                self.policy.adapter,
                self.eval_prompts,
                self.config.sde,
                self.eval_scorer,
                seed=self.config.eval.seed,
                out_dir=out_dir,
                batch_size=self.config.update.micro_batch_size,
                write_videos=self.config.eval.write_videos,
                write=distributed.is_main(),
                embeddings=self.embeddings(self.eval_prompts),
                prompt_metadata=self.eval_metadata,
                judges=self.eval_judges,
                parallel=self.parallel,
            )
        artifact_dir = f"eval/iteration-{iteration:05d}"
        for video in result.videos:
            self.tracker.log_artifact(video, artifact_dir)
        evaluation.log_samples(self.tracker, result, iteration, artifact_dir)
        return distributed.broadcast_from_main(result.metrics), result.scores

    def sample(self, prompts: list[str], seed: int, out_dir: Path) -> list[Path]:
        """One deterministic (ODE) video per prompt, written by rank 0."""
        deterministic = SDEConfig(variant="ode", steps=self.config.sde.steps, shift=self.config.sde.shift)
        rollout = generate(
            self.policy.adapter,
            prompts,
            1,
            deterministic,
            seed,
            batch_size=self.config.update.micro_batch_size,
            embeddings=self.embeddings(prompts),
        )
        if not distributed.is_main():
            return []
        out_dir.mkdir(parents=True, exist_ok=True)
        fps = self.policy.adapter.fps
        return [
            evaluation.write_video(rollout.videos[i], fps, out_dir / f"sample_{i:02d}") for i in range(len(prompts))
        ]

    def resampled_rewards(self, prompt_ids: list[int], iteration: int) -> list[float | None]:
        """Each sample's weighted total reward (the one GRPO optimises) for the batch ``train_step`` rolls out from
        ``prompt_ids`` when ``progress.iteration`` is ``iteration``: its sampler, seed and batches, so the same noise,
        under the weights as they are now. Nothing trains, nothing is logged or audited. ``sagegrpo preflight`` pairs
        it with the totals ``train_step`` scored (``scorer.last_scored``): keep the two rollouts alike."""
        config, policy = self.config, self.policy
        prompts = [self.train_prompts[i] for i in prompt_ids]
        group_size = config.rollout.group_size
        metadata = self.prompt_set.metadata_for(in_groups(prompt_ids, group_size))
        with self.scorer.overlapped(in_groups(prompts, group_size), metadata, fps=policy.adapter.fps) as sink:
            generate(
                policy.adapter,
                prompts,
                group_size,
                config.sde.at_iteration(iteration),
                iteration_seed(config.seed, iteration),
                prompt_ids=prompt_ids,
                batch_size=config.update.micro_batch_size,
                embeddings=self.embeddings(prompts),
                on_batch=sink.submit,
                decode_batches=self.parallel.sequence_share,
            )
            return sink.result(across=self.parallel.across_sequence_group).total

    def export(self, out_dir: Path) -> Path:
        """The policy in the diffusers format (a LoRA adapter, or the whole transformer consolidated from ZeRO-3),
        with the base model recorded so the export (and a registered version) can be loaded back."""
        from sage_grpo.core import export

        model = self.config.model
        with self.policy.updater.ema_swapped_in():  # the EMA weights when update.ema_decay is set
            export.export_policy(
                self.policy.engine,
                out_dir,
                model=export.model_record(model.name, pretrained=model.pretrained, kwargs=model.kwargs),
            )
        return out_dir

    # ------------------------------------------------------------------------------------------------------------
    # The end of a run
    # ------------------------------------------------------------------------------------------------------------

    def cleanup(self, status: str) -> RunSummary:
        fingerprint = distributed.weights_fingerprint(self.policy.engine.module)
        self.audit.write({"iteration": self.progress.iteration, "weights_sha256": fingerprint, "status": status})
        export_dir = self.publish() if status == "completed" else None
        if status == "hacking":
            export_dir = self.export_best_by_judge()
        if distributed.is_main():
            self.tracker.set_tag("weights_sha256", fingerprint)
            self.tracker.log_artifact(self._plots(), "plots")
            self.tracker.log_artifact(self.config.output_dir / "config.json")
            self.tracker.finish("KILLED" if status == "preempted" else "FINISHED")
        # No rank leaves before rank 0 has written: a launcher tears the job down on the first rank that exits with
        # a non-zero code (the guard's 3, a preemption's 75), which would kill rank 0 in the middle of its export.
        distributed.barrier()
        return RunSummary(
            status,
            self.progress.iteration,
            self.config.output_dir,
            self.checkpointer.uri,
            self.tracker.tracking_uri if distributed.is_main() else None,
            self.progress.mlflow_run_id,
            self.progress.history,
            export_dir,
        )

    def _plots(self) -> Path:
        """The run's plots as PNG files: reward curves, S_t per step, KL against lambda, and the last iteration's
        reward spread per group and sample grid."""
        plots, sde = self.config.output_dir / "plots", self.config.sde
        report.plot_reward_curves(self.progress.history, plots / "reward_curves.png")
        report.plot_step_weights(
            sde, plots / "step_weights.png", sigmas=self.policy.adapter.sigma_schedule(sde.steps, sde.shift).cpu()
        )
        report.plot_kl_and_lambda(
            self.progress.history, plots / "kl_lambda.png", kl_target=self.config.trust_region.kl_target
        )
        if self.last_batch is not None:
            videos, groups, rewards, advantages = self.last_batch
            report.plot_group_rewards(rewards, groups, plots / "group_rewards.png", self.progress.iteration)
            report.plot_sample_grid(videos, groups, rewards, advantages, plots / "samples.png")
        return plots

    def export_best_by_judge(self) -> Path | None:
        """After the hacking guard stopped the run: the committed step best by ``checkpoint.best_metric`` (a judge,
        which the config requires with ``eval.guard.action=stop``) restored and exported to
        ``exports/best-by-judge-step-N``, and marked with the MLflow tag ``hacking_guard.best_step``."""
        metric = self.config.checkpoint.best_metric
        step = distributed.on_main(lambda: evaluation.best_step(self.checkpointer.store, metric))
        step = distributed.broadcast_from_main(step)
        if step is None:
            logger.warning("hacking guard: no committed step records %s; nothing exported", metric)
            return None
        # A fresh updater to restore into, as `sagegrpo export` has: the live one's histories are another step's.
        config, policy = self.config, self.policy
        policy.updater = Updater(
            policy.engine, policy.adapter, config.update, config.trust_region, seed=config.seed, parallel=self.parallel
        )
        restorer = checkpointer.for_run(config, policy.engine, {"updater": policy.updater})
        restorer.load(str(step), same_run=False, require=True)
        export_dir = self.export(self.config.output_dir / "exports" / f"best-by-judge-step-{step}")
        if distributed.is_main():
            self.tracker.set_tag("hacking_guard.best_step", str(step))
            logger.warning("hacking guard: step %d, the best by %s, exported to %s", step, metric, export_dir)
        return export_dir

    def publish(self) -> Path:
        """Export the policy in the diffusers format (always); with ``registry.model_name``, register the export as
        the ``challenger`` with its eval metrics and, with ``registry.promote``, run the promotion gate. Idempotent:
        a run restarted after training finished comes straight here and registers the same version once."""
        from sage_grpo.core import registry

        export_dir = self.export(self.config.output_dir / "exports" / f"step-{self.progress.iteration}")
        settings = self.config.registry
        if not settings.model_name:
            return export_dir
        if self.progress.last_eval.get("iteration") != self.progress.iteration:
            if self.eval_scorer is None:
                self.eval_scorer = self._build_scorer(evaluation=True)
            self.tracker.log_metrics(self.evaluate(), step=self.progress.iteration)
        if not distributed.is_main():
            return export_dir
        client, run_id = self.tracker.client(), self.progress.mlflow_run_id
        metrics = {k: v for k, v in self.progress.last_eval.items() if k != "iteration"}
        with registry.outage_is_retryable(self.tracker.tracking_uri, f"registering {settings.model_name}"):
            exam = evaluation.eval_set_digest(self.eval_prompts, self.eval_metadata)
            version = registry.register_export(
                client,
                settings.model_name,
                export_dir,
                run_id,
                metrics,
                registry.export_key(run_id, self.progress.iteration),
                base_model=settings.base_model or self.config.model.pretrained or self.config.model.name,
                eval_set=registry.EvalSet(
                    exam,
                    len(self.eval_prompts),
                    self.config.eval.source or f"{self.config.data.source} (held-out split)",
                    *evaluation.eval_definition(
                        self.config.rewards,
                        self.config.eval,
                        exam,
                        evaluation.eval_sampler(
                            self.config.sde, self.config.model.guidance_scale, self.config.model.guidance_scale_2
                        ),
                    ),
                ),
                step=self.progress.iteration,
            )
            logger.info("registered %s version %s as challenger", settings.model_name, version.version)
            if settings.promote:
                decision = registry.promote(
                    client,
                    settings.model_name,
                    version=version.version,
                    primary_metric=settings.primary_metric,
                    min_improvement=settings.margin,
                    guarded=settings.guards,
                    min_eval_prompts=settings.min_eval_prompts,
                )
                # Scores it cannot compare are a setup to fix, not a verdict: said louder.
                logger.log(logging.INFO if decision.comparable else logging.WARNING, "%s", decision.summary())
        return export_dir


# ----------------------------------------------------------------------------------------------------------------
# Building the policy
# ----------------------------------------------------------------------------------------------------------------


def build_policy(config: RunConfig, parallel: ParallelLayout | None = None) -> Policy:
    """The adapter, its DeepSpeed engine and updater. ``parallel``: the run's layout (plain data parallelism over
    this process's world when left out)."""
    parallel = parallel or ParallelLayout.build()
    torch.manual_seed(config.seed)
    kwargs = dict(config.model.kwargs)
    if config.model.pretrained:
        kwargs["path_or_hub_id"] = config.model.pretrained
        kwargs["device"] = str(distributed.device())
    adapter = build_adapter(
        config.model.name,
        guidance_scale=config.model.guidance_scale,
        dtype=getattr(torch, config.model.dtype),
        **config.model.expert_arguments(),
        **kwargs,
    )
    adapter.transformer.requires_grad_(False)  # what trainable_modules leaves out (an untrained expert) stays frozen
    for module in adapter.trainable_modules():
        if config.lora.enabled:
            add_lora(module, config.lora)
        else:
            module.requires_grad_(True)
    adapter.enable_sequence_parallel(parallel)  # after LoRA: its layers wrap modules the split hooks sit on
    engine = build_engine(
        adapter.transformer,
        config.update,
        accumulation_steps=_accumulation_steps(config, adapter),
        deepspeed_config_name=config.deepspeed.config,
        bf16=config.deepspeed.use_bf16(),
        zero3_leaf_modules=config.deepspeed.zero3_leaf_modules,
    )
    updater = Updater(engine, adapter, config.update, config.trust_region, seed=config.seed, parallel=parallel)
    return Policy(adapter, engine, updater)


def _accumulation_steps(config: RunConfig, adapter) -> int:
    """``config.accumulation_steps`` on the model's own schedule, counting only the steps of the experts that train
    (two-expert Wan 2.2 with ``model.train_experts``), which only the built model knows."""
    try:
        check_every_trained_expert_trains(config.sde, adapter, _model_sigmas(config, adapter))
        return config.update.accumulation_steps(config.rollout.samples_per_rank, _trained_step_count(config, adapter))
    except ValueError as error:
        raise UserError(str(error)) from None


def _trained_step_count(config: RunConfig, adapter) -> int:
    """The steps of the configured schedule that train on this model (its sigmas, its trained experts)."""
    return int(trained_steps(config.sde, adapter, _model_sigmas(config, adapter)).sum())


def _model_sigmas(config: RunConfig, adapter) -> torch.Tensor:
    return adapter.sigma_schedule(config.sde.steps, config.sde.shift).cpu()


def _numel(param: torch.nn.Parameter) -> int:
    """A parameter's full size, also under ZeRO-3 (where the local tensor is an empty placeholder)."""
    return int(getattr(param, "ds_numel", param.numel()))


def iteration_seed(seed: int, iteration: int) -> int:
    """A distinct sampling seed per iteration, stable across runs and resumes."""
    return int.from_bytes(hashlib.sha256(f"{seed}/iteration/{iteration}".encode()).digest()[:8], "little") >> 1


class Audit:
    """Each rank's record of what it trained on (prompt ids per iteration) and the weights it ended with: the
    provenance a team needs to answer "which data made this model", one JSON line per event, each naming its run
    (the checkpoint root's run identity, which a resume continues)."""

    def __init__(self, path: Path, run_id: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.run_id = path, run_id

    def write(self, record: dict) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps({"run": self.run_id, **record}) + "\n")

    def forget_after(self, iteration: int) -> None:
        """Drop the training records of iterations after ``iteration`` (a resumed run trains them again)."""
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if "prompt_ids" not in line or json.loads(line)["iteration"] <= iteration]
        if len(kept) != len(lines):
            atomic_write_text(self.path, "".join(kept))
