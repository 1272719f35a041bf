"""One ToyWorld arm through the sweep for real: ``sagegrpo run`` in a subprocess, its embedded MLflow store read back
(gold first), results.json and the report written, and a rerun that runs nothing. Throw-away weights (20 pretraining
steps, in a temporary TOYWORLD_CACHE) keep it short (72 s at load average ~4 on 2 shared cores, 7.8 min at ~15: three
process start-ups dominate); the numbers mean nothing, the plumbing does."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PRETRAIN_STEPS = 20


def _sweep(*argv: str, env: dict) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "benchmarks.toyworld.sweep", *argv]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)


def test_a_two_iteration_arm_runs_through_the_recipe_and_its_gold_comes_back_from_mlflow(tmp_path, monkeypatch):
    from benchmarks.toyworld import model, pretrain

    monkeypatch.setenv("TOYWORLD_CACHE", str(tmp_path / "cache"))  # for the sweep's subprocesses
    monkeypatch.setattr(pretrain, "CACHE_DIR", tmp_path / "cache")  # for this one, whenever it imported the module

    config = pretrain.pretrain_config(PRETRAIN_STEPS)
    pretrain.pretrained_adapter(config)
    sha = model.weights_sha256(pretrain.cache_path(config))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [
        "--arms",
        "kl dual",
        "--seeds",
        "1",
        "--set",
        "run.max_iterations=2",
        "eval.every=2",
        f"model.kwargs.pretrain_steps={PRETRAIN_STEPS}",
        f"model.kwargs.sha256={sha}",
        "--out",
        str(tmp_path / "out"),
        "--work",
        str(tmp_path / "work"),
        "--results-md",
        str(tmp_path / "RESULTS.md"),
    ]
    first = _sweep(*argv, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["weights_sha256"] == sha
    (run,) = results["runs"]
    assert [e["iteration"] for e in run["evaluations"]] == [0, 2]  # the pretrained model's, then the run's
    # drift.py read the run's checkpoint (its own weights), then the checkpoints went
    assert [e["kl_from_start"] > 0 for e in run["evaluations"]] == [False, True]
    assert not (tmp_path / "work" / "kl_dual" / "seed0" / "checkpoints").exists()
    trained = run["evaluations"][-1]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'work' / 'kl_dual' / 'seed0' / 'mlflow.db'}")
    (logged,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert trained["gold"] == logged.data.metrics.get("eval/judge/gold", logged.data.metrics.get("eval/gold"))
    assert 0 <= trained["gold"] <= 1 and trained["static"] + trained["right_way"] + trained["wrong_way"] <= 1
    assert len(run["history"]) == 2 and run["history"][-1]["reward/mean"] > 0 and run["train_s_per_iteration"] > 0
    assert run["experiment"]["trust_region"]["strategy"] == "dual"
    assert "| kl dual | 1 | 2 |" in (tmp_path / "RESULTS.md").read_text()

    again = _sweep(*argv, env=env)
    assert again.returncode == 0 and "1 of 1 runs already finished" in again.stdout
    assert json.loads((tmp_path / "out" / "results.json").read_text())["runs"] == [run]
