"""sage_grpo.pipeline.launch around a real torchrun (two CPU workers): a worker's 75, or a stop signal relayed to the
workers, comes out as the retry status; other statuses come out as themselves."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sage_grpo.core.errors import RETRYABLE_EXIT_CODE

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]

# A stand-in run: checkpoints (here: nothing) and exits 75 on SIGTERM/SIGUSR1, as the real one does.
WORKER = f"""
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit({RETRYABLE_EXIT_CODE}))
signal.signal(signal.SIGUSR1, lambda *_: sys.exit({RETRYABLE_EXIT_CODE}))
open(os.path.join(sys.argv[2], "ready" + os.environ["LOCAL_RANK"]), "w").close()
mode = sys.argv[1]
if mode == "stop-rank-1" and os.environ["RANK"] == "1":
    sys.exit({RETRYABLE_EXIT_CODE})
if mode == "user-error":
    sys.exit(2)
if mode == "wait":
    signal.pause()  # until the stop signal, however long the launch took
"""


def _launch(tmp_path: Path, *worker_args: str, source: str = WORKER, launcher_args=()) -> subprocess.Popen:
    """Two ranks of the worker ``source`` under pipeline.launch; their output and the launcher's in one stream."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    command = [
        sys.executable,
        "-m",
        "sage_grpo.pipeline.launch",
        *launcher_args,
        "--standalone",
        "--nproc-per-node=2",
        "--signals-to-handle=SIGTERM,SIGUSR1",
        str(script),
        *worker_args,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("mode, expected", [("stop-rank-1", 143), ("user-error", 2)])
def test_worker_status_becomes_the_launcher_status(tmp_path, mode, expected):
    launcher = _launch(tmp_path, mode, str(tmp_path), launcher_args=["--retry-exit-code=143"])
    output, _ = launcher.communicate()
    assert launcher.returncode == expected, output


def test_a_stop_signal_reaches_the_workers_and_asks_for_a_restart(tmp_path):
    launcher = _launch(tmp_path, "wait", str(tmp_path))
    while not all((tmp_path / f"ready{rank}").exists() for rank in (0, 1)):
        assert launcher.poll() is None, launcher.communicate()[0]
        time.sleep(0.1)
    launcher.send_signal(signal.SIGUSR1)  # Slurm's pre-timeout signal, relayed by train.sbatch
    # A signal that lands while torchrun's agent is inside Popen.poll() can leave that Popen's waitpid lock held, and
    # torchrun then waits out its shutdown timeout twice (SIGUSR1, then SIGKILL; 30 s each) for a worker that has
    # already exited. It still returns the retry status, which is what this test checks: wait for the exit, not a clock.
    output, _ = launcher.communicate()
    assert launcher.returncode == RETRYABLE_EXIT_CODE, output
    assert "SIGUSR1" in output


# A rank ending through core.distributed.exit_launched, as `python -m sage_grpo.pipeline.cli` does after its command.
EXITING_WORKER = """
import atexit, logging, sys
import torch.distributed
from sage_grpo.core import distributed
distributed.init()
out = sys.argv[1]
logging.basicConfig(filename=f"{out}/log{distributed.rank()}", level=logging.INFO)
logging.getLogger("worker").info("logged before the end")
sys.stdout.write(f"rank {distributed.rank()} wrote this without a newline or a flush")
torch.distributed.barrier()  # neither rank's exit can end the other (torchrun stops the rest) before it has written
atexit.register(lambda: open(f"{out}/teardown-ran", "w").close())
sys.exit(distributed.exit_launched(3))
"""


def test_a_launched_rank_ends_with_its_status_and_its_output_flushed_without_the_teardown(tmp_path):
    launcher = _launch(tmp_path, str(tmp_path), source=EXITING_WORKER)
    output, _ = launcher.communicate()
    assert launcher.returncode == 3, output[-3000:]  # the ranks' own status, through torchrun
    for rank in (0, 1):
        assert "logged before the end" in (tmp_path / f"log{rank}").read_text()
        assert f"rank {rank} wrote this without a newline or a flush" in output
    assert not (tmp_path / "teardown-ran").exists()  # atexit hooks (and C++ teardown) skipped: os._exit
