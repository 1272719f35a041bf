"""The rollout and the update's loss path with the model on a device that is not the CPU.

torch's ``meta`` device enforces the same rule as CUDA (only 0-dim CPU tensors may mix with device tensors), so these
tests catch, without a GPU, a CPU tensor reaching the loss: ``group_advantages`` builds its tensors on the CPU."""

import pytest
import torch

from sage_grpo.core.grpo import group_advantages
from sage_grpo.core.trust_region import TrustRegionConfig
from sage_grpo.stages.rollout import SDEConfig, generate
from sage_grpo.stages.update import UpdateConfig, Updater
from tests.helpers import LinearAdapter

pytestmark = pytest.mark.unit

META = torch.device("meta")


class FakeEngine(torch.nn.Module):
    """What Updater needs of a DeepSpeed engine; the meta tensors cannot go through DeepSpeed's own step."""

    def __init__(self, module, accumulation):
        super().__init__()
        self.module, self.accumulation = module, accumulation

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def gradient_accumulation_steps(self):
        return self.accumulation


@pytest.fixture(scope="module")
def meta_rollout():
    adapter = LinearAdapter(META)
    config = SDEConfig(variant="sage", eta=0.7, steps=3, shift=3.0)
    rollout = generate(adapter, ["a", "b"], 2, config, seed=0, batch_size=2, decode=False, progress=False)
    return adapter, rollout


def test_the_rollout_runs_with_the_model_on_another_device(meta_rollout):
    _, rollout = meta_rollout
    assert rollout.latents.device == META and rollout.log_probs.device == META
    assert rollout.trained_steps.tolist() == [True, True, True]


@pytest.mark.parametrize("strategy", ["dual", "fixed", "none"])
def test_the_update_loss_path_runs_with_the_model_on_another_device(meta_rollout, strategy):
    adapter, rollout = meta_rollout
    steps = int(rollout.trained_steps.sum())
    engine = FakeEngine(adapter.transformer, accumulation=len(rollout.batches) * steps)
    updater = Updater(engine, adapter, UpdateConfig(micro_batch_size=2), TrustRegionConfig(strategy=strategy))
    advantages = group_advantages([0.1, 0.9, 0.4, 0.2], rollout.group_ids)  # CPU, as the recipe passes them
    assert advantages.values.device.type == "cpu"
    terms = list(updater.losses(rollout, advantages))
    assert len(terms) == engine.accumulation
    for term in terms:
        assert term.loss.device == META and term.loss.ndim == 0
        term.loss.backward()  # the backward mixes devices too if anything upstream did
    assert adapter.transformer.weight.grad.device == META
