"""``sagegrpo preflight`` on 2 ranks (``sage_grpo.pipeline.launch``, gloo on CPU, the shortened demo): each rank
re-samples its own share of the first batch (distinct prompts) after the first update, and the paired differences
are gathered, so the one-update reward change is judged over both ranks' samples, alike on each (both exit 0)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO, free_port, worker_environment
from tests.integration.pipeline_runs import DEMO, SHORT

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_the_reward_change_is_judged_over_every_ranks_samples(tmp_path):
    launcher = [sys.executable, "-m", "sage_grpo.pipeline.launch", "--nproc-per-node=2", "--nnodes=1"]
    command = [
        *launcher,
        f"--master-port={free_port()}",
        *("-m", "sage_grpo.pipeline.cli", "preflight", str(DEMO)),
        f"run.output_dir={tmp_path / 'run'}",
        *SHORT,
    ]
    result = subprocess.run(command, env=worker_environment(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    [row] = [line for line in result.stdout.splitlines() if line.startswith("one-update reward change ")]
    # 2 ranks x 2 prompts x G = 2: one rank alone holds 4.
    assert row.split()[3] == "pass" and "over 8 samples of the first batch" in row, row
