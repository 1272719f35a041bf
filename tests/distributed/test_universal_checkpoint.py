"""Resuming on another number of ranks: a DeepSpeed checkpoint written by N ranks, converted to DeepSpeed's universal
checkpoint and loaded by M ranks, holds the same weights and continues with the same step (torchrun, gloo on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = Path(__file__).with_name("universal_checkpoint_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(ranks: int, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        "--nnodes=1",
        f"--master-port={_free_port()}",
        str(WORKER),
        *args,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


@pytest.mark.parametrize(("stage", "saved_on", "loaded_on"), [("zero3", 2, 1), ("zero3", 1, 2), ("zero2", 2, 1)])
def test_a_checkpoint_continues_on_another_number_of_ranks(tmp_path, stage, saved_on, loaded_on):
    _torchrun(saved_on, "save", "--stage", stage, "--out", str(tmp_path))
    _torchrun(loaded_on, "load", "--stage", stage, "--out", str(tmp_path))

    for rank in range(loaded_on):
        report = json.loads((tmp_path / f"report_rank{rank}.json").read_text())
        assert report["loaded_equal"] and report["global_steps"] == 2
        # The next step lands where the saving job's own next step did: the Adam moments and step count came along.
        assert report["moved_by_step"] > 1e-4
        assert report["max_step_difference"] <= 1e-6
