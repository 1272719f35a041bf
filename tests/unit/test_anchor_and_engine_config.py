"""The anchor's swap/refresh logic on a plain module, the update's accumulation and throughput options, and ZeRO-3's
leaf modules. DeepSpeed's JSON is tested in test_deepspeed_json.py."""

import pytest
import torch

from sage_grpo.stages.anchor import Anchor
from sage_grpo.stages.update import UpdateConfig

pytestmark = pytest.mark.unit


def _module():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    module[0].requires_grad_(False)  # a frozen "base" layer, as under LoRA
    return module


@pytest.mark.parametrize("offload", [False, True], ids=["storage-swap", "value-swap"])
def test_anchor_swaps_in_its_weights_and_restores_the_policy(offload):
    module = _module()
    x = torch.randn(5, 3)
    anchor = Anchor.snapshot(module, offload=offload)
    storage = module[1].weight.data_ptr()
    initial_output = module(x).detach()
    with torch.no_grad():
        module[1].weight.add_(1.0)
    moved_output = module(x).detach()
    with anchor.swapped_in():
        torch.testing.assert_close(module(x), initial_output, rtol=0, atol=0)
    torch.testing.assert_close(module(x).detach(), moved_output, rtol=0, atol=0)
    assert module[1].weight.data_ptr() == storage  # the optimizer's tensor is back in place


def test_anchor_covers_only_trainable_parameters_and_refresh_copies_them():
    module = _module()
    anchor = Anchor.snapshot(module)
    assert len(anchor.params) == 2  # weight and bias of the trainable layer only
    with torch.no_grad():
        module[1].bias.add_(2.0)
    anchor.refresh()
    refreshed_bias = module[1].bias.detach().clone()
    with torch.no_grad():
        module[1].bias.add_(5.0)
    with anchor.swapped_in():
        assert torch.equal(module[1].bias, refreshed_bias)
    state = anchor.state_dict()
    restored = Anchor.snapshot(_module())
    restored.load_state_dict(state)
    assert restored.refreshes == 1
    assert torch.equal(restored._saved[1], refreshed_bias)


@pytest.mark.parametrize("offload", [False, True], ids=["storage-swap", "value-swap"])
def test_lagged_copy_commits_the_staged_weights_and_keeps_the_old_ones_until_then(offload):
    module = _module()
    lagged = Anchor.snapshot(module, offload=offload)
    start = module[1].weight.detach().clone()

    def step():
        with torch.no_grad():
            module[1].weight.add_(1.0)

    step()
    lagged.stage()  # the update's starting weights, start + 1
    step()  # ... applied
    with lagged.swapped_in():
        assert torch.equal(module[1].weight, start)  # until commit, the reference stays where it was
    lagged.commit()
    with lagged.swapped_in():
        assert torch.equal(module[1].weight, start + 1.0)  # one update behind the policy (start + 2)
    lagged.stage()
    step()  # ... skipped: no commit, the reference stays one applied update behind
    restored = Anchor.snapshot(_module(), offload=offload)
    restored.load_state_dict(lagged.state_dict())
    assert torch.equal(restored._saved[0], start + 1.0) and restored.refreshes == 1


def test_anchor_rejects_a_checkpoint_of_other_shapes():
    anchor = Anchor.snapshot(_module())
    with pytest.raises(ValueError, match="shapes"):
        anchor.load_state_dict({"refreshes": 0, "values": [torch.zeros(1), torch.zeros(1)]})


def test_accumulation_counts_micro_steps_per_update():
    assert UpdateConfig(micro_batch_size=2).accumulation_steps(8, 19) == 76
    with pytest.raises(ValueError, match="micro_batch_size=2 does not divide the 3 samples"):
        UpdateConfig(micro_batch_size=2).accumulation_steps(3, 19)


