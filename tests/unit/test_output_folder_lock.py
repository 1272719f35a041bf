"""Two runs never share an output folder unknowingly: a live ``sagegrpo run`` holds ``run.output_dir`` (an OS lock on
``run.lock``, core/output_lock.py), a second run on it is refused in one line naming the holder before it writes
anything, and the lock goes with the holder's process however it ends (here SIGKILL)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from sage_grpo.core.output_lock import LOCK_FILE, OutputFolderLock
from tests.helpers import refused_in_one_line, wait_for
from tests.integration.pipeline_runs import DEMO, REPO, environment, sagegrpo_command

pytestmark = pytest.mark.unit


def holder_record(output_dir: Path, process: subprocess.Popen) -> dict:
    """The live run's record in its lock file, once written (the lock is taken before the run's slow imports)."""
    path = output_dir / LOCK_FILE
    wait_for(lambda: path.exists() and path.read_text().strip(), process)
    return json.loads(path.read_text())


def test_a_second_run_on_a_live_runs_output_dir_is_refused_and_a_killed_run_releases_it(tmp_path, capsys):
    output_dir = tmp_path / "run"
    first = subprocess.Popen(
        sagegrpo_command(output_dir, "run.name=first", "run.max_iterations=1000"),
        cwd=REPO,
        env=environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        record = holder_record(output_dir, first)
        assert (record["run"], record["pid"]) == ("first", first.pid)

        line = refused_in_one_line(
            capsys, ["run", str(DEMO), f"run.output_dir={output_dir}", "run.name=second"], "run.output_dir"
        )
        assert "run 'first'" in line and f"pid {first.pid}" in line
        assert json.loads((output_dir / LOCK_FILE).read_text())["run"] == "first"  # the refused one wrote nothing
    finally:
        first.kill()  # a crash: no cleanup of its own runs
        first.wait(timeout=60)

    lock = OutputFolderLock(output_dir)
    lock.acquire("after the crash")  # the OS dropped the dead process's lock
    lock.release()
