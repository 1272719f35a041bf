"""What each ``sagegrpo`` command does, once ``pipeline.cli`` has parsed its command line: config, logging, the
output a person (or ``jq``) reads. Exit codes: 0 done, 2 user error, 75 retryable, 1 failure.

The command line imports this module for every command, ``--help`` included, so torch, mlflow and DeepSpeed are
imported inside the commands that use them: help stays instant and ``config`` loads only what the config needs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import warnings
from datetime import date
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from sage_grpo.core.errors import UserError
from sage_grpo.core.secrets import mask_uri
from sage_grpo.pipeline.signals import retryable_signals

if TYPE_CHECKING:
    from sage_grpo.pipeline.config import RunConfig

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
    from sage_grpo.core.progress import DISABLE_ENV

    main_level = logging.INFO if verbosity >= 0 else logging.WARNING
    if verbosity < 0:
        os.environ[DISABLE_ENV] = "1"  # tqdm's own switch: read by core.progress, inherited by child processes
    level = main_level if _is_main() else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # MLflow is imported where it is first used, after this; on import it would give its loggers its own handler at
    # INFO, overriding the levels below. Unconfigured, they propagate here like every other library's.
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    if verbosity > 0:
        return
    for noisy in THIRD_PARTY:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_third_party_info_by_file)
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.set_verbosity_error()
    transformers_logging.set_verbosity_error()
    modules = "|".join(name.lower() for name in THIRD_PARTY)
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=rf"({modules})(\.|$)")


def _third_party_info_by_file(record: logging.LogRecord) -> bool:
    """False for a library's INFO under a logger named by its file (huggingface_hub names some loggers by
    ``__file__``, so the level set on ``huggingface_hub`` misses them): one announced each export's staging path."""
    if record.levelno >= logging.WARNING or os.sep not in record.name:
        return True
    return not any(f"{os.sep}{package}{os.sep}" in record.name for package in THIRD_PARTY)


def run_command(
    config_path: str, overrides: list[str], *, resume: str | None, fresh_start: bool = False, verbosity: int = 0
) -> int:
    # The summary is the only stdout: DeepSpeed prints its op builds there, and its logger writes to the stdout it
    # finds at import (its accelerator warning among the first lines), so it is imported in here too. The signals
    # from before the slow imports: a stop anywhere outside the training loop (which handles its own) exits 75.
    with retryable_signals():
        with contextlib.redirect_stdout(sys.stderr):
            config = _load_config(config_path, overrides)
            setup_logging(verbosity)
            from sage_grpo.pipeline.recipe import SageGRPORecipe, make_run_folders

            make_run_folders(config)  # a folder that cannot be one is refused before the lock writes into it
            with _output_folder_held(config):
                recipe = SageGRPORecipe(config)
                recipe.setup(resume=resume, fresh_start=fresh_start)
                summary = recipe.train()
        if _is_main():
            print(_summary_text(config, summary), flush=True)
        return summary.exit_code


@contextlib.contextmanager
def _output_folder_held(config: RunConfig):
    """``run.output_dir`` held by the run's rank 0 for the run's life (``core.output_lock``): a second run on it is
    refused in one line before anything loads."""
    from sage_grpo.core.output_lock import OutputFolderLock

    lock = OutputFolderLock(config.output_dir)
    if _is_main():  # before the process group exists: the launcher's variable says it
        lock.acquire(config.run.name)
    try:
        yield
    finally:
        lock.release()


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
    if summary.status == "hacking":
        lines.append(
            f"  stopped:     by the hacking guard (the reward rose while a judge fell); the export is the best step by "
            f"{config.checkpoint.best_metric}; nothing registered (exit code {summary.exit_code})"
        )
    return "\n".join(lines)


def eval_command(config_path: str, overrides: list[str], checkpoint: str, verbosity: int = 0) -> int:
    """Prints the metrics as JSON, the only thing on stdout (libraries' start-up prints go to stderr), so
    ``sagegrpo eval ... | jq`` works."""
    config = _load_config(config_path, overrides)
    _checked_step(config, checkpoint)
    with contextlib.redirect_stdout(sys.stderr):
        metrics = _recipe_with_policy(config, checkpoint, verbosity).evaluate()
    if _is_main():
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
    config = _load_config(config_path, overrides)
    if checkpoint:
        _checked_step(config, checkpoint)
    with contextlib.redirect_stdout(sys.stderr):
        paths = _recipe_with_policy(config, checkpoint, verbosity).sample(prompts, seed, Path(out))
    for path, prompt in zip(paths, prompts):
        print(f"{path}\t{prompt}")
    return 0


