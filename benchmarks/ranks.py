"""Start a benchmark's worker on ``world`` CPU ranks through torchrun, as the tests' workers are started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def launch(target: list[str], world: int, timeout_s: int) -> None:
    """Runs ``torchrun --standalone --nproc-per-node=world *target`` from the repository root (a rendezvous on a free
    port torchrun picks itself); raises with the workers' output when one fails. The workers write their reports."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--standalone", *target]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    if result.returncode:
        raise RuntimeError(f"{world}-rank worker failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
