"""The velocity KL's lagged reference read from the rollout's recorded means when the lagged policy is the rollout's
weights: on the tiny HunyuanVideo 1.5 the update trains exactly as with the lagged policy's own forward, with one
transformer forward fewer per micro-step on those updates."""

import dataclasses

import pytest
import torch

from sage_grpo.core.grpo import group_advantages
from sage_grpo.core.models.tiny import tiny_hunyuan15
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.rollout import SDEConfig, generate
from sage_grpo.stages.update import UpdateConfig, Updater
from tests.helpers import SGDEngine

pytestmark = pytest.mark.unit

SDE = SDEConfig(variant="sage", eta=0.7, steps=3, shift=3.0, final_step="deterministic")  # 2 trained steps
MICRO_STEPS = 2  # per update: 2 chunks of 2 samples x 2 trained steps, over 2 updates per rollout


@pytest.fixture(scope="module")
def adapter():
    """The tiny model, built once (its pipeline takes most of the test's time); each run restores its weights."""
    adapter = tiny_hunyuan15(seed=0)
    adapter.transformer.requires_grad_(True)
    return adapter


def _train(adapter, initial: dict, *, record_means: bool, iterations: int = 2):
    """The tiny model trained from ``initial`` with the paper's dual KL and two optimizer updates per rollout: per
    update, its micro-steps' (loss, velocity KL) and its transformer forwards; and the weights at the end."""
    adapter.transformer.load_state_dict(initial)
    engine = SGDEngine(adapter.transformer, accumulation=MICRO_STEPS)
    trust = TrustRegionConfig(strategy="dual", kl_initial=10.0, kl_maximum=10.0)
    updater = Updater(engine, adapter, UpdateConfig(micro_batch_size=2, updates_per_rollout=2), trust)
    forwards, losses, per_update = [], [], []
    hook = adapter.transformer.register_forward_hook(lambda *_: forwards.append(1))
    each_update = updater.losses

    def recorded(*args, **kwargs):  # one call per optimizer update: its reference forwards, then its micro-steps
        start, update_losses = len(forwards), []
        for terms in each_update(*args, **kwargs):
            update_losses.append(torch.stack([terms.loss.detach(), terms.velocity_kl.detach()]))
            yield terms
        losses.append(torch.stack(update_losses))
        per_update.append(len(forwards) - start)

    updater.losses = recorded
    for iteration in range(iterations):
        assert updater.reads_rollout_means  # the second update of every rollout starts from the rollout's weights
        rollout = generate(
            adapter, ["a", "b"], 2, SDE, seed=iteration, batch_size=2, decode=False, progress=False, record_means=True
        )
        if not record_means:
            rollout = dataclasses.replace(rollout, means=None)
        updater.update(rollout, group_advantages([0.1, 0.9, 0.4, 0.2], rollout.group_ids))
    hook.remove()
    return losses, per_update, [p.detach().clone() for p in adapter.transformer.parameters()], updater


def test_lagged_reference_from_the_rollouts_means_trains_as_its_forward_with_one_forward_fewer(adapter):
    initial = {name: value.clone() for name, value in adapter.transformer.state_dict().items()}
    read, read_forwards, read_weights, updater = _train(adapter, initial, record_means=True)
    forwarded, forwarded_forwards, forwarded_weights, _ = _train(adapter, initial, record_means=False)

    # Every micro-step runs the policy's and the anchor's forward, and the lagged policy's unless it is read.
    assert forwarded_forwards == [3 * MICRO_STEPS] * 4
    # Read on the run's first update (the lagged copy is the initial weights), then on each rollout's second update
    # (its lagged policy is the first update's starting weights, the rollout's); the second rollout's first update
    # has the previous update's starting weights as its lagged policy, which the rollout did not record.
    assert read_forwards == [2 * MICRO_STEPS, 2 * MICRO_STEPS, 3 * MICRO_STEPS, 2 * MICRO_STEPS]
    assert updater.lagged_forward_share == 0.5
    # The same weights and the same batches through the same kernels: the recorded means are the lagged forward's
    # bit for bit on CPU in float32, so the losses and the trained weights are equal exactly, not to a tolerance.
    for a, b in zip(read, forwarded):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(read_weights, forwarded_weights))
    # The test can fail: on each rollout's second update the policy has moved one step from the rollout's weights, so
    # the velocity KL to them is not 0 (a reference read from the wrong means, e.g. the current policy's, would be).
    assert all(update[:, 1].min() > 0 for update in read[1::2])


def test_the_plan_counts_the_lagged_forwards_it_saves_and_the_means_it_keeps():
    from sage_grpo.pipeline import memory_plan, phase_plan
    from sage_grpo.pipeline.config import load_run_config
    from tests.helpers import REPO

    shipped = REPO / "configs" / "hunyuanvideo15_sage_lora.yaml"  # the paper's dual KL: anchor and lagged policy
    plans = {}
    for updates in (1, 2):
        config = load_run_config(shipped, [f"update.updates_per_rollout={updates}"])
        plans[updates] = (phase_plan._reference_count(config), memory_plan.plan_for(config, 8, 1, 80).workload)
    # Per trained transition: the anchor's forward, and the lagged policy's on every update but the one of U that
    # reads the rollout's means.
    assert plans[1][0] == 2 and plans[2][0] == 1.5
    # The rollout then keeps every step's mean beside the latents before and after every step: 20 + 21 for 21.
    steps = 20
    assert plans[2][1].rollout * (steps + 1) == plans[1][1].rollout * (2 * steps + 1)
