"""A ToyWorld sweep resumes: a rerun runs nothing that a sitting before it finished (slow: one real GRPO run)."""

import json
import sys
from pathlib import Path

import pytest

# benchmarks/ is not an installed package: import it from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.toyworld import compare  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_rerun_skips_the_finished_runs_and_logs_each_sitting(tmp_path):
    """About 30 s: one real run of one iteration; the second sitting runs nothing and returns the same result."""
    base = compare.Config(iterations=1, eval_every=1, held_out_samples_per_caption=1, eval_samples_per_caption=1)
    first = compare.sweep(["equalizer cap"], 1, base, 1, tmp_path, "first")
    assert len(first["runs"]) == 1 and first["sittings"][-1]["runs"] == 1
    second = compare.sweep(["equalizer cap"], 1, base, 1, tmp_path, "second")
    assert second["runs"] == first["runs"] and second["sittings"][-1]["runs"] == 0
    assert len(json.loads((tmp_path / "sittings.json").read_text())) == 2
    evaluation = first["runs"][0]["evaluations"][-1]
    assert set(evaluation["train"]) >= {"reward", "TA", "VQ", "MQ", "drift"} and "reward" in evaluation
