"""ToyWorld: the learning default moves the rewarded dimensions up within 25 iterations. Slow (a real GRPO run of
25 iterations), so outside the unit tier (tests/conftest.py)."""

import sys
from pathlib import Path

import pytest

# benchmarks/ is not an installed package: import it from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# The per-test limit guards against a hang, not a slow machine: 25 real iterations took past the suite's 900 s at
# load 5-12 (issue 44), so its limit is four times that.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def test_the_learning_default_moves_the_rewarded_dimensions_up():
    """About 3-4 min on 2 cores shared with other jobs (load average ~7), once the default pretraining is cached
    (fitting it first takes ~4 min, once per machine; the 150-step quick pretraining gives a model too poor to learn
    from, reward 0.12). 25 iterations of the learning default (SAGE, moving trust region with the calibrated
    controller, 12 training captions x 8 samples, high-noise half, lr 1e-4), evaluated every 5 as in the sweep: the
    ODE evaluation's colour alignment and motion quality rise on the training captions. The controller holds lambda
    near 0.2-0.4, so the default moves slowly: at 10 iterations seed 0 had gained colour +0.005 and MQ +0.001 only,
    at 25 +0.015 and +0.020 (the sweep's run of the same seed, which this one repeats step for step). Deterministic
    on a CPU at one thread."""
    from benchmarks.toyworld.compare import Config, run_grpo

    result = run_grpo("default", Config(iterations=25), seed=0)
    before, after = result["evaluations"][0]["train"], result["evaluations"][-1]["train"]  # the trained captions
    assert after["colour"] > before["colour"] + 0.005
    assert after["MQ"] > before["MQ"] + 0.005
    assert all(h["skipped"] == 0 for h in result["history"])
