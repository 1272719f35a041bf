"""Sequence parallelism on both experts of a tiny two-expert Wan 2.2, under real DeepSpeed ZeRO-3 with gloo on CPU:
K = 2 on 2 processes computes what K = 1 on one process does (a velocity batch that mixes both experts, the rollout,
the first update's gradients of both experts and the weights after two updates); ``sequence_parallel_worker.py``."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(3600)]

WORKER = Path(__file__).with_name("sequence_parallel_worker.py")


def test_k2_equals_k1_on_both_experts(tmp_path):
    for size in (1, 2):
        torchrun(size, str(WORKER), "--model", "wan22", "--out", str(tmp_path))
    single, split = (json.loads((tmp_path / f"report_k{k}.json").read_text()) for k in (1, 2))
    assert split["block_tokens"] == [single["video_tokens"] // 2]  # the low-noise expert's tokens are split too

    def load(kind):
        return load_file(tmp_path / f"{kind}_k1.safetensors"), load_file(tmp_path / f"{kind}_k2.safetensors")

    outputs = load("outputs")
    for name in ("velocity", "latents", "log_probs"):
        torch.testing.assert_close(outputs[1][name], outputs[0][name], rtol=1e-5, atol=1e-5, msg=name)
    gradients = load("gradients")
    assert {name.split(".")[0] for name in gradients[0]} == {"high", "low"}
    scale = float(max(g.abs().max() for g in gradients[0].values()))
    for name in gradients[0]:
        torch.testing.assert_close(gradients[1][name], gradients[0][name], rtol=1e-4, atol=1e-5 * scale, msg=name)
    weights = load("weights")
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=1e-5, atol=1e-5, msg=name)
