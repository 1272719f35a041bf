"""Each value the config implies has one home, and the stages use it: samples per rank (``RolloutConfig``), trained
steps and S_t (``SDEConfig``), micro-steps per update (``RunConfig.accumulation_steps``), the update's order (the
run's ``seed``)."""

from pathlib import Path

import pytest
import torch

from sage_grpo.core.grpo import group_advantages
from sage_grpo.pipeline.config import load_run_config
from sage_grpo.stages.rollout import generate
from sage_grpo.stages.update import Updater, timestep_weights
from tests.helpers import LinearAdapter, SGDEngine

pytestmark = pytest.mark.unit

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
OVERRIDES = [
    "rollout.prompts_per_rank=2",
    "rollout.group_size=3",
    "sde.steps=4",
    "sde.window=[1,3]",
    "update.micro_batch_size=3",
    "update.transitions_per_micro_step=2",
]


@pytest.fixture(scope="module")
def run():
    config = load_run_config(DEMO, OVERRIDES)
    adapter = LinearAdapter()
    prompts = ["a", "b", "c"][: config.rollout.prompts_per_rank]
    rollout = generate(
        adapter,
        prompts,
        config.rollout.group_size,
        config.sde,
        seed=0,
        batch_size=config.update.micro_batch_size,
        decode=False,
        progress=False,
    )
    return config, adapter, rollout


def test_the_rollout_has_the_configs_samples_and_trained_steps(run):
    config, _, rollout = run
    assert config.rollout.samples_per_rank == rollout.num_samples == 6
    assert config.sde.trained_step_count == int(rollout.trained_steps.sum()) == 2


def test_the_updates_weights_are_the_schedules_step_weights(run):
    config, _, rollout = run
    weights = timestep_weights(rollout, equalize=True)
    torch.testing.assert_close(weights, config.sde.step_weights(rollout.sigmas.cpu()), rtol=0, atol=0)
    assert weights[~rollout.trained_steps].eq(0).all() and weights[rollout.trained_steps].gt(0).all()
    assert timestep_weights(rollout, equalize=False).tolist() == rollout.trained_steps.float().tolist()


def test_the_engines_accumulation_is_the_micro_steps_the_updater_takes(run):
    config, adapter, rollout = run
    # 2 chunks of 3 samples x 2 trained steps = 4 transitions, 2 to a forward: 2 micro-steps per update.
    assert config.accumulation_steps == 2
    engine = SGDEngine(adapter.transformer, config.accumulation_steps)
    updater = Updater(engine, adapter, config.update, config.trust_region, seed=config.seed)
    updater.update(rollout, group_advantages([0.1, 0.9, 0.4, 0.2, 0.3, 0.8], rollout.group_ids))
    assert engine.micro_steps == config.accumulation_steps and updater.updates_done == 1
    wrong = Updater(SGDEngine(adapter.transformer, 3), adapter, config.update, config.trust_region)
    with pytest.raises(ValueError, match="accumulates 3"):
        wrong.update(rollout, group_advantages([0.1, 0.9, 0.4, 0.2, 0.3, 0.8], rollout.group_ids))


def test_the_updates_order_derives_from_the_runs_seed(run):
    config, adapter, rollout = run

    def order(seed: int) -> list[list[int]]:
        updater = Updater(SGDEngine(adapter.transformer, 2), adapter, config.update, config.trust_region, seed=seed)
        return [
            [*t.samples.tolist(), *torch.as_tensor(t.step).flatten().tolist()] for t in updater._transitions(rollout)
        ]

    orders = {seed: order(seed) for seed in range(6)}
    assert order(3) == orders[3]  # reproducible: a resumed run repeats it
    assert len({str(o) for o in orders.values()}) > 1  # and the seed decides it
