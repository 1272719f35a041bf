"""SIGTERM or SIGUSR1 at any point of a run or an export, not only during training, exits with the retryable 75."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sage_grpo.core.storage import CheckpointConfig

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# Each phase blocks (printing "ready") where a slow step of that phase would be; the signal arrives there.
PHASES = {
    "run imports": (  # torch, DeepSpeed and the stages load for seconds before the run's config is even read
        "import builtins\n"
        "real_import = builtins.__import__\n"
        "def slow_import(name, *args, **kwargs):\n"
        "    if name == 'sage_grpo.pipeline.config':\n"
        "        block(None)\n"
        "    return real_import(name, *args, **kwargs)\n"
        "builtins.__import__ = slow_import\n",
        ["run", "configs/demo.yaml"],
    ),
    "run start-up": (
        "from sage_grpo.pipeline.recipe import SageGRPORecipe\nSageGRPORecipe.setup = block\n",
        ["run", "configs/demo.yaml"],
    ),
    "run export at the end": (
        "from sage_grpo.pipeline.recipe import SageGRPORecipe\n"
        "def setup(self, resume=None, fresh_start=False):\n"
        "    self.progress.iteration = self.config.run.max_iterations  # trained: straight to the end\n"
        "SageGRPORecipe.setup = setup\nSageGRPORecipe.cleanup = block\n",
        ["run", "configs/demo.yaml"],
    ),
    "export command": (
        "from sage_grpo.pipeline.recipe import SageGRPORecipe\nSageGRPORecipe.setup_policy = block\n",
        ["export", "configs/demo.yaml", "--checkpoint", "auto"],
    ),
}


@pytest.mark.parametrize(
    ("phase", "signum"),
    [(phase, signal.SIGTERM) for phase in PHASES] + [("run start-up", signal.SIGUSR1)],
    ids=[f"{phase}-SIGTERM" for phase in PHASES] + ["run start-up-SIGUSR1"],
)
def test_a_stop_signal_outside_the_training_loop_exits_retryable(tmp_path, phase, signum):
    patch, argv = PHASES[phase]
    argv = [*argv, f"run.output_dir={tmp_path / 'run'}"]
    if phase == "export command":  # without a committed checkpoint the export is refused before its slow part
        staged = tmp_path / "staged"
        staged.mkdir()
        (staged / "states.pt").write_bytes(b"weights")
        CheckpointConfig(uri=str(tmp_path / "run" / "checkpoints")).build().commit(
            staged, 1, world_size=1, config_hash=""
        )
    script = (
        "import sys, time\n"
        "def block(self, *args, **kwargs):\n"
        "    print('ready', file=sys.__stdout__, flush=True)  # the commands send stdout to stderr\n"
        "    time.sleep(600)\n"
        f"{patch}"
        "from sage_grpo.pipeline import cli\n"
        f"sys.exit(cli.main({argv!r}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI="")
    process = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().strip() == "ready", process.stderr.read()[-3000:]
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()

    assert process.returncode == 75, stderr[-3000:]
    assert f"{signal.Signals(signum).name} outside the training loop" in stderr
