"""What an optimizer update measures against: its KL references (the anchor's and the lagged policy's means), computed
before its first backward with each reference swapped in once, must be the ones each micro-step would have computed at
its own turn."""

import pytest
import torch

from sage_grpo.core.grpo import group_advantages
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.anchor import Anchor
from sage_grpo.stages.rollout import SDEConfig, generate, score_transition
from sage_grpo.stages.update import UpdateConfig, Updater
from tests.helpers import LinearAdapter, SGDEngine

pytestmark = pytest.mark.unit


def test_each_micro_step_uses_its_updates_references_swapped_in_once_per_update(monkeypatch):
    adapter = LinearAdapter()
    config = SDEConfig(variant="sage", eta=0.7, steps=3, shift=3.0)
    rollout = generate(adapter, ["a", "b"], 2, config, seed=0, batch_size=2, decode=False, progress=False)
    micro_steps = len(rollout.batches) * int(rollout.trained_steps.sum())  # 2 chunks x 2 trained steps
    engine = SGDEngine(adapter.transformer, accumulation=micro_steps // 2)
    trust = TrustRegionConfig(strategy="dual", anchor_interval=1)  # the anchor moves between the two updates
    updater = Updater(engine, adapter, UpdateConfig(micro_batch_size=2, updates_per_rollout=2), trust)
    references = {"anchor_mean": updater.anchor, "lagged_mean": updater.lagged}

    transitions = updater._transitions(rollout)  # the update's order (seeded by the update count, here 0)
    at_start = dict(zip(map(_key, transitions), updater._reference_means(rollout, transitions)))
    swaps, checking = [], []
    swapped_in = Anchor.swapped_in

    def counted(self):
        if not checking:
            swaps.append(next(name for name, copy in references.items() if copy is self))
        return swapped_in(self)

    monkeypatch.setattr(Anchor, "swapped_in", counted)
    used, current = [], []
    micro_step = updater._micro_step

    def at_its_turn(rollout, advantages, weights, transition, given):
        """The references as this micro-step would compute them now, through the engine, one swap each."""
        checking.append(True)
        for name, copy in references.items():
            with torch.no_grad(), copy.swapped_in():
                mean = score_transition(adapter, rollout, transition.samples, transition.step, module=engine).mean
            current.append(torch.equal(given[name], mean))
            used.append(torch.equal(at_start[_key(transition)][name], mean))
        checking.pop()
        return micro_step(rollout, advantages, weights, transition, given)

    monkeypatch.setattr(updater, "_micro_step", at_its_turn)
    metrics = updater.update(rollout, group_advantages([0.1, 0.9, 0.4, 0.2], rollout.group_ids))

    assert metrics["updates_done"] == 2 and len(current) == 2 * micro_steps
    assert all(current)  # every micro-step trained against the references of its own update
    # Each reference swapped in once per update (it was twice per micro-step); the update order is staged, then both.
    assert swaps == ["anchor_mean", "lagged_mean"] * 2
    # The test can fail: the second update's anchor means differ from those before the first update (the anchor was
    # refreshed in between), so references computed once for the whole rollout would be caught.
    assert all(used[:4]) and not all(used[4:])


def _key(transition) -> tuple:
    return tuple(transition.samples.tolist()), transition.step
