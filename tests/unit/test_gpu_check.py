"""benchmarks/gpu_check.sh fits its 8 minutes, and its block check's CPU side: the traced plan against a measured
peak, the kernel named, the verdict line."""

import argparse
import re
from pathlib import Path

import pytest
import torch

from benchmarks import traced_block_check
from sage_grpo.core.models.tiny import TINY_HUNYUAN15_TRANSFORMER

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def test_the_step_limits_add_to_under_8_minutes():
    limits = [int(limit) for limit in re.findall(r"^\s*step [\w-]+ (\d+) ", SCRIPT.read_text(), re.M)]
    assert len(limits) == 5 and sum(limits) < 480
    assert "traced_block_check" in SCRIPT.read_text()


def test_the_block_check_compares_its_trace_with_a_measured_peak_on_the_cpu(tmp_path):
    args = argparse.Namespace(
        blocks=2,
        latents=[5, 32, 32],
        device="cpu",
        dtype="float32",
        transformer=TINY_HUNYUAN15_TRANSFORMER,
    )
    result = traced_block_check.check(args)
    assert result["ratio"] == pytest.approx(1.0, abs=0.15) and result["measured"] > 0
    assert "scaled_dot_product" in result["kernel"] or "flash" in result["kernel"]
    lines, ok = traced_block_check.report(result, tolerance=0.15)
    assert ok and lines[-1].startswith("traced-vs-measured: ok")
    _, failed = traced_block_check.report({**result, "ratio": 1.2}, tolerance=0.10)
    assert not failed
    assert torch.get_default_dtype() == torch.float32  # the check leaves the default dtype as it found it
