"""``sagegrpo preflight`` on the demo config: every check passes with the shipped (calibrated) trust region; the
paper's literal lambda numbers leave the KL gradient out of band, and preflight says so with exit 1; a model whose
update lowers the reward (its gradient's sign flipped) fails the one-update reward change."""

import re
import subprocess
import sys

import pytest

from tests.integration.pipeline_runs import DEMO, REPO, SHORT, environment

pytestmark = [pytest.mark.integration]

CHECKS = [
    "noise schedule",
    "devices",
    "rewards",
    "on-policy first update",
    "one-update reward change",
    "trust region acts",
    "peak memory",
    "time",
]
# The paired change, mean +- se, and how many samples it was paired over: 2 prompts x G = 2 on one rank (SHORT).
REWARD_CHANGE = re.compile(
    r"^one-update reward change +(pass|FAIL) +one update changes the reward by ([+-][0-9.e+-]+) \+- ([0-9.e+-]+) "
    r"\(mean \+- se over 4 samples of the first batch",
    re.MULTILINE,
)


def _preflight(tmp_path, *overrides):
    command = [
        sys.executable,
        "-m",
        "sage_grpo.pipeline.cli",
        "preflight",
        str(DEMO),
        f"run.output_dir={tmp_path}",
        *SHORT,
        *overrides,
    ]
    return subprocess.run(command, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=600)


def _rows(stdout: str) -> dict[str, str]:
    rows = {}
    for line in stdout.splitlines():
        for name in CHECKS:
            if line.startswith(name + " "):
                rows[name] = line[len(name) :].split()[0]
    return rows


def test_demo_passes_every_check_and_writes_nothing_into_the_run(tmp_path):
    result = _preflight(tmp_path / "run")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert _rows(result.stdout) == {name: "pass" for name in CHECKS} | {"peak memory": "n/a"}
    assert "projected" in result.stdout
    [(_, change, se)] = REWARD_CHANGE.findall(result.stdout)
    assert float(change) > -2 * float(se)  # the demo's update does not lower its reward
    assert not (tmp_path / "run").exists()  # a scratch folder, never the real run's checkpoints or MLflow store


def test_the_paper_preset_fails_the_trust_region_check(tmp_path):
    result = _preflight(tmp_path / "run", "trust_region.preset=paper")
    assert result.returncode == 1
    assert _rows(result.stdout)["trust region acts"] == "FAIL"
    assert result.stdout.strip().splitlines()[-1].startswith("preflight: trust region acts failed:")


def test_a_config_error_is_one_line_before_anything_runs(tmp_path):
    result = _preflight(tmp_path / "run", "sde.steps=0")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "sde.steps" in result.stderr


def test_the_demo_with_an_lr_warm_up_passes_the_trust_region_check(tmp_path):
    # The warm-up raises the lr update by update, so the KL's gain does too: lambda follows it per unit of reach, and
    # the check judges the anchor cycle's mean (before both, the last update's ratio 0.00778 failed the 0.0015-0.006
    # band). Measured with the deterministic last step: with the trained one (the default since issue 49) the cycle's
    # mean after a 10-update warm-up is 0.00124, below the band; the controller's catch-up is an open question there.
    result = _preflight(tmp_path / "run", "update.lr_warmup_steps=10", "sde.final_step=deterministic")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert _rows(result.stdout)["trust region acts"] == "pass"
    assert "geometric mean over updates" in result.stdout


def test_an_update_that_lowers_the_reward_fails_the_reward_change_check(tmp_path):
    # The demo's own tiny model, by dotted path, with one bug: its velocity sends back the negated gradient. Sampling
    # is untouched (the same rewards, exactly on-policy), but the update descends the reward it is given.
    reversed_model = "model.name=tests.fixtures.user_models:gradient_reversed_tiny_hunyuan15"
    result = _preflight(tmp_path / "run", reversed_model)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    rows = _rows(result.stdout)
    assert rows["one-update reward change"] == "FAIL"
    assert rows["rewards"] == rows["on-policy first update"] == "pass"
    [(_, change, se)] = REWARD_CHANGE.findall(result.stdout)
    assert float(change) < -2 * float(se)
    [failed] = [line for line in result.stdout.splitlines() if line.startswith("preflight: one-update reward")]
    assert failed.startswith("preflight: one-update reward change failed: one update changes the reward by -")
    assert "the update lowers the reward it is given" in failed