def export_command(config_path: str, overrides: list[str], checkpoint: str, out: str | None, verbosity: int = 0) -> int:
    """The diffusers-format export of any checkpoint (``auto``: the newest verified one); prints its folder. A target
    holding anything but an earlier export, or a checkpoint that is not there, is refused before the model loads
    (the export checks its target again when it writes)."""
    from sage_grpo.core.export import check_replaceable

    with retryable_signals():
        config = _load_config(config_path, overrides)
        if out:
            check_replaceable(out)
        step = _checked_step(config, checkpoint)
        if not out and step is not None:
            check_replaceable(_export_dir(config, f"step-{step}"))
        with contextlib.redirect_stdout(sys.stderr):
            recipe = _recipe_with_policy(config, checkpoint, verbosity)
            out_dir = Path(out) if out else _export_dir(config, recipe.checkpoint_name)
            recipe.export(out_dir)
        if _is_main():
            print(out_dir.resolve())
        return 0


def _export_dir(config: RunConfig, checkpoint_name: str) -> Path:
    return config.output_dir / "exports" / checkpoint_name


def _load_config(config_path: str, overrides: list[str]) -> RunConfig:
    from sage_grpo.pipeline.config import load_run_config

    return load_run_config(config_path, overrides)


def _checked_step(config: RunConfig, checkpoint: str) -> int | None:
    """The step ``checkpoint`` names (None for ``auto``), checked against the store's manifests: a checkpoint that
    is not there is one line now, not after the model, DeepSpeed and the prompts are set up."""
    return config.checkpoint.build(config.output_dir, config.s3).check_committed(checkpoint)


def _recipe_with_policy(config: RunConfig, checkpoint: str | None, verbosity: int):
    setup_logging(verbosity)
    from sage_grpo.pipeline.recipe import SageGRPORecipe

    recipe = SageGRPORecipe(config)
    recipe.setup_policy(checkpoint)
    return recipe


def _is_main() -> bool:
    from sage_grpo.core import distributed

    return distributed.is_main()


def preflight_command(config_path: str, overrides: list[str], verbosity: int = 0) -> int:
    """Exit 0 when every check passes, 1 otherwise (the failed checks are the last lines of the table)."""
    _load_config(config_path, overrides)  # a config error is one line before anything is built
    setup_logging(verbosity)
    from sage_grpo.pipeline.preflight import preflight, table

    with contextlib.redirect_stdout(sys.stderr):
        checks = preflight(config_path, overrides)
    if _is_main():
        print(table(checks), flush=True)
    return 1 if any(check.passed is False for check in checks) else 0


def config_command(config_path: str, overrides: list[str], as_json: bool = False) -> int:
    """Prints the resolved, validated config (defaults filled, secrets masked) as YAML, or as JSON for scripts."""
    import yaml

    from sage_grpo.core.secrets import masked_config

    resolved = masked_config(_load_config(config_path, overrides))
    print(json.dumps(resolved, indent=2) if as_json else yaml.safe_dump(resolved, sort_keys=False).rstrip("\n"))
    return 0


def package_version() -> str:
    try:
        return metadata.version("sage-grpo")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def env_command() -> int:
    """Prints the versions, the accelerator stack and the DeepSpeed ops a bug report needs."""
    import platform

    from sage_grpo.core.environment import accelerator_lines, deepspeed_op_lines

    lines = [f"sage-grpo     {package_version()}", f"python        {platform.python_version()} ({platform.platform()})"]
    for package in ("torch", "deepspeed", "diffusers", "transformers", "peft", "mlflow", "boto3", "pydantic"):
        try:
            lines.append(f"{package:<13} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{package:<13} not installed")
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger writes to the stdout it finds at import
        lines += [*accelerator_lines(), *deepspeed_op_lines()]
    print("\n".join(lines))
    return 0


def inspect_sde_command(variant: str, steps: int, shift: float, eta: float, as_json: bool, plot: str | None) -> int:
    """Prints the noise std, N_t and S_t per step of each SDE variant's noise schedule (a table, or JSON)."""
    from sage_grpo.core import sde
    from sage_grpo.pipeline.inspect_sde import run

    if variant != "all" and variant not in sde.VARIANTS:
        raise UserError(f"--variant {variant!r} is not one of {', '.join(sde.VARIANTS)}, all")
    if steps < 1:
        raise UserError(f"--steps must be >= 1, got {steps}")
    if eta < 0:
        raise UserError(f"--eta must be >= 0, got {eta}")
    if shift <= 0:
        raise UserError(f"--shift must be > 0, got {shift}")
    print(run(variant, steps, shift, eta, as_json, plot))
    return 0


def check_reward_command(
    target: str,
    overrides: list[str],
    *,
    data: str | None,
    num_videos: int,
    size: str | None,
    device: str | None,
    seed: int,
    sensitivity: bool = True,
) -> int:
    """Builds a reward and scores synthetic videos with real prompts; ``size`` as ``FxHxW``."""
    from sage_grpo.pipeline.check_reward import check_reward, parse_size

    video_size = parse_size(size) if size else None
    return check_reward(
        target,
        overrides,
        data=data,
        num_videos=num_videos,
        size=video_size,
        device=device,
        seed=seed,
        sensitivity=sensitivity,
    )


