"""Readers never share a restore folder: two ``sagegrpo export --checkpoint auto`` of one run, the second started
while the first is in the middle of its restore, both export the step ``auto`` names, and the store keeps it. Each
process restores into a folder of its own (``checkpoint-restore/<host>-<pid>-<token>``); a reader removes only what a
dead process left, never a live reader's folder.

The first export is paused where it loads the restored files (its own code runs; it waits for a file to appear), so
the second one's whole restore falls inside the first one's: the overlap that two exports started together may or may
not have, made certain."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.pipeline_runs import DEMO, REPO, SHORT, environment, run_sagegrpo, sagegrpo

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = ("run.max_iterations=1", "checkpoint.every=1", "tracking.enabled=false")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("readers") / "run"
    finished = run_sagegrpo(output_dir, *RUN)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return output_dir


def paused_export(arguments: list[str], go: Path) -> subprocess.Popen:
    """``sagegrpo export ARGUMENTS`` that prints "restoring" and waits for ``go`` to exist where it loads the files
    it restored."""
    script = (
        "import pathlib, sys, time\n"
        "from sage_grpo.pipeline import checkpointer\n"
        "load = checkpointer.load_engine_checkpoint\n"
        "def paused(*args, **kwargs):\n"
        "    print('restoring', file=sys.__stdout__, flush=True)\n"
        f"    while not pathlib.Path({str(go)!r}).exists():\n"
        "        time.sleep(0.05)\n"
        "    return load(*args, **kwargs)\n"
        "checkpointer.load_engine_checkpoint = paused\n"
        "from sage_grpo.pipeline import cli\n"
        f"sys.argv = ['sagegrpo', *{arguments!r}]\n"
        "sys.exit(cli.program())\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def dead_pid() -> int:
    finished = subprocess.Popen(["true"])
    finished.wait()
    return finished.pid


def test_two_exports_at_once_both_export_the_step_auto_names(finished_run, tmp_path):
    restores = finished_run / "checkpoint-restore"
    arguments = ["export", str(DEMO), f"run.output_dir={finished_run}", *SHORT, *RUN, "--checkpoint", "auto"]
    go = tmp_path / "go"
    first = paused_export(arguments, go)
    try:
        assert first.stdout.readline().strip() == "restoring", first.stderr.read()[-3000:]
        [first_folder] = restores.iterdir()
        assert first_folder.name.startswith(f"{socket.gethostname()}-{first.pid}-")
        first_files = sorted(path.relative_to(first_folder) for path in first_folder.rglob("*"))
        abandoned = restores / f"{socket.gethostname()}-{dead_pid()}-{'0' * 32}" / "step-1"
        abandoned.mkdir(parents=True)
        (abandoned / "half-a-download.pt").write_bytes(b"a reader killed mid-restore left this")

        second = sagegrpo(*arguments)

        assert second.returncode == 0, second.stderr[-3000:]
        assert second.stdout.strip() == str((finished_run / "exports" / "step-1").resolve())
        assert not abandoned.parent.exists()  # a dead reader's folder is removed
        assert sorted(path.relative_to(first_folder) for path in first_folder.rglob("*")) == first_files  # untouched
        go.touch()
        out, err = first.communicate(timeout=600)
    finally:
        go.touch()
        first.kill()
    assert first.returncode == 0, err[-3000:]
    assert out.splitlines()[-1] == second.stdout.strip()
    checkpoints = finished_run / "checkpoints"
    assert (checkpoints / "step-1" / "manifest.json").exists() and not list(checkpoints.glob("set-aside-*"))
    assert (checkpoints / "latest").read_text().strip() == "1"
    assert not restores.exists()
    assert os.listdir(finished_run / "exports") == ["step-1"]
