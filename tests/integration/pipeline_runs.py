"""Helpers for tests that run ``sagegrpo run`` as a user would: a real subprocess on the shortened demo config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO
from tests.helpers import worker_environment as environment  # a run's environment is any worker's

DEMO = REPO / "configs" / "demo.yaml"

# The demo, shortened: 4 SDE steps, 2 prompts x group 2 per rank, evaluation and checkpoints every 2 iterations.
SHORT = [
    "sde.steps=4",
    "rollout.group_size=2",
    "rollout.prompts_per_rank=2",
    "update.micro_batch_size=2",
    "eval.every=2",
    "eval.num_prompts=2",
    "eval.write_videos=1",
    "checkpoint.every=2",
    "trust_region.anchor_interval=2",
]
# The shortened demo made to hack (tests/integration/test_hacking_guard_runs.py): trained on brightness toward white
# fast enough that 16 iterations wash the videos out while the contrast judge falls; the guard's thresholds.
HACKING = [
    "update.learning_rate=1e-2",
    "eval.write_videos=0",
    "eval.guard.window=3",
    "eval.guard.min_reward_rise=0.01",
    "eval.guard.min_judge_drop=0.001",
]
CONTRAST_JUDGE = "eval.judges=[{name: 'tests.fixtures.user_rewards.judges:Contrast'}]"


def cli_command(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "sage_grpo.pipeline.cli", *arguments]


def _run_arguments(output_dir: Path, *overrides: str, flags: tuple[str, ...] = ()) -> list[str]:
    return ["run", str(DEMO), f"run.output_dir={output_dir}", *SHORT, *overrides, *flags]


def sagegrpo_command(output_dir: Path, *overrides: str, flags: tuple[str, ...] = ()) -> list[str]:
    return cli_command(*_run_arguments(output_dir, *overrides, flags=flags))


def sagegrpo(*arguments: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``sagegrpo ARGUMENTS`` (any command) as a subprocess from the repository root, output captured."""
    return subprocess.run(
        cli_command(*arguments), cwd=REPO, env=environment(), capture_output=True, text=True, timeout=timeout
    )


def run_sagegrpo(output_dir: Path, *overrides: str, flags: tuple[str, ...] = (), timeout: int = 600):
    return sagegrpo(*_run_arguments(output_dir, *overrides, flags=flags), timeout=timeout)


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(tracking_uri).get_metric_history(run_id, key))


def only_run_id(tracking_uri: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0].info.run_id


def consolidated_weights(checkpoint_dir: Path):
    """fp32 weights of a committed step, consolidated from its ZeRO-3 partitions by DeepSpeed's own tool."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag="engine")
