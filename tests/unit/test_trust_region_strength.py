"""How strong the trust region is, and lambda steered by it: ``update/kl_grad_ratio`` (the update-level ratio of the
KL's and the policy term's gradients on the model's output, in total and per term) against a brute-force gradient of
the whole update, never measured on an update whose KL reference was just refreshed, and the ``calibrated``
controller bringing a badly started lambda to its target and holding it there."""

import math

import pytest
import torch

from sage_grpo.core.grpo import group_advantages
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.rollout import SDEConfig, generate
from sage_grpo.stages.update import UpdateConfig, Updater
from tests.helpers import LinearAdapter, SGDEngine

pytestmark = pytest.mark.unit

SDE = SDEConfig(variant="sage", eta=0.7, steps=3, shift=3.0)
PROMPTS = ["a", "b"]
GROUP = 2


def _updater(adapter, trust: TrustRegionConfig, lr: float = 0.5) -> Updater:
    rollout = _rollout(adapter, 0)
    engine = SGDEngine(adapter.transformer, accumulation=len(rollout.batches) * int(rollout.trained_steps.sum()))
    engine.optimizer = torch.optim.SGD(adapter.transformer.parameters(), lr=lr)
    return Updater(engine, adapter, UpdateConfig(micro_batch_size=GROUP), trust)


def _rollout(adapter, seed: int):
    with torch.no_grad():
        return generate(adapter, PROMPTS, GROUP, SDE, seed=seed, batch_size=GROUP, decode=False, progress=False)


def _advantages(rollout):
    # A reward that prefers bright final latents: a direction the one-layer model can learn, so the policy moves.
    rewards = rollout.latents[:, -1].flatten(1).mean(1)
    return group_advantages(rewards, rollout.group_ids)


def _brute_force_ratios(updater: Updater, rollout, advantages) -> dict[str, float]:
    """The whole update's loss terms summed over its micro-steps and differentiated at once with respect to every
    micro-step's output: |lambda w grad term| / |grad policy| as one gradient, not a sum of per-micro-step norms."""
    outputs, sums = [], {"policy": 0.0, "position": 0.0, "velocity": 0.0}
    for terms in updater.losses(rollout, advantages):
        outputs.append(terms.output)
        sums["policy"] = sums["policy"] + terms.policy
        sums["position"] = sums["position"] + terms.position_kl
        sums["velocity"] = sums["velocity"] + terms.velocity_kl
    trust, weight = updater.trust, updater.controller.value
    sums["kl"] = trust.position_weight * sums["position"] + trust.stepwise_weight * sums["velocity"]

    def norm(value) -> float:
        grads = torch.autograd.grad(value, outputs, retain_graph=True, allow_unused=True)
        return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))

    policy = norm(sums["policy"])
    return {
        "kl_grad_ratio": weight * norm(sums["kl"]) / policy,
        "kl_grad_ratio/position": weight * trust.position_weight * norm(sums["position"]) / policy,
        "kl_grad_ratio/velocity": weight * trust.stepwise_weight * norm(sums["velocity"]) / policy,
    }


def test_the_update_level_ratio_equals_a_brute_force_gradient_of_the_whole_update():
    adapter = LinearAdapter()
    updater = _updater(adapter, TrustRegionConfig(strategy="dual", anchor_interval=10))
    first = updater.update(_rollout(adapter, 0), _advantages(_rollout(adapter, 0)))
    assert "kl_grad_ratio" not in first  # both references start as the policy: nothing to measure
    # On update 2 both references are still the initial policy; from update 3 the lagged one is a step behind.
    updater.update(_rollout(adapter, 1), _advantages(_rollout(adapter, 1)))

    rollout = _rollout(adapter, 2)
    advantages = _advantages(rollout)
    expected = _brute_force_ratios(updater, rollout, advantages)
    measured = updater.update(rollout, advantages)
    for key, value in expected.items():
        assert measured[key] == pytest.approx(value, rel=1e-5), key
    # Both terms act, and the total is not the sum of the parts (their gradients are not parallel): a measurement
    # that reported one term for both, or added norms, would fail here.
    assert measured["kl_grad_ratio/position"] > 0 and measured["kl_grad_ratio/velocity"] > 0
    assert measured["kl_grad_ratio"] < measured["kl_grad_ratio/position"] + measured["kl_grad_ratio/velocity"]


@pytest.mark.parametrize("strategy", ["dual", "moving", "fixed", "step_wise"])
def test_an_update_whose_reference_was_just_refreshed_is_not_measured(strategy):
    adapter = LinearAdapter()
    updater = _updater(adapter, TrustRegionConfig(strategy=strategy, anchor_interval=2, kl_feedback="gradient_ratio"))
    measured, weights = [], []
    for seed in range(6):
        rollout = _rollout(adapter, seed)
        metrics = updater.update(rollout, _advantages(rollout))
        measured.append("kl_grad_ratio" in metrics)
        weights.append((metrics["lambda_kl"], updater.controller.value))  # trained with, and set for the next
        if measured[-1]:
            ratios = [metrics[k] for k in ("kl_grad_ratio", "kl_grad_ratio/position", "kl_grad_ratio/velocity")]
            assert all(math.isfinite(r) for r in ratios) and metrics["kl_grad_ratio"] > 0
    # Update 1 starts at every reference; a moving anchor refreshed after updates 2 and 4 makes updates 3 and 5 start
    # at it. The lagged policy (velocity) and a fixed anchor are never the policy again after the first update.
    refreshes = {"dual": [2, 4], "moving": [2, 4], "fixed": [], "step_wise": []}[strategy]
    assert measured == [u > 1 and u - 1 not in refreshes for u in range(1, 7)]
    # lambda stands still over an unmeasured update and moves after a measured one.
    for was_measured, (before, after) in zip(measured, weights):
        assert (before == after) != was_measured


def test_the_calibrated_controller_brings_a_wrong_lambda_to_its_target_and_holds_it():
    """Started ~30x too strong, lambda must come down to where the measured ratio sits within [0.5, 2] x target on at
    least 70% of the updates after the first measurement, and move both ways on the way (a lambda that never moved
    would leave every ratio ~100x its target)."""
    adapter = LinearAdapter()
    target = 0.005
    trust = TrustRegionConfig(anchor_interval=3, kl_initial=100.0, kl_ratio_target=target)
    updater = _updater(adapter, trust, lr=0.05)
    ratios, weights = [], [updater.controller.value]
    for seed in range(30):
        rollout = _rollout(adapter, seed)
        metrics = updater.update(rollout, _advantages(rollout))
        ratios.append(metrics.get("kl_grad_ratio"))
        weights.append(metrics["lambda_kl"])
    observed = [r for r in ratios if r is not None]
    assert observed[0] > 10 * target  # where it started: lambda 100, ~30x too strong
    after_warmup = observed[1:]
    inside = [0.5 * target <= r <= 2 * target for r in after_warmup]
    assert sum(inside) >= 0.7 * len(after_warmup), after_warmup
    steps = [b / a for a, b in zip(weights, weights[1:]) if a != b]
    assert any(s < 1 for s in steps) and any(s > 1 for s in steps), weights
    assert trust.kl_minimum <= min(weights) and max(weights) <= trust.kl_maximum