def serve_reward_command(
    config_path: str, host: str, port: int, device: str | None, settings: dict[str, float | int | str | None]
) -> int:
    """Serves the rewards of ``config_path`` over HTTP until stopped; ``settings`` are ``ServerSettings`` fields."""
    import torch
    from pydantic import ValidationError

    from sage_grpo.core.config_loading import one_line
    from sage_grpo.core.rewards.server import ServerSettings, load_reward_specs, serve

    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    try:
        server_settings = ServerSettings(**settings)
    except ValidationError as error:
        raise UserError(f"serve-reward: {one_line(error)}") from None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    serve(load_reward_specs(config_path), host, port, device, server_settings)
    return 0


def plan_command(
    config_path: str,
    overrides: list[str],
    gpus_per_node: int,
    nodes: int,
    gpu_mem_gb: float,
    sequence_parallel: int | None = None,
    mfu: float = 0.35,
    gpu_name: str = "H100",
) -> int:
    """Prints the per-GPU memory plan of the hand formula and what fits instead, then the plan traced from the real
    model (``pipeline.phase_plan``); allocating nothing, it needs no GPU. Exit 1: the traced plan does not fit."""
    from sage_grpo.pipeline.config import load_run_config
    from sage_grpo.pipeline.memory_plan import plan_for
    from sage_grpo.pipeline.phase_plan import phase_plan

    if gpu_mem_gb <= 0 or not math.isfinite(gpu_mem_gb):
        raise UserError(f"--gpu-mem must be a positive number of GB, got {gpu_mem_gb}")
    config = load_run_config(config_path, overrides)
    formula = plan_for(config, gpus_per_node, nodes, gpu_mem_gb, sequence_parallel)
    print("hand formula (pipeline/memory_plan.py; a cross-check, and what its suggestions assume):")
    print(formula)
    traced = phase_plan(config, formula, mfu=mfu, gpu_name=gpu_name)
    print(traced)
    return 0 if traced.fits else 1


def promote_command(
    config_path: str | None,
    overrides: list[str],
    *,
    model: str | None,
    version: str | None,
    primary_metric: str | None,
    margin: float | None,
    guards: dict[str, float] | None,
    min_eval_prompts: int | None,
    dry_run: bool,
    tracking_uri: str | None,
) -> int:
    """Moves the champion alias to ``version`` (default: the challenger) if it passes the gate; prints the decision.
    Each setting left None comes from the config's registry section, else its default."""
    from mlflow import MlflowClient

    from sage_grpo.core.registry import outage_is_retryable, promote
    from sage_grpo.core.tracking import fail_fast_http
    from sage_grpo.pipeline.config import RegistryConfig

    if overrides and not config_path:
        raise UserError(f"promote: overrides need a --config to apply to: {' '.join(overrides)}")
    config = _load_config(config_path, overrides) if config_path else None
    settings = config.registry if config else RegistryConfig()
    model = model or settings.model_name
    if not model:
        raise UserError("promote needs --model, or a --config whose registry.model_name is set")
    margin = settings.margin if margin is None else margin
    if not margin >= 0:
        raise UserError(f"--margin must be >= 0, got {margin}")
    tracking_uri = tracking_uri or _registry_tracking_uri(config)
    fail_fast_http()  # MLflow's own retries would hold a dead server's answer for minutes
    # promote has no run to resume: the alias and its tag are set the same way when it runs again.
    with outage_is_retryable(tracking_uri, "promoting", advice="run promote again once the server answers"):
        decision = promote(
            MlflowClient(tracking_uri=tracking_uri),
            model,
            version=version,
            primary_metric=primary_metric or settings.primary_metric,
            min_improvement=margin,
            guarded=settings.guards if guards is None else guards,
            min_eval_prompts=settings.min_eval_prompts if min_eval_prompts is None else min_eval_prompts,
            dry_run=dry_run,
        )
    print(decision.summary())
    # Scores that cannot be compared are a setup to fix (one fixed evaluation set and definition), not a verdict:
    # a scheduler must see the job fail, the same way every time.
    return 0 if decision.comparable else UserError.exit_code


def _registry_tracking_uri(config: RunConfig | None) -> str:
    from sage_grpo.core.tracking import TrackingConfig

    if config:
        return config.tracking.resolved_uri(config.output_dir)
    uri = TrackingConfig().server_uri()  # not MLflow's own default: ./mlflow.db in whatever folder this started in
    if not uri:
        raise UserError("promote needs --tracking-uri, MLFLOW_TRACKING_URI or a --config naming the registry")
    return uri


def schedule_command(
    config_path: str,
    overrides: list[str],
    prompts: str,
    checkpoint_root: str,
    model: str,
    work_dir: str,
    nproc_per_node: int | None,
    today: date | None,
    dry_run: bool,
) -> int:
    """The scheduled run (``pipeline.scheduled_run``): newest prompts, train, promote."""
    from sage_grpo.pipeline.scheduled_run import ScheduledRunOptions, run_scheduled

    options = ScheduledRunOptions(
        config_path, prompts, checkpoint_root, model, work_dir, nproc_per_node, today, dry_run, tuple(overrides)
    )
    return run_scheduled(options)
