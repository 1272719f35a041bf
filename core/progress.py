"""Progress bars by tqdm's own conventions, so that a run's log redirected to a file holds log lines, not bar refreshes.

Every bar of the pipeline comes from :func:`progress_bar`: drawn on rank 0 only, only where its stream (stderr) is a
terminal (tqdm's ``disable=None``), and as ``TQDM_DISABLE`` says when that is set. ``-q`` sets ``TQDM_DISABLE=1``.
The libraries' own bars follow the same rule through :func:`quiet_library_bars`.
"""

from __future__ import annotations

import importlib
import os
import sys

from tqdm.auto import tqdm

from sage_grpo.core import distributed

DISABLE_ENV = "TQDM_DISABLE"


def progress_bar(*, enabled: bool = True, **kwargs) -> tqdm:
    """``tqdm(**kwargs)``; ``enabled=False`` (or a rank other than 0) never draws."""
    return tqdm(disable=not (enabled and distributed.is_main()) or _disabled_by_environment(), **kwargs)


def quiet_library_bars(pipeline: object | None = None) -> None:
    """Turns off the bars MLflow (artifact transfers), diffusers, transformers and the Hugging Face Hub (loading,
    downloads) and a diffusers ``pipeline`` (its denoising loop) draw, where :func:`progress_bar` would draw none:
    each has its own switch, on by default, that ignores both a redirected stderr and ``TQDM_DISABLE``. Imports
    none of them: a library imported later reads the environment variables set here."""
    if _library_bars_allowed():
        return
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:  # it read the variable at its import
        importlib.import_module("huggingface_hub.utils").disable_progress_bars()
    for library in ("diffusers", "transformers"):  # neither has a variable of its own
        if library in sys.modules:
            importlib.import_module(f"{library}.utils.logging").disable_progress_bar()
    if pipeline is not None:
        pipeline.set_progress_bar_config(disable=True)


def _library_bars_allowed() -> bool:
    disabled = _disabled_by_environment()
    on_terminal = sys.stderr is not None and sys.stderr.isatty()
    return distributed.is_main() and (on_terminal if disabled is None else not disabled)


def _disabled_by_environment() -> bool | None:
    # tqdm applies TQDM_DISABLE only as a default, read once at its import and overridden by any explicit `disable`,
    # so it is read here, at each bar, the way tqdm reads it: any non-empty value turns bars off, and set but empty
    # (disable=False) draws them off a terminal too. Unset: None, tqdm's "only on a terminal".
    setting = os.environ.get(DISABLE_ENV)
    return None if setting is None else bool(setting)
