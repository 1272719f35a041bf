"""Model FLOPs and MFU against closed forms."""

import pytest

from sage_grpo.core import flops
from sage_grpo.core.models.tiny import tiny_hunyuan15
from sage_grpo.stages.update import model_forward_flops

pytestmark = pytest.mark.unit


def test_forward_flops_are_two_per_weight_plus_attention():
    # 1M weights, 2 layers of width 64, 100 tokens: 2e6 + 4 * 2 * 100 * 64.
    assert flops.forward_flops_per_token(1_000_000, 2, 64, 100) == 2_000_000 + 51_200


def test_mfu_and_peaks():
    assert flops.mfu(989e12 * 2, 4.0, 989e12) == pytest.approx(0.5)
    assert flops.mfu(1e15, 1.0, 1e15, devices=4) == pytest.approx(0.25)
    assert flops.peak_flops("NVIDIA H200") == 989e12 and flops.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert flops.peak_flops("cpu") is None
    with pytest.raises(ValueError):
        flops.mfu(1.0, 0.0, 1e12)


@pytest.mark.parametrize("guidance", [1.0, 6.0])
def test_a_transformer_call_counts_its_video_tokens_and_weights(guidance):
    adapter = tiny_hunyuan15(guidance_scale=guidance)
    module = adapter.transformer
    tokens = 3 * 8 * 8  # latent frames x height x width, patch 1
    weights = sum(p.numel() for p in module.parameters())
    per_token = 2 * weights + 4 * 1 * tokens * 16  # 1 layer, 2 heads x 8
    assert model_forward_flops(module, adapter) == (2 if guidance > 1 else 1) * tokens * per_token


def test_hidden_size_reads_the_width_or_heads_times_head_dim_from_the_config():
    class Configured:
        def __init__(self, **config):
            self.config = config

    assert flops.hidden_size(Configured(hidden_size=3072)) == 3072
    assert flops.hidden_size(Configured(num_attention_heads=24, attention_head_dim=128)) == 3072
    assert flops.hidden_size(Configured()) is None


@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_sequence_parallel_rank_is_credited_with_1_over_k_of_its_groups_flops(monkeypatch, k):
    # Every rank of a group of K counts its samples' FLOPs whole (iteration_flops); each did 1/K of them.
    from types import SimpleNamespace

    import torch

    from sage_grpo.core.distributed import ParallelLayout
    from sage_grpo.stages.update import Updater

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    updater = SimpleNamespace(iteration_flops=lambda rollout: 989e12, parallel=ParallelLayout(k, k))
    assert Updater.mfu(updater, rollout=None, seconds=1.0) == pytest.approx(1 / k)
