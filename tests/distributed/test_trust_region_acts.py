"""The trust region acts at the shipped defaults and not at the paper's numbers (issue 12, item 2), measured on the
tiny model under a strong reward: KL to the starting policy after K updates, and update/kl_grad_ratio."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("trust_region_worker.py")
SETTINGS = {"none": {"strategy": "none"}, "default": {}, "paper": {"preset": "paper"}}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("trust") / "report.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(WORKER), "--out", str(out), "--settings", json.dumps(SETTINGS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    return json.loads(out.read_text())


def test_default_dual_trust_region_at_least_halves_the_drift_of_no_kl(report):
    assert report["default"]["kl_to_start"] <= 0.5 * report["none"]["kl_to_start"]
    assert report["none"]["kl_to_start"] > 0


def test_paper_preset_is_indistinguishable_from_no_kl(report):
    assert report["paper"]["kl_to_start"] == pytest.approx(report["none"]["kl_to_start"], rel=1e-3)
    assert max(h["kl_grad_ratio"] for h in report["paper"]["history"]) < 1e-4


def test_default_kl_gradient_is_a_useful_fraction_of_the_policy_gradient(report):
    ratios = [h["kl_grad_ratio"] for h in report["default"]["history"][1:]]  # update 1 starts at the anchor
    median = sorted(ratios)[len(ratios) // 2]
    assert 0.01 <= median <= 0.3
    assert report["default"]["history"][-1]["reward"] > report["default"]["history"][0]["reward"]  # still learns


def test_velocity_kl_to_the_lagged_policy_is_positive_from_the_second_update(report):
    history = report["default"]["history"]
    assert history[0]["velocity_kl"] == 0.0  # the lagged copy starts as the initial policy
    assert all(h["velocity_kl"] > 0 for h in history[1:])
    assert report["default"]["state"]
