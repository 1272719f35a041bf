"""Probe corpus, leftovers and signals: what a killed process leaves (an export's staging, a full weight copy; its
process group's rendezvous folder in the temp dir) is removed at the next start, and only that: a folder of a
process still running, of another user, or named otherwise stays. SIGTERM or SIGUSR1 at any point of a run or an
export, not only during training, exits with the retryable 75."""

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from sage_grpo.core.export import export_lora
from sage_grpo.core.lora import LoraConfig, add_lora
from sage_grpo.core.models.tiny import tiny_hunyuan15_pipeline
from sage_grpo.core.storage import CheckpointConfig

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def pids():
    """A pid whose process is gone and one whose process runs."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    running = subprocess.Popen(["sleep", "600"])
    yield {"gone": gone.pid, "running": running.pid, "this": os.getpid()}
    running.kill()
    running.wait()


def make(path: Path, kind: str = "folder", uid: int | None = None) -> Path:
    if kind == "folder":
        path.mkdir()
        (path / "weights.safetensors").write_bytes(b"a full copy of the weights")
    elif kind == "file":
        path.write_bytes(b"a file")
    else:
        target = path.with_name("link-target")
        target.mkdir()
        path.symlink_to(target, target_is_directory=True)
    if uid is not None:
        os.chown(path, uid, -1, follow_symlinks=False)
    return path


def staging(pid: int, name: str = "step-8") -> str:
    return f".{name}.{pid}-{uuid.uuid4().hex}.tmp"


# (name, kind, owner's uid or None for ours, removed?)
EXPORT_LEFTOVERS = {
    "a killed export's staging": (lambda p: staging(p["gone"]), "folder", None, True),
    "another step's, killed": (lambda p: staging(p["gone"], "step-4"), "folder", None, True),
    "this pid's (a restarted container)": (lambda p: staging(p["this"]), "folder", None, True),
    "a running export's staging": (lambda p: staging(p["running"]), "folder", None, False),
    "another user's": (lambda p: staging(p["gone"]), "folder", 12345, False),
    "a file of that name": (lambda p: staging(p["gone"]), "file", None, False),
    "a link of that name": (lambda p: staging(p["gone"]), "link", None, False),
    "a user's .tmp folder": (lambda p: ".step-8.tmp", "folder", None, False),
    "a pid-less name": (lambda p: f".step-8.{uuid.uuid4().hex}.tmp", "folder", None, False),
    "an export": (lambda p: "step-2", "folder", None, False),
}


@pytest.fixture(scope="module")
def adapter():
    transformer = add_lora(tiny_hunyuan15_pipeline().transformer, LoraConfig(enabled=True, rank=4))
    with torch.no_grad():
        for param in (p for p in transformer.parameters() if p.requires_grad):
            param.add_(0.1)
    return transformer


@pytest.mark.parametrize("case", EXPORT_LEFTOVERS)
def test_an_export_removes_only_the_staging_a_killed_export_left(adapter, tmp_path, pids, case):
    name, kind, uid, removed = EXPORT_LEFTOVERS[case]
    if uid is not None and os.getuid() != 0:
        pytest.skip("making a folder another user's needs root")
    exports = tmp_path / "exports"
    exports.mkdir()
    leftover = make(exports / name(pids), kind, uid)

    export_lora(adapter, exports / "step-8")

    assert (leftover.exists() or leftover.is_symlink()) != removed
    assert (exports / "step-8" / "export.json").is_file()
    assert len([p for p in exports.iterdir() if p.name.startswith(".step-8.") and p != leftover]) == 0


RENDEZVOUS_LEFTOVERS = {
    "a killed process's": (lambda p: f"sagegrpo-pg-{p['gone']}-abc_1234", None, True),
    "a running process's": (lambda p: f"sagegrpo-pg-{p['running']}-abc_1234", None, False),
    "another user's": (lambda p: f"sagegrpo-pg-{p['gone']}-xyz_9876", 12345, False),
    "one without a pid": (lambda p: "sagegrpo-pg-k3j_x9a2", None, False),
    "someone else's": (lambda p: f"other-pg-{p['gone']}-abc", None, False),
}


def test_a_single_process_start_removes_only_the_rendezvous_folders_of_killed_processes(tmp_path, pids):
    planted = {}
    for case, (name, uid, removed) in RENDEZVOUS_LEFTOVERS.items():
        if uid is not None and os.getuid() != 0:
            continue
        planted[case] = (make(tmp_path / name(pids), "folder", uid), removed)
    script = "from sage_grpo.core import distributed\ndistributed.init()\nprint('up', flush=True)\n"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")

    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)

    assert result.returncode == 0 and "up" in result.stdout, result.stderr[-3000:]
    for case, (path, removed) in planted.items():
        assert path.exists() != removed, case
    kept = sorted(path.name for path, removed in planted.values() if not removed and "sagegrpo-pg-" in path.name)
    assert sorted(path.name for path in tmp_path.glob("sagegrpo-pg-*")) == kept  # the new process's own is gone too


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
