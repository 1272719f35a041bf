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
    from pipeline.recipe import SageGRPORecipe

    recipe = SageGRPORecipe(config)
    recipe.setup(resume=resume)
    summary = recipe.train()
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
    if summary.export_dir:
        lines.append(f"  export:      {summary.export_dir.resolve()} (diffusers format)")
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
    recipe = _recipe_with_policy(config_path, overrides, checkpoint)
    metrics = recipe.evaluate()
    if distributed.is_main():
        print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0


def sample_command(config_path: str, overrides: list[str], prompts: list[str], checkpoint: str | None, out: str,
                   seed: int) -> int:
    recipe = _recipe_with_policy(config_path, overrides, checkpoint)
    for path, prompt in zip(recipe.sample(prompts, seed, Path(out)), prompts):
        print(f"{path}\t{prompt}")
    return 0


def _recipe_with_policy(config_path: str, overrides: list[str], checkpoint: str | None):
    config = load_run_config(config_path, overrides)
    setup_logging()
    from pipeline.recipe import SageGRPORecipe

    recipe = SageGRPORecipe(config)
    recipe.setup_policy(checkpoint)
    return recipe


def preflight_command(config_path: str, overrides: list[str]) -> int:
    """Exit 0 when every check passes, 1 otherwise (the failed checks are the last lines of the table)."""
    load_run_config(config_path, overrides)  # a config error is one line before anything is built
    setup_logging()
    from pipeline.preflight import preflight, table

    checks = preflight(config_path, overrides)
    if distributed.is_main():
        print(table(checks), flush=True)
    return 1 if any(check.passed is False for check in checks) else 0
