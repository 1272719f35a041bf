"""Progress bars by tqdm's own conventions, so that a run's log redirected to a file holds log lines, not bar refreshes.

Every bar of the pipeline comes from :func:`progress_bar`: drawn on rank 0 only, only where its stream (stderr) is a
terminal (tqdm's ``disable=None``), and as ``TQDM_DISABLE`` says when that is set. ``-q`` sets ``TQDM_DISABLE=1``.
"""

from __future__ import annotations

import os

from tqdm.auto import tqdm

from sage_grpo.core import distributed

DISABLE_ENV = "TQDM_DISABLE"


def progress_bar(*, enabled: bool = True, **kwargs) -> tqdm:
    """``tqdm(**kwargs)``; ``enabled=False`` (or a rank other than 0) never draws."""
    return tqdm(disable=not (enabled and distributed.is_main()) or _disabled_by_environment(), **kwargs)


def _disabled_by_environment() -> bool | None:
    # tqdm applies TQDM_DISABLE only as a default, read once at its import and overridden by any explicit `disable`,
    # so it is read here, at each bar, the way tqdm reads it: any non-empty value turns bars off, and set but empty
    # (disable=False) draws them off a terminal too. Unset: None, tqdm's "only on a terminal".
    setting = os.environ.get(DISABLE_ENV)
    return None if setting is None else bool(setting)
