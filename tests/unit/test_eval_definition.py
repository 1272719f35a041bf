"""The evaluation definition's digest (``stages.evaluate.eval_definition``) covers the sampler settings that change the
scored videos: the steps, the shift and the CFG scale(s); the training sampler's variant and eta do not (evaluation
samples with the ODE), so they leave it as it is."""

from pathlib import Path

import pytest

from sage_grpo.pipeline.config import load_run_config
from sage_grpo.stages.evaluate import eval_definition, eval_sampler

pytestmark = pytest.mark.unit

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
EXAM = "6f1d0c3a9b8e7d6c5b4a39281706f5e4"


def definition(*overrides: str) -> tuple[str, str]:
    config = load_run_config(DEMO, list(overrides))
    sampler = eval_sampler(config.sde, config.model.guidance_scale, config.model.guidance_scale_2)
    return eval_definition(config.rewards, config.eval, EXAM, sampler)


def test_the_sampler_settings_that_shape_the_scored_videos_change_the_digest():
    base, summary = definition()
    assert "; ode steps 8, shift 3, guidance_scale 1" in summary
    changed = {
        override: definition(override)[0] for override in ("sde.steps=12", "sde.shift=5.0", "model.guidance_scale=4.0")
    }
    assert base not in changed.values() and len(set(changed.values())) == len(changed)


def test_the_training_samplers_variant_and_eta_leave_it_as_it_is():
    assert definition("sde.variant=cps", "sde.eta=0.9")[0] == definition()[0]
