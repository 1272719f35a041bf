"""Resuming on another number of ranks: a DeepSpeed checkpoint written by N ranks, converted to DeepSpeed's universal
checkpoint and loaded by M ranks, holds the same weights and continues with the same step (torchrun, gloo on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = Path(__file__).with_name("universal_checkpoint_worker.py")


@pytest.mark.parametrize(("stage", "saved_on", "loaded_on"), [("zero3", 2, 1), ("zero3", 1, 2), ("zero2", 2, 1)])
def test_a_checkpoint_continues_on_another_number_of_ranks(tmp_path, stage, saved_on, loaded_on):
    torchrun(saved_on, str(WORKER), "save", "--stage", stage, "--out", str(tmp_path))
    torchrun(loaded_on, str(WORKER), "load", "--stage", stage, "--out", str(tmp_path))

    for rank in range(loaded_on):
        report = json.loads((tmp_path / f"report_rank{rank}.json").read_text())
        assert report["loaded_equal"] and report["global_steps"] == 2
        # The next step lands where the saving job's own next step did: the Adam moments and step count came along.
        assert report["moved_by_step"] > 1e-4
        assert report["max_step_difference"] <= 1e-6
