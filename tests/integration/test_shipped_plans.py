"""`sagegrpo plan` on the shipped HunyuanVideo 1.5 configs, traced at full size: per-phase peaks with the frozen
models, GPU-hours per iteration, and a verdict the README and the configs' comments repeat."""

import re

import pytest
import torch

from sage_grpo.pipeline import phase_plan
from tests.helpers import sagegrpo

pytestmark = pytest.mark.slow

PHASES = ("rollout step", "VAE decode", "scoring", "update micro-step", "evaluation")


def _traced_peak(stdout: str) -> float:
    return float(re.search(r"^  peak\s+([\d.]+) GB", stdout, re.M).group(1))


def test_the_720p_config_fits_at_k_2_and_not_at_k_1():
    plan = ["plan", "configs/hunyuanvideo15_sage_720p.yaml", "--gpus-per-node", "8", "--nodes", "8"]
    split = sagegrpo(*plan)
    assert split.returncode == 0, split.stderr[-2000:]
    out = split.stdout
    assert all(re.search(rf"^    {phase}\s+[\d.]+ GB", out, re.M) for phase in PHASES)
    assert all(name in out for name in ("text encoders", "VAE", "reward (VideoAlign)"))
    assert "GPU-hours per iteration" in out and "hand formula vs trace" in out
    assert 60 < _traced_peak(out) <= 80  # 71.76 GB on 2026-12-06 (docs/scale-out.md)
    whole = sagegrpo(*plan, "--sequence-parallel", "1")
    assert whole.returncode == 1 and "does NOT fit" in whole.stdout
    assert _traced_peak(whole.stdout) > 80


def test_the_frozen_models_are_counted_at_their_published_sizes():
    counts = phase_plan.frozen_parameter_counts(["videoalign"])
    assert 7.0e9 < counts["text encoders"] < 7.4e9  # Qwen2.5-VL-7B's text model and the glyph ByT5
    assert 1.2e9 < counts["VAE"] < 1.3e9
    # The count is the model's own: the VAE built on the meta device, its parameters summed directly.
    from diffusers import AutoencoderKLHunyuanVideo15

    with torch.device("meta"):
        assert counts["VAE"] == sum(parameter.numel() for parameter in AutoencoderKLHunyuanVideo15().parameters())
    assert 2.1e9 < counts["reward (VideoAlign)"] < 2.3e9  # Qwen2-VL-2B
