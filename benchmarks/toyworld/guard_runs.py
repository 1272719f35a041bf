"""The hacking guard on ToyWorld recipe runs: a proxy reward beside the gold judge (``eval.judges``), evaluated on all
16 captions after every iteration, the guard live at its shipped thresholds with ``action=warn`` (so the run goes on
and the whole series is recorded).

    PYTHONPATH=. python -m benchmarks.toyworld.guard_runs hacking     # MQ alone, which a static square games
    PYTHONPATH=. python -m benchmarks.toyworld.guard_runs aligned     # the proxy plus 4x gold: both rise

Each arm runs ``sagegrpo run configs/toyworld.yaml`` with its overrides under runs/toyworld-guard/<arm>, reads the
run's MLflow metrics and writes results/guard/<arm>.json: per evaluation the iteration, eval/reward (the training
reward on the evaluation prompts, what the guard reads), the rollout's reward/mean, every gold dimension and whether
the live guard fired; with the command, the config's sha256 and its weights' sha256.
tests/unit/test_hacking_guard_toyworld.py replays those series through the guard.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "toyworld.yaml"
RESULTS = Path(__file__).resolve().parent / "results" / "guard"
PROXY = "benchmarks.toyworld.rewards:ToyWorldReward"
GOLD = "benchmarks.toyworld.rewards:GoldJudge"

COMMON = [
    "run.max_iterations=24",
    "rollout.prompts_per_rank=6",  # half the training captions per iteration: half the cost
    "update.micro_batch_size=48",
    "eval.every=1",
    "eval.source=configs/toyworld_prompts.txt",  # all 16 captions, one fixed-noise video each
    "eval.write_videos=0",
    f"eval.judges=[{{name: '{GOLD}'}}]",
    "eval.guard.action=warn",
    "eval.guard.judges=[gold]",  # static and wrong_way count failures: they fall as a run improves
    "checkpoint.every=100",
]
ARMS = {
    # ToyWorld's MQ pays a static square (or a still blur) in full: trained on MQ alone, with no trust region and
    # 3x the config's lr, the proxy is gamed within a few iterations.
    "hacking": [
        f"rewards=[{{name: '{PROXY}', weights: {{MQ: 1.0}}}}]",
        "trust_region.strategy=none",
        "update.learning_rate=3.0e-4",
    ],
    # The proxy plus 4x gold at the config's own optimiser (the moving trust region, lr 1e-4): gold's signal
    # outweighs MQ's, so the proxy and gold rise together. Measured first: at the hacking arm's settings this reward
    # collapsed (both fell), and so did the proxy alone (-0.15 in 6 iterations).
    "aligned": [
        f"rewards=[{{name: '{PROXY}'}}, {{name: '{GOLD}', weights: {{gold: 4.0}}}}]",
    ],
}
SERIES = {
    "eval_reward": "eval/reward",
    "train_reward": "reward/mean",
    "gold": "eval/judge/gold",
    "static": "eval/judge/static",
    "wrong_way": "eval/judge/wrong_way",
}


def run_arm(arm: str) -> dict:
    output_dir = REPO / "runs" / "toyworld-guard" / arm
    overrides = [f"run.output_dir={output_dir.relative_to(REPO)}", *COMMON, *ARMS[arm]]
    command = [sys.executable, "-m", "sage_grpo.pipeline.cli", "run", "configs/toyworld.yaml", *overrides]
    started = time.monotonic()
    finished = subprocess.run([*command, "--fresh-start"], cwd=REPO, check=False)
    if finished.returncode != 0:
        raise SystemExit(f"guard_runs: the {arm} run exited {finished.returncode}")
    config = yaml.safe_load(CONFIG.read_text())
    return {
        "arm": arm,
        "command": f"PYTHONPATH=. python -m benchmarks.toyworld.guard_runs {arm}",
        "run_command": " ".join(["sagegrpo", *command[3:]]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_s": round(time.monotonic() - started, 1),
        "config_sha256": hashlib.sha256(CONFIG.read_bytes()).hexdigest(),
        "weights_sha256": config["model"]["kwargs"]["sha256"],
        "guard": _guard_settings(overrides),
        "evaluations": _evaluations(f"sqlite:///{output_dir}/mlflow.db"),
    }


def _guard_settings(overrides: list[str]) -> dict:
    """The eval.guard section the run resolved (its shipped thresholds plus the overrides)."""
    from sage_grpo.pipeline.config import load_run_config

    return load_run_config(CONFIG, overrides).eval.guard.model_dump()


def _evaluations(tracking_uri: str) -> list[dict]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = {
        name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} for name, key in SERIES.items()
    }
    fired = {m.step for m in client.get_metric_history(run.info.run_id, "guard/fired")}
    return [
        {"iteration": step, **{name: values.get(step) for name, values in history.items()}, "fired": step in fired}
        for step in sorted(history["eval_reward"])
    ]


def main(arms: list[str]) -> None:
    unknown = sorted(set(arms) - set(ARMS))
    if not arms or unknown:
        raise SystemExit(f"guard_runs: name arms among {', '.join(ARMS)}; got {' '.join(arms) or 'none'}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    for arm in arms:
        result = run_arm(arm)
        path = RESULTS / f"{arm}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"{arm}: {len(result['evaluations'])} evaluations in {result['wall_s']} s -> {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
