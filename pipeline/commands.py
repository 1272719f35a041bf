"""What ``sagegrpo run``, ``eval`` and ``sample`` do, between parsing and the pipeline: config, logging, the
summary a person reads at the end. Exit codes: 0 done, 2 user error, 75 preempted (retryable), 1 failure."""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

from core import distributed
from pipeline.config import RunConfig, load_run_config


def setup_logging() -> None:
    """INFO from rank 0, warnings from the others; third-party chatter kept out of a user's terminal."""
    level = logging.INFO if int(os.environ.get("RANK", 0)) == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "urllib3", "alembic", "mlflow", "diffusers",
                  "transformers", "botocore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.set_verbosity_error()
    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_command(config_path: str, overrides: list[str], *, resume: str | None) -> int:
    config = load_run_config(config_path, overrides)
    setup_logging()
    from pipeline.runner import run

    summary = run(config, resume=resume)
    if distributed.is_main():
        print(_summary_text(config, summary), flush=True)
    return summary.exit_code


def _summary_text(config: RunConfig, summary) -> str:
    lines = [
        f"sage-grpo: {summary.status} after {summary.iterations} iteration(s)",
        f"  outputs:     {summary.output_dir.resolve()}",
        f"  checkpoints: {summary.checkpoint or 'none written'}",
        f"  reward plot: {(summary.output_dir / 'plots' / 'reward_curves.png').resolve()}",
    ]
    if summary.history:
        first, last = summary.history[0], summary.history[-1]
        lines.append(f"  reward:      {first['reward/mean']:.4f} (first iteration) -> {last['reward/mean']:.4f} (last)")
    if summary.tracking_uri:
        lines.append(f"  MLflow run:  {summary.run_id} at {summary.tracking_uri}")
        if summary.tracking_uri.startswith("sqlite:"):
            lines.append(f"  browse it:   mlflow ui --backend-store-uri {summary.tracking_uri}")
    if summary.status == "preempted":
        lines.append(f"  resume with: sagegrpo run CONFIG --resume auto   (exit code {summary.exit_code}: retryable)")
    return "\n".join(lines)


def eval_command(config_path: str, overrides: list[str], checkpoint: str) -> int:
    config = load_run_config(config_path, overrides)
    setup_logging()
    from pipeline import runner
    from stages.ingest import ingest

    policy, embeddings = _restored_policy(config, checkpoint)
    eval_prompts = [p.text for p in ingest(config.data).eval][: config.eval.num_prompts]
    state = runner.RunState()
    metrics = runner.run_evaluation(config, policy, embeddings, runner.build_scorer(config, evaluation=True),
                                    eval_prompts, state, _NoTracker())
    if distributed.is_main():
        print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0


def sample_command(config_path: str, overrides: list[str], prompts: list[str], checkpoint: str | None, out: str,
                   seed: int) -> int:
    config = load_run_config(config_path, overrides)
    setup_logging()
    from stages import evaluate as evaluation
    from stages.rollout import SDEConfig, generate

    policy, embeddings = _restored_policy(config, checkpoint)
    deterministic = SDEConfig(variant="ode", steps=config.sde.steps, shift=config.sde.shift)
    rollout = generate(policy.adapter, prompts, 1, deterministic, seed, batch_size=config.update.micro_batch_size,
                       embeddings=embeddings(prompts))
    if distributed.is_main():
        Path(out).mkdir(parents=True, exist_ok=True)
        for i, prompt in enumerate(prompts):
            path = evaluation.write_video(rollout.videos[i], policy.adapter.fps, Path(out) / f"sample_{i:02d}")
            print(f"{path}\t{prompt}")
    return 0


def _restored_policy(config: RunConfig, checkpoint: str | None):
    from pipeline import runner
    from stages.ingest import EmbeddingCache

    distributed.init(config.deepspeed.collective_timeout_minutes)
    policy = runner.build_policy(config)
    if checkpoint:
        runner.load_checkpoint(config.checkpoint.build(config.output_dir), checkpoint, config, policy, require=True,
                               same_run=False)
    embeddings = runner.CachedEmbeddings(EmbeddingCache(config.output_dir / "embedding-cache"), policy.adapter)
    return policy, embeddings


class _NoTracker:
    def log_artifact(self, *args, **kwargs) -> None:
        pass
