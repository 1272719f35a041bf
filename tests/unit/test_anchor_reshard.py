"""A run resumed on another number of ranks re-partitions the anchor's per-rank ZeRO-3 shards exactly (and takes
rank 0's whole values without ZeRO-3); parameters stand in for ZeRO-3 ones with DeepSpeed's two attributes."""

from __future__ import annotations

import pytest
import torch

from sage_grpo.stages.anchor import Anchor

pytestmark = pytest.mark.unit


def _zero3_params(weights: list[torch.Tensor], rank: int, world: int) -> list[torch.nn.Parameter]:
    """What ZeRO-3 leaves on ``rank``: ceil(numel / world) flat values per parameter, the last rank zero-padded."""
    params = []
    for weight in weights:
        size = -(-weight.numel() // world)
        padded = torch.nn.functional.pad(weight.flatten(), (0, size * world - weight.numel()))
        param = torch.nn.Parameter(torch.empty(0))
        param.ds_tensor, param.ds_numel = padded.narrow(0, rank * size, size).clone(), weight.numel()
        params.append(param)
    return params


def _saved_on(weights: list[torch.Tensor], world: int, refreshes: int) -> list[dict]:
    states = []
    for rank in range(world):
        anchor = Anchor(_zero3_params(weights, rank, world))
        anchor.refreshes = refreshes
        states.append(anchor.state_dict())
    return states


@pytest.mark.parametrize(("old_world", "new_world"), [(2, 1), (1, 2), (3, 2), (2, 3)])
def test_zero3_shards_are_repartitioned_for_the_new_world_size(old_world, new_world):
    torch.manual_seed(0)
    anchor_weights = [torch.randn(5), torch.randn(2, 3), torch.randn(1)]
    states = _saved_on(anchor_weights, old_world, refreshes=4)
    policy = [torch.randn_like(weight) for weight in anchor_weights]  # what the resumed job's policy holds

    for rank in range(new_world):
        anchor = Anchor(_zero3_params(policy, rank, new_world))
        anchor.load_resharded_state_dict(states, rank, new_world)
        expected = [param.ds_tensor for param in _zero3_params(anchor_weights, rank, new_world)]
        assert anchor.refreshes == 4
        for held, wanted in zip(anchor.state_dict()["values"], expected):
            assert torch.equal(held, wanted)


def test_whole_values_without_zero3_are_taken_from_rank_0():
    module = torch.nn.Linear(3, 2)
    saved = Anchor.snapshot(module).state_dict()
    anchor = Anchor.snapshot(torch.nn.Linear(3, 2))
    anchor.load_resharded_state_dict([saved, saved], rank=0, world=1)
    assert all(torch.equal(a, b) for a, b in zip(anchor.state_dict()["values"], saved["values"]))


def test_a_checkpoint_of_other_parameters_is_refused():
    states = _saved_on([torch.randn(4)], world=2, refreshes=0)
    anchor = Anchor(_zero3_params([torch.randn(4), torch.randn(2)], 0, 1))
    with pytest.raises(ValueError, match="does not match"):
        anchor.load_resharded_state_dict(states, 0, 1)
