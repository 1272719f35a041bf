"""A single process's process group rendezvouses through a file in a fresh temporary folder; the folder goes when
the process ends, by the interpreter's exit or by ``exit_launched`` (the CLI's way out), so a scheduled job's daily
runs do not pile folders up in /tmp. A start also removes the folders killed processes left, and only those."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import gone_and_running_pids, make_leftover

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


@pytest.fixture(scope="module")
def pids():
    with gone_and_running_pids() as pids:
        yield pids


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
        planted[case] = (make_leftover(tmp_path / name(pids), "folder", uid), removed)
    script = "from sage_grpo.core import distributed\ndistributed.init()\nprint('up', flush=True)\n"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")

    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)

    assert result.returncode == 0 and "up" in result.stdout, result.stderr[-3000:]
    for case, (path, removed) in planted.items():
        assert path.exists() != removed, case
    kept = sorted(path.name for path, removed in planted.values() if not removed and "sagegrpo-pg-" in path.name)
    assert sorted(path.name for path in tmp_path.glob("sagegrpo-pg-*")) == kept  # the new process's own is gone too
