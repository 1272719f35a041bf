"""`sagegrpo plan` on the shipped HunyuanVideo 1.5 and Wan 2.2 A14B configs, traced at full size: per-phase peaks
with the frozen models, GPU-hours per iteration, and a verdict the docs and the configs' comments repeat."""

import re

import pytest
import torch

from sage_grpo.pipeline import phase_plan
from tests.helpers import REPO, sagegrpo

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


# The shipped Wan 2.2 A14B configs on the layouts docs/scale-out.md's Wan section plans them on.
WAN_LAYOUTS = {"configs/wan22_a14b_sage_full.yaml": ("8", "8"), "configs/wan22_a14b_sage_lora.yaml": ("8", "1")}


@pytest.mark.parametrize("config", sorted(WAN_LAYOUTS))
def test_the_shipped_wan_configs_fit_and_their_plans_are_the_docs(config):
    gpus_per_node, nodes = WAN_LAYOUTS[config]
    done = sagegrpo("plan", config, "--gpus-per-node", gpus_per_node, "--nodes", nodes)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert all(re.search(rf"^    {phase}\s+[\d.]+ GB", out, re.M) for phase in PHASES)
    assert "a forward gathers only its step's expert" in out and "idle expert offloaded (NOT implemented" in out
    section = (REPO / "docs" / "scale-out.md").read_text().split("## Wan 2.2 A14B")[1]
    assert f"sagegrpo plan {config} --gpus-per-node {gpus_per_node} --nodes {nodes}" in section
    hours = re.search(r"([\d,.]+) GPU-hours per iteration", out).group(1)
    assert f"{_traced_peak(out):.2f} GB" in section and f" {hours} " in section


def test_wans_frozen_models_are_counted_at_their_published_sizes():
    from diffusers import AutoencoderKLWan

    counts = phase_plan.wan_frozen_parameter_counts([])
    assert 5.6e9 < counts["text encoders"] < 5.8e9  # UMT5-XXL's encoder
    with torch.device("meta"):
        assert counts["VAE"] == sum(parameter.numel() for parameter in AutoencoderKLWan().parameters())
    assert 1.2e8 < counts["VAE"] < 1.3e8 and "reward (VideoAlign)" not in counts
