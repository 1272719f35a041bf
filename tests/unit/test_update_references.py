"""What an optimizer update measures against: its KL references (the anchor's and the lagged policy's means), computed
before its first backward with each reference swapped in once, must be the ones each micro-step would have computed at
its own turn; and the KL gradient ratio is measured on a micro-step whose policy term has a gradient."""

import pytest
import torch

import stages.update as update_module
from core.grpo import group_advantages
from stages.anchor import Anchor
from stages.rollout import SDEConfig, generate, score_transition
from stages.update import TrustRegionConfig, UpdateConfig, Updater
from tests.helpers import LinearAdapter

pytestmark = pytest.mark.unit


class SGDEngine(torch.nn.Module):
    """DeepSpeed's engine contract as the Updater uses it: gradients accumulate over the micro-steps of an update and
    the optimizer applies at its boundary."""

    def __init__(self, module, accumulation: int):
        super().__init__()
        self.module, self.accumulation, self.micro_steps = module, accumulation, 0
        self.optimizer = torch.optim.SGD(module.parameters(), lr=0.5)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def gradient_accumulation_steps(self):
        return self.accumulation

    def backward(self, loss):
        (loss / self.accumulation).backward()

    def step(self):
        self.micro_steps += 1
        if self.micro_steps % self.accumulation == 0:
            self.optimizer.step()
            self.optimizer.zero_grad()

    def was_step_applied(self):
        return True

    def get_global_grad_norm(self):
        return None

    def zero_optimization_stage(self):
        return 0


def test_each_micro_step_uses_its_updates_references_swapped_in_once_per_update(monkeypatch):
    adapter = LinearAdapter()
    config = SDEConfig(variant="sage", eta=0.7, steps=3, shift=3.0)
    rollout = generate(adapter, ["a", "b"], 2, config, seed=0, batch_size=2, decode=False, progress=False)
    micro_steps = len(rollout.batches) * int(rollout.trained_steps.sum())  # 2 chunks x 2 trained steps
    engine = SGDEngine(adapter.transformer, accumulation=micro_steps // 2)
    trust = TrustRegionConfig(anchor_interval=1, kl_grad_ratio_every=0)  # the anchor moves between the two updates
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


def test_the_kl_gradient_ratio_skips_a_micro_step_without_policy_gradient():
    """Under ZeRO-3 the ratio is measured on an update's first micro-step; when that one's policy term has no
    gradient (its group's rewards are equal, so its advantages are 0) the next one is measured instead of logging
    NaN. The fake engine reports stage 3 so the measurement runs; it has no DeepSpeed hooks to hold back."""
    adapter = LinearAdapter()
    config = SDEConfig(variant="sage", eta=0.7, steps=3, shift=3.0)
    rollout = generate(adapter, ["a", "b"], 2, config, seed=0, batch_size=2, decode=False, progress=False)
    micro_steps = len(rollout.batches) * int(rollout.trained_steps.sum())
    engine = SGDEngine(adapter.transformer, accumulation=micro_steps)
    engine.zero_optimization_stage = lambda: 3
    updater = Updater(engine, adapter, UpdateConfig(micro_batch_size=2), TrustRegionConfig(kl_grad_ratio_every=1))
    first = updater.update(rollout, group_advantages([0.1, 0.9, 0.4, 0.2], rollout.group_ids))
    assert first["kl_grad_ratio"] == 0.0  # the first update starts at the anchor and the lagged policy: no KL gradient

    # The second update's first micro-step trains on a chunk (one prompt's group) whose rewards are equal.
    silent = updater._transitions(rollout)[0].samples
    rewards = [0.5 if i in silent.tolist() else r for i, r in enumerate([0.1, 0.9, 0.4, 0.2])]
    assert len(silent) == 2 and rewards.count(0.5) == 2
    measured = []
    norms = update_module.gradient_norms

    def recorded(*args):
        measured.append(norms(*args))
        return measured[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(update_module, "gradient_norms", recorded)
        second = updater.update(rollout, group_advantages(rewards, rollout.group_ids))
    assert measured[0].policy == 0 and measured[0].kl > 0 and measured[0].policy_term_silent
    assert measured[-1].policy > 0 and 1 < len(measured) <= update_module.RATIO_ATTEMPTS
    assert second["kl_grad_ratio"] == measured[-1].kl / measured[-1].policy > 0
