"""``SageGRPORecipe.resampled_rewards`` draws exactly the batch ``train_step`` rolls out: ``sagegrpo preflight`` pairs
the first iteration's scores with the same batch re-sampled after its update, and the pairs mean something only if
the two rollouts share prompts, seed, sampler, batches and so noise. Before any update they must score bit for bit
alike; after it, they differ (the update moved the weights). In-process on the demo's model made smaller (a world of
one, a real ZeRO-3 engine)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from sage_grpo.pipeline.config import load_run_config
from sage_grpo.pipeline.recipe import SageGRPORecipe
from tests.unit.test_recipe import DEMO, SMALL, process_group  # noqa: F401 (a fixture)

pytestmark = pytest.mark.unit


def test_the_resample_is_the_first_iterations_batch_with_its_noise(tmp_path: Path):
    # sde.window: iteration 0's window slides away at iteration 1, so the resample must ask for iteration 0's sampler.
    overrides = ["sde.window=[0,2]", "sde.window_schedule=sliding"]
    recipe = SageGRPORecipe(load_run_config(DEMO, [*SMALL, f"run.output_dir={tmp_path}", *overrides]))
    recipe.setup()
    first_prompts = next(copy.deepcopy(recipe.sampler))

    before_update = recipe.resampled_rewards(first_prompts, 0)
    assert recipe.progress.iteration == 0  # it trained nothing, and the sampler did not move:
    recipe.train_step()
    scored = recipe.scorer.last_scored
    assert scored is not None and scored.total == before_update  # train_step scored exactly that batch

    after_update = recipe.resampled_rewards(first_prompts, 0)
    assert len(after_update) == len(before_update) == 4  # 2 prompts x G = 2
    assert after_update != before_update
