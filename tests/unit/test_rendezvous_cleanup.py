"""A single process's process group rendezvouses through a file in a fresh temporary folder; the folder goes when
the process ends, by the interpreter's exit or by ``exit_launched`` (the CLI's way out), so a scheduled job's daily
runs do not pile folders up in /tmp."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize("ending", ["sys.exit(0)", "sys.exit(distributed.exit_launched(0))"])
def test_the_rendezvous_folder_is_removed_when_the_process_ends(tmp_path, ending):
    script = (
        "import sys, glob, os\n"
        "from sage_grpo.core import distributed\n"
        "distributed.init()\n"
        "assert distributed.world_size() == 1\n"
        "print('stores:', *glob.glob(os.path.join(os.environ['TMPDIR'], 'sagegrpo-pg-*', 'store')))\n"
        f"{ending}\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("stores:")]
    [store] = line.split()[1:]  # the rendezvous file existed while the group was up
    assert Path(store).parent.parent == tmp_path
    assert list(tmp_path.glob("sagegrpo-pg-*")) == []
