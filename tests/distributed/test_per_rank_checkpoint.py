"""Multi-node checkpointing without a shared filesystem: every rank uploads its own DeepSpeed files, rank 0 commits
the manifest, and each rank restores the step from the store alone (2 processes under torchrun, gloo on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sage_grpo.core.storage import CheckpointConfig
from tests.helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = Path(__file__).with_name("per_rank_checkpoint_worker.py")


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_ranks_without_a_shared_folder_checkpoint_and_restore(tmp_path, stage):
    root = tmp_path / "store"
    torchrun(2, str(WORKER), "--stage", stage, "--root", str(root), "--out", str(tmp_path))

    reports = [json.loads((tmp_path / f"report_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all(report["loaded_equal"] for report in reports)
    # Each rank uploaded only what it wrote: its own optimizer partition, nothing of the other's.
    assert all(f"engine/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in reports[rank]["uploaded"] for rank in (0, 1))
    assert not set(reports[0]["uploaded"]) & set(reports[1]["uploaded"])
    store = CheckpointConfig(uri=str(root)).build()
    manifest = store.verify(1)
    assert manifest.world_size == 2 and manifest.run_id == "run-a" and store.latest_step() == 1
    assert {entry.path for entry in manifest.files} == set(reports[0]["uploaded"]) | set(reports[1]["uploaded"])
