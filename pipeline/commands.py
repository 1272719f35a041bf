"""What ``sagegrpo run``, ``eval`` and ``sample`` do, between parsing and the pipeline: config, logging, the
summary a person reads at the end. Exit codes: 0 done, 2 user error, 75 preempted (retryable), 1 failure."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path

from sage_grpo.core import distributed
from sage_grpo.core.errors import UserError
from sage_grpo.core.progress import DISABLE_ENV
from sage_grpo.core.secrets import mask_uri
from sage_grpo.pipeline.config import RunConfig, load_run_config

# Libraries whose start-up chatter and deprecation notices are not the user's to act on (at the default verbosity).
THIRD_PARTY = (
    "DeepSpeed",
    "deepspeed",
    "torch",
    "urllib3",
    "alembic",
    "mlflow",
    "diffusers",
    "transformers",
    "botocore",
    "peft",
    "huggingface_hub",
)


def setup_logging(verbosity: int = 0) -> None:
    """INFO from rank 0, warnings from the others. At verbosity 0 the libraries above log warnings only and their own
    Python warnings are hidden; a user's reward package keeps its warnings. ``-v`` shows everything, ``-q`` only
    warnings and errors from the pipeline too, and no progress bars."""
    main_level = logging.INFO if verbosity >= 0 else logging.WARNING
    if verbosity < 0:
        os.environ[DISABLE_ENV] = "1"  # tqdm's own switch: read by core.progress, inherited by child processes
    level = main_level if int(os.environ.get("RANK", 0)) == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if verbosity > 0:
        return
    for noisy in THIRD_PARTY:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.set_verbosity_error()
    transformers_logging.set_verbosity_error()
    modules = "|".join(name.lower() for name in THIRD_PARTY)
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=rf"({modules})(\.|$)")


def run_command(
    config_path: str, overrides: list[str], *, resume: str | None, fresh_start: bool = False, verbosity: int = 0
) -> int:
    # The summary is the only stdout: DeepSpeed prints its op builds there, and its logger writes to the stdout it
    # finds at import (its accelerator warning among the first lines), so it is imported in here too.
    with contextlib.redirect_stdout(sys.stderr):
        config = load_run_config(config_path, overrides)
        setup_logging(verbosity)
        from sage_grpo.pipeline.recipe import SageGRPORecipe

        recipe = SageGRPORecipe(config)
        recipe.setup(resume=resume, fresh_start=fresh_start)
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
        unscored = [h["iteration"] for h in summary.history if math.isnan(h["reward/mean"])]
        if unscored:
            lines.append(
                f"  WARNING:     no sample was scored in iteration(s) {unscored[:10]}: reward nan, nothing "
                "learned there (see reward/failed_samples)"
            )
    if summary.tracking_uri:
        lines.append(f"  MLflow run:  {summary.run_id} at {mask_uri(summary.tracking_uri)}")
        if summary.tracking_uri.startswith("sqlite:"):
            lines.append(f"  browse it:   mlflow ui --backend-store-uri {mask_uri(summary.tracking_uri)}")
    if summary.status == "preempted":
        lines.append(f"  resume with: sagegrpo run CONFIG --resume auto   (exit code {summary.exit_code}: retryable)")
    return "\n".join(lines)


def eval_command(config_path: str, overrides: list[str], checkpoint: str, verbosity: int = 0) -> int:
    """Prints the metrics as JSON, the only thing on stdout (libraries' start-up prints go to stderr), so
    ``sagegrpo eval ... | jq`` works."""
    with contextlib.redirect_stdout(sys.stderr):
        metrics = _recipe_with_policy(config_path, overrides, checkpoint, verbosity).evaluate()
    if distributed.is_main():
        print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0


def sample_command(
    config_path: str,
    overrides: list[str],
    prompts: list[str],
    checkpoint: str | None,
    out: str,
    seed: int,
    verbosity: int = 0,
) -> int:
    """Prints one ``path<TAB>prompt`` line per video, the only thing on stdout."""
    with contextlib.redirect_stdout(sys.stderr):
        paths = _recipe_with_policy(config_path, overrides, checkpoint, verbosity).sample(prompts, seed, Path(out))
    for path, prompt in zip(paths, prompts):
        print(f"{path}\t{prompt}")
    return 0


def export_command(config_path: str, overrides: list[str], checkpoint: str, out: str | None, verbosity: int = 0) -> int:
    """The diffusers-format export of any checkpoint (``auto``: the newest verified one); prints its folder."""
    if out:  # refused before minutes of model loading; the export checks again when it writes
        from sage_grpo.core.export import check_replaceable

        check_replaceable(out)
    with contextlib.redirect_stdout(sys.stderr):
        recipe = _recipe_with_policy(config_path, overrides, checkpoint, verbosity)
        out_dir = Path(out) if out else recipe.config.output_dir / "exports" / recipe.checkpoint_name
        recipe.export(out_dir)
    if distributed.is_main():
        print(out_dir.resolve())
    return 0


def _recipe_with_policy(config_path: str, overrides: list[str], checkpoint: str | None, verbosity: int):
    config = load_run_config(config_path, overrides)
    setup_logging(verbosity)
    from sage_grpo.pipeline.recipe import SageGRPORecipe

    recipe = SageGRPORecipe(config)
    recipe.setup_policy(checkpoint)
    return recipe


def preflight_command(config_path: str, overrides: list[str], verbosity: int = 0) -> int:
    """Exit 0 when every check passes, 1 otherwise (the failed checks are the last lines of the table)."""
    load_run_config(config_path, overrides)  # a config error is one line before anything is built
    setup_logging(verbosity)
    from sage_grpo.pipeline.preflight import preflight, table

    with contextlib.redirect_stdout(sys.stderr):
        checks = preflight(config_path, overrides)
    if distributed.is_main():
        print(table(checks), flush=True)
    return 1 if any(check.passed is False for check in checks) else 0


def plan_command(config_path: str, overrides: list[str], gpus_per_node: int, nodes: int, gpu_mem_gb: float) -> int:
    """Prints the per-GPU memory plan; building nothing, it needs no GPU."""
    from sage_grpo.pipeline.memory_plan import plan_from_config

    if gpu_mem_gb <= 0 or not math.isfinite(gpu_mem_gb):
        raise UserError(f"--gpu-mem must be a positive number of GB, got {gpu_mem_gb}")
    print(plan_from_config(config_path, gpus_per_node, nodes, gpu_mem_gb, overrides))
    return 0