def test_accumulation_divides_the_rollout_into_equal_mini_batches_of_batched_transitions():
    # 8 samples, micro batch 2 -> 4 chunks x 6 steps = 24 transitions; 2 per forward, 3 updates: 4 micro-steps each.
    config = UpdateConfig(micro_batch_size=2, updates_per_rollout=3, transitions_per_micro_step=2)
    assert config.accumulation_steps(8, 6) == 4
    with pytest.raises(ValueError, match="updates_per_rollout=5"):
        UpdateConfig(micro_batch_size=2, updates_per_rollout=5).accumulation_steps(8, 6)
    with pytest.raises(ValueError, match="transitions_per_micro_step=5"):
        UpdateConfig(micro_batch_size=2, transitions_per_micro_step=5).accumulation_steps(8, 6)


@pytest.mark.parametrize(
    "key, value",
    [
        ("updates_per_rollout", 0),
        ("transitions_per_micro_step", 0),
        ("ema_decay", 1.0),
        ("ema_decay", 0.0),
        ("ema_decay", float("nan")),
    ],
)
def test_throughput_options_out_of_range_are_refused(key, value):
    with pytest.raises(ValueError, match=key):
        UpdateConfig(**{key: value})


def test_a_float32_ema_of_bf16_weights_moves_and_swaps_in_without_rounding_itself():
    module = torch.nn.Linear(4, 4).to(torch.bfloat16)
    ema = Anchor.snapshot(module, dtype=torch.float32)
    start = module.weight.detach().float().clone()
    with torch.no_grad():
        module.weight.add_(1.0)
    for _ in range(3):
        ema.blend(0.999)
    expected = start + (1 - 0.999**3) * (module.weight.detach().float() - start)
    torch.testing.assert_close(ema._saved[0], expected, rtol=0, atol=1e-6)  # a bf16 EMA would not have moved
    policy, held = module.weight.detach().clone(), ema._saved[0].clone()
    with ema.swapped_in():
        assert torch.equal(module.weight, held.to(torch.bfloat16))
    assert torch.equal(module.weight, policy)  # the policy is back exactly
    assert torch.equal(ema._saved[0], held)  # and the float32 average was not rounded to bf16 by the swap


def test_zero3_leaves_are_the_outermost_modules_of_the_named_classes():
    from sage_grpo.core.errors import UserError
    from sage_grpo.core.models.tiny import tiny_hunyuan15
    from sage_grpo.stages.engine import zero3_leaves

    transformer = tiny_hunyuan15(seed=0).transformer
    auto = [type(m).__name__ for m in zero3_leaves(transformer, "auto")]
    assert auto.count("HunyuanVideo15TransformerBlock") == len(transformer.transformer_blocks)
    assert auto.count("HunyuanVideo15TokenRefiner") == auto.count("HunyuanVideo15PatchEmbed") == 1
    # The rest is grouped into its largest parts without a block: left outside any leaf, each hooked on its own,
    # are only the root, the list of blocks and single layers.
    leaves = zero3_leaves(transformer, "auto")
    assert transformer.time_embed in leaves and transformer.norm_out in leaves
    inside = {id(m) for leaf in leaves for m in leaf.modules()}
    outside = [m for m in transformer.modules() if id(m) not in inside]
    assert {type(m).__name__ for m in outside if next(m.children(), None) is not None} == {
        "HunyuanVideo15Transformer3DModel",
        "ModuleList",
    }
    # A named class inside a leaf is gathered with it, not made a leaf of its own.
    nested = zero3_leaves(transformer, ["HunyuanVideo15TokenRefiner", "HunyuanVideo15IndividualTokenRefinerBlock"])
    assert nested == [transformer.context_embedder]
    assert zero3_leaves(transformer, ["HunyuanVideo15TransformerBlock"]) == list(transformer.transformer_blocks)
    assert zero3_leaves(transformer, []) == []
    assert zero3_leaves(_module(), "auto") == []  # no _no_split_modules: ZeRO-3's per-module hooks
    with pytest.raises(UserError, match="no module of class TransformerBlock "):
        zero3_leaves(transformer, ["TransformerBlock"])
