"""Real DeepSpeed checkpoints (ZeRO-2/3, LoRA-like and full) load through core.safe_load; a planted pickle that
passes the store's verification (manifest rewritten) is refused with one line and never runs."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sage_grpo.core.storage import MANIFEST_NAME, CheckpointConfig
from tests.unit.test_safe_load import plant

pytestmark = [pytest.mark.distributed]

WORKER = Path(__file__).with_name("safe_load_worker.py")
REPO = Path(__file__).resolve().parents[2]
PLANTED = "engine/zero_pp_rank_0_mp_rank_00_model_states.pt"


def run_worker(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a world of one, set up by core.distributed.init
    return subprocess.run(
        [sys.executable, str(WORKER), *args], env=env, capture_output=True, text=True, timeout=600, cwd=REPO
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engines")
    result = run_worker(
        "save-and-load", "--out", str(out), "--stage", "zero2", "--stage", "zero3", "--kind", "lora", "--kind", "full"
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def test_genuine_checkpoints_load_and_consolidate(saved):
    report = json.loads((saved / "report.json").read_text())
    assert sorted(report) == ["zero2-full", "zero2-lora", "zero3-full", "zero3-lora"]
    for case, checks in report.items():
        assert checks == {
            "differs_before": True,
            "loaded_equal": True,
            "next_step_equal": True,
            "consolidated_equal": True,
            "steps_restored": True,
        }, case


def test_a_planted_pickle_with_a_rewritten_manifest_is_refused_and_runs_nothing(saved, tmp_path):
    root = tmp_path / "checkpoints"
    store = CheckpointConfig(uri=str(root)).build()
    store.commit(saved / "zero3-lora", 1, world_size=1, config_hash="cfg")
    marker = tmp_path / "marker"
    planted = plant(root / "step-1" / PLANTED, marker)
    manifest_path = root / "step-1" / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["files"]:
        if entry["path"] == PLANTED:
            entry.update(size=planted.stat().st_size, sha256=hashlib.sha256(planted.read_bytes()).hexdigest())
    manifest_path.write_text(json.dumps(manifest))

    store.download(1, tmp_path / "restored")  # the attacker's manifest matches: verification cannot catch it
    result = run_worker("load", "--out", str(tmp_path / "restored"), "--stage", "zero3", "--kind", "lora")

    assert result.returncode == 2, result.stderr[-4000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("sagegrpo: error:")]
    assert len(error_lines) == 1 and PLANTED.split("/")[-1] in error_lines[0] and "io.open" in error_lines[0]
    assert "Traceback" not in result.stderr
    assert not marker.exists()
    # The same file is a working exploit for an unguarded load: the test would fail on code without the guard.
    torch.load(tmp_path / "restored" / PLANTED, weights_only=False)
    assert marker.exists()
