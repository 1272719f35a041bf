"""The recipe must make a model better: the ToyWorld's default recipe (``configs/toyworld.yaml``, its shipped
pretrained weights) through ``sagegrpo run`` for 20 iterations at seed 0, then its final policy against the untrained
one on identical noise (``benchmarks/toyworld/learning.py``, as RESULTS.md measures every arm).

The margins are the measured run's (benchmarks/toyworld/results/learning/runs/default/seed0.json): the training proxy
rises by +0.0172 +- 0.0095 (96 paired samples). The same run with the old deterministic last step
(``sde.final_step=deterministic``, the sampler before issue 49) ends at -0.0006 +- 0.0089 and fails the first margin;
so does a run whose update does not train (lr 0: exactly 0). About 2.5 minutes on 2 shared cores."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ITERATIONS = 20
TRAINING_MARGIN = 0.01  # the training proxy's paired gain must exceed this, and 1.5 standard errors


def test_the_default_recipe_raises_its_training_reward_against_the_untrained_policy_on_identical_noise(
    tmp_path, monkeypatch
):
    from benchmarks.toyworld import learning

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as the measured run: one thread, the same arithmetic
    record = learning.measure(learning.ARMS["default"], 0, tmp_path / "out", tmp_path / "work", ITERATIONS)

    gain, se = record["train_proxy_delta"], record["train_proxy_delta_se"]
    assert gain > TRAINING_MARGIN and gain > 1.5 * se, f"training proxy {gain:+.4f} +- {se:.4f}"
    # Held out (never rolled out in training; ODE, fixed seeds), paired against the run's own iteration-0 evaluation.
    assert record["held_out_proxy_delta"] > 0, record["held_out_proxy_delta"]
    assert [evaluation["iteration"] for evaluation in record["evaluations"]] == [0, 5, 10, 15, 20]
