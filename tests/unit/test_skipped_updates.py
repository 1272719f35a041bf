"""A run that trains nothing fails. When every optimizer update of the last ``update.max_skipped_updates`` was skipped
for non-finite gradients (DeepSpeed's overflow check), the run stops with one line and a non-zero exit, and nothing
is exported or registered; the skipped updates are a logged metric until then.

The recipe runs in-process on the demo's model made smaller (a world of one, a real ZeRO-3 engine, the real overflow
check). lambda is set to NaN after setup: the state a checkpoint with lambda NaN resumed into before checkpoint values
were checked (tests/unit/test_checkpoint_values.py), and one where every loss, so every gradient, is NaN."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sage_grpo.core.errors import UserError
from sage_grpo.pipeline.config import load_run_config
from sage_grpo.pipeline.recipe import SageGRPORecipe
from tests.unit.test_recipe import DEMO, SMALL, process_group  # noqa: F401 (a fixture)

pytestmark = pytest.mark.unit


def test_a_run_whose_updates_are_all_skipped_stops_in_one_line_without_an_export(tmp_path: Path):
    config = load_run_config(
        DEMO, [*SMALL, f"run.output_dir={tmp_path}", "run.max_iterations=4", "update.max_skipped_updates=2"]
    )
    recipe = SageGRPORecipe(config)
    recipe.setup()
    recipe.policy.updater.controller.value = math.nan

    with pytest.raises(UserError) as stopped:  # the CLI: one line, exit 2
        recipe.train()

    message = str(stopped.value)
    assert "the last 2 optimizer updates were all skipped" in message and "\n" not in message
    assert recipe.progress.iteration == 1  # iteration 2's update was the second skipped: it never completed
    [first] = recipe.progress.history
    assert (first["update/skipped"], first["update/skipped_updates"], first["update/updates_done"]) == (1.0, 1.0, 0.0)
    assert not (tmp_path / "exports").exists()
    assert config.checkpoint.build(config.output_dir).list_steps() == []  # the untrained state is not committed
    audit = [json.loads(line) for line in (tmp_path / "audit" / "rank-0.jsonl").read_text().splitlines()]
    assert all(record["run"] == recipe.checkpointer.run_id for record in audit)  # the audit names its run
    assert "weights_sha256" not in audit[-1]  # never reached the end a completed run records
