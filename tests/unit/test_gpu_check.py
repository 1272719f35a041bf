"""benchmarks/gpu_check.sh fits its 8 minutes, and its checks' CPU side: the block check's traced plan against a
measured peak, the kernel named, the verdict line; the K = 2 against K = 1 comparison's verdict."""

import argparse
import re
from pathlib import Path

import pytest
import torch

from benchmarks import sequence_parallel_memory, traced_block_check
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


def test_the_sequence_parallel_check_passes_bf16_rounding_and_fails_a_wrong_split():
    one = {"velocity": torch.ones(2, 8), "latents": torch.ones(4, 3, 8), "grad_norm": torch.tensor(2.0)}
    rounded = {key: value * (1 + 2**-8) for key, value in one.items()}  # one bf16 rounding step everywhere
    differences = sequence_parallel_memory.relative_differences(one, rounded)
    assert differences["velocity"] == pytest.approx(2**-8)
    lines, ok = sequence_parallel_memory.equivalence_lines(differences, "bfloat16")
    assert ok and lines[-1] == "equivalence: ok" and len(lines) == 4
    # A gradient not scaled by K (half the norm), or half the tokens in the wrong place, fails.
    halved = sequence_parallel_memory.relative_differences(one, {**one, "grad_norm": torch.tensor(1.0)})
    swapped = one["velocity"].clone()
    swapped[:, 4:] = 0
    misplaced = sequence_parallel_memory.relative_differences(one, {**one, "velocity": swapped})
    for wrong in (halved, misplaced, {**differences, "latents": float("nan")}):
        lines, ok = sequence_parallel_memory.equivalence_lines(wrong, "bfloat16")
        assert not ok and lines[-1] == "equivalence: FAILED"
    # float32's limit is far tighter: one bf16 rounding step fails there.
    assert not sequence_parallel_memory.equivalence_lines(differences, "float32")[1]
