"""``update/kl_grad_ratio/weight_space``: the trust region's strength on the trainable weights' gradients (what the
optimizer steps on), against a brute-force gradient of the whole update with respect to the weights; measuring it
leaves training bit for bit unchanged, and partitioned (ZeRO-3) weights are refused in one line."""

import math

import pytest
import torch

from sage_grpo.core.errors import UserError
from sage_grpo.core.trust_region import TrustRegionConfig, WeightGradients
from tests.helpers import LinearAdapter
from tests.unit.test_trust_region_strength import _advantages, _rollout, _updater

pytestmark = pytest.mark.unit


def _trained(measure: bool):
    adapter = LinearAdapter()
    trust = TrustRegionConfig(strategy="dual", anchor_interval=10, measure_weight_space=measure)
    updater = _updater(adapter, trust)
    metrics = [updater.update(_rollout(adapter, seed), _advantages(_rollout(adapter, seed))) for seed in range(2)]
    return adapter, updater, metrics


def _brute_force_ratio(updater, rollout, advantages) -> float:
    params = [p for p in updater.engine.module.parameters() if p.requires_grad]
    policy, kl = 0.0, 0.0
    for terms in updater.losses(rollout, advantages):
        policy, kl = policy + terms.policy, kl + terms.kl

    def norm(value) -> float:
        grads = torch.autograd.grad(value, params, retain_graph=True)
        return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))

    return updater.controller.value * norm(kl) / norm(policy)


def test_the_weight_space_ratio_equals_a_brute_force_gradient_of_the_whole_update():
    adapter, updater, metrics = _trained(measure=True)
    assert "kl_grad_ratio/weight_space" not in metrics[0]  # update 1 starts at its references: not measured
    rollout = _rollout(adapter, 2)
    advantages = _advantages(rollout)
    expected = _brute_force_ratio(updater, rollout, advantages)
    measured = updater.update(rollout, advantages)
    assert measured["kl_grad_ratio/weight_space"] == pytest.approx(expected, rel=1e-5)
    # A quantity of its own: the output-space ratio of the same update differs.
    assert measured["kl_grad_ratio"] != pytest.approx(expected, rel=1e-2)


def test_measuring_in_weight_space_leaves_training_unchanged():
    measured, _, with_metrics = _trained(measure=True)
    plain, _, without_metrics = _trained(measure=False)
    assert torch.equal(measured.transformer.weight, plain.transformer.weight)
    assert "kl_grad_ratio/weight_space" in with_metrics[1] and "kl_grad_ratio/weight_space" not in without_metrics[1]
    assert with_metrics[1]["kl_grad_ratio"] == without_metrics[1]["kl_grad_ratio"]


def test_partitioned_weights_are_refused():
    module = torch.nn.Linear(2, 2)
    module.weight.ds_tensor = torch.empty(0)  # what ZeRO-3 leaves on each parameter
    with pytest.raises(UserError, match="ZeRO-3 partitions them"):
        WeightGradients(module)
