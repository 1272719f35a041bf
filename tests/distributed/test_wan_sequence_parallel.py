"""Sequence parallelism on both experts of a tiny two-expert Wan 2.2, under real DeepSpeed ZeRO-3 with gloo on CPU:
K = 2 on 2 processes computes what K = 1 on one process does (a velocity batch that mixes both experts, the rollout,
the first update's gradients of both experts and the weights after two updates); ``sequence_parallel_worker.py``."""

import pytest
import torch

from tests.distributed.test_sequence_parallel import Comparison, run_both

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(3600)]


def test_k2_equals_k1_on_both_experts(tmp_path):
    runs = run_both(Comparison("wan22"), tmp_path)
    single, split = runs.reports()
    assert split["block_tokens"] == [single["video_tokens"] // 2]  # the low-noise expert's tokens are split too
    outputs = runs.load("outputs")
    for name in ("velocity", "latents", "log_probs"):
        torch.testing.assert_close(outputs[1][name], outputs[0][name], rtol=1e-5, atol=1e-5, msg=name)
    gradients = runs.load("gradients")
    assert {name.split(".")[0] for name in gradients[0]} == {"high", "low"}
    scale = float(max(g.abs().max() for g in gradients[0].values()))
    for name in gradients[0]:
        torch.testing.assert_close(gradients[1][name], gradients[0][name], rtol=1e-4, atol=1e-5 * scale, msg=name)
    weights = runs.load("weights")
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=1e-5, atol=1e-5, msg=name)
