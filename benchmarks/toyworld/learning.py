"""Does the recipe learn? ``configs/toyworld.yaml`` through ``sagegrpo run``, each arm at several seeds, each run
measured against the untrained policy on identical noise (issue 49):

- training reward: the run's final weights and the pretrained ones sample the 12 training captions x G with the run's
  own training sampler (noise and all) from the same seed; the paired difference of the proxy total and of gold;
- held-out: the run's evaluations (ODE, fixed seeds), each paired against its iteration-0 evaluation by the recipe
  itself (``eval.at_start``: ``eval/<name>/delta``).

    PYTHONPATH=. python -m benchmarks.toyworld.learning --arms default --seeds 6
    PYTHONPATH=. python -m benchmarks.toyworld.learning --arms default 'deterministic final step' --seeds 3 --report

A finished run is written to ``--out``/runs/ at once, so a rerun skips it. Across seeds, each arm's per-seed gains are
tested against 0 (one-sample t: the start is the same for every seed), and each arm against the default by Welch's
t-test, each Holm-corrected over the arm's four measures; ``--report`` prints the markdown table RESULTS.md quotes.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
from pathlib import Path

import torch

from sage_grpo.core.errors import UserError

from . import stats
from .sweep import BASE_CONFIG, REPOSITORY, Arm, experiment, read_back, run_one, slug, write_atomically

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "learning"
DEFAULT_WORK = BASE_CONFIG.parents[1] / "runs" / "toyworld-learning"
PAIRED_SEED = 4242  # the training-reward probe's noise: the same for the start and the end of every run
ITERATIONS = 20

ARMS = {
    arm.name: arm
    for arm in [
        Arm("default"),  # every step trains, the last one with its own noise and log-prob
        # The three candidates for the last step (docs/algorithm.md, "Every model-dependent step trains")
        Arm("deterministic final step", ("sde.final_step=deterministic",)),
        Arm(
            "final step on pretrained weights",
            ("sde.final_step=deterministic", "model.kwargs.final_step_weights=pretrained"),
        ),
        # A policy gradient learns faster at a higher lr until it becomes unstable
        *[Arm(f"lr {lr}", (f"update.learning_rate={lr}",)) for lr in ("3e-5", "3e-4", "1e-3")],
        Arm("adam_eps 1e-15", ("update.adam_eps=1e-15",)),
    ]
}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from .drift import STEP, checkpoint_weights

    steps = sorted(
        (int(m.group(1)), path)
        for path in (run_dir / "checkpoints").glob("step-*")
        if (m := STEP.search(path.name)) and (path / "manifest.json").exists()
    )
    if not steps:
        raise UserError(f"{run_dir}: no committed checkpoint to measure")
    return checkpoint_weights(steps[-1][1])


def paired_training_reward(run_dir: Path, overrides: tuple[str, ...]) -> dict[str, float]:
    """The run's final policy minus its pretrained one on the training captions, sampled with the run's training
    sampler from identical noise: per-sample paired differences of the proxy total and of gold (mean, se, n)."""
    from sage_grpo.core.rewards.base import VideoBatch
    from sage_grpo.pipeline.config import load_run_config
    from sage_grpo.stages.rollout import generate
    from sage_grpo.stages.score import Scorer

    from .model import toyworld_adapter
    from .world import TRAIN_CAPTIONS

    config = load_run_config(BASE_CONFIG, list(overrides))
    adapter = toyworld_adapter(**config.model.kwargs)
    start = copy.deepcopy(adapter.transformer.state_dict())
    scorer = Scorer(config.rewards + config.eval.judges)  # gold: a zero-weight reward or a judge, never in the total
    scorer.setup(torch.device("cpu"))

    def scores() -> tuple[list[float], list[float]]:
        rollout = generate(
            adapter, list(TRAIN_CAPTIONS), config.rollout.group_size, config.sde, PAIRED_SEED, progress=False
        )
        scored = scorer.score(VideoBatch.from_tensor(rollout.videos, adapter.fps), rollout.sample_prompts)
        return list(scored.total), list(scored.dimensions["gold"])

    before = scores()
    adapter.transformer.load_state_dict(final_weights(run_dir), strict=True)
    after = scores()
    adapter.transformer.load_state_dict(start, strict=True)
    measured = {}
    for name, old, new in (("proxy", before[0], after[0]), ("gold", before[1], after[1])):
        result = stats.one_sample([a - b for a, b in zip(new, old)])
        assert result is not None
        measured[f"train_{name}_delta"], measured[f"train_{name}_delta_se"] = result["difference"], result["se"]
    return measured


def held_out_deltas(store: Path) -> dict[str, float]:
    """The last evaluation's paired differences against iteration 0, as the recipe logged them."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store.resolve()}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    names = {"proxy": ["reward"], "gold": ["judge/gold", "gold"], "VQ": ["VQ"], "MQ": ["MQ"], "TA": ["TA"]}
    measured = {}
    for name, keys in names.items():
        for suffix in ("delta", "delta_se"):
            for key in keys:
                history = client.get_metric_history(run.info.run_id, f"eval/{key}/{suffix}")
                if history:
                    measured[f"held_out_{name}_{suffix}"] = max(history, key=lambda m: m.step).value
                    break
    return measured


def measure(arm: Arm, seed: int, out: Path, work: Path, iterations: int) -> dict:
    path = out / "runs" / slug(arm.name) / f"seed{seed}.json"
    if path.exists():
        return json.loads(path.read_text())
    overrides = (*arm.overrides, f"run.max_iterations={iterations}")
    resolved = experiment(overrides)
    run_dir = work / slug(arm.name) / f"seed{seed}"
    if (run_dir / "checkpoints" / f"step-{iterations}" / "manifest.json").exists():  # trained, not yet measured
        record = {"arm": arm.name, "overrides": list(overrides), "seed": seed, "experiment": resolved}
    else:
        record = run_one(Arm(arm.name, overrides), seed, resolved, work)
    record |= paired_training_reward(run_dir, overrides) | held_out_deltas(run_dir / "mlflow.db")
    record["evaluations"], record["history"] = read_back(run_dir / "mlflow.db")
    record.pop("experiment")
    if "command" in record:  # no machine paths in what the repository keeps
        record["command"] = record["command"].replace(f"{REPOSITORY}/", "")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # large, and measured now
    write_atomically(path, json.dumps(record))
    return record


MEASURES = (
    ("train_proxy_delta", "training proxy (paired)"),
    ("train_gold_delta", "training gold (paired)"),
    ("held_out_proxy_delta", "held-out proxy"),
    ("held_out_gold_delta", "held-out gold"),
)


def report(records: dict[str, list[dict]]) -> str:
    """Markdown: per arm and measure, the mean gain over seeds +- its standard error with its one-sample p against 0,
    and its difference from the default arm with Welch's p. Holm's correction runs over each arm's family: its four
    gains, and its four comparisons with the default (the question each arm answers); raw p beside it."""
    lines = [
        "| arm | measure | seeds | gain over the untrained policy | p (Holm) | vs default | p (Holm) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, runs in records.items():
        gains = {key: [run[key] for run in runs if key in run] for key, _ in MEASURES}
        baseline = {key: [run[key] for run in records.get("default", []) if key in run] for key, _ in MEASURES}
        zero = [stats.one_sample(gains[key]) for key, _ in MEASURES]
        versus = [stats.welch(gains[key], baseline[key]) if arm != "default" else None for key, _ in MEASURES]
        zero_holm = stats.holm([(result or {}).get("p", math.nan) for result in zero])
        versus_holm = stats.holm([(result or {}).get("p", math.nan) for result in versus])
        for k, (key, label) in enumerate(MEASURES):
            lines.append(
                f"| {arm} | {label} | {len(gains[key])} | {_difference(zero[k])} | {_p(zero[k], zero_holm[k])} "
                f"| {_difference(versus[k])} | {_p(versus[k], versus_holm[k])} |"
            )
    return "\n".join(lines)


def _difference(result: dict | None) -> str:
    return f"{result['difference']:+.4f} ± {result['se']:.4f}" if result else ""


def _p(result: dict | None, adjusted: float) -> str:
    return f"{result['p']:.2g} ({adjusted:.2g})" if result else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=["default"], choices=sorted(ARMS))
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK)
    parser.add_argument("--report", action="store_true", help="only report the finished runs")
    args = parser.parse_args()
    records: dict[str, list[dict]] = {}
    for name in args.arms:
        for seed in range(args.seeds):
            path = args.out / "runs" / slug(name) / f"seed{seed}.json"
            if args.report:
                if path.exists():
                    records.setdefault(name, []).append(json.loads(path.read_text()))
                continue
            record = measure(ARMS[name], seed, args.out, args.work, args.iterations)
            records.setdefault(name, []).append(record)
            print(
                f"{name} seed {seed}: train proxy {record['train_proxy_delta']:+.4f}, "
                f"gold {record['train_gold_delta']:+.4f}; "
                f"held-out proxy {record.get('held_out_proxy_delta', float('nan')):+.4f}, "
                f"gold {record.get('held_out_gold_delta', float('nan')):+.4f}",
                flush=True,
            )
    table = report(records)
    write_atomically(args.out / "report.md", table + "\n")
    print(table)


if __name__ == "__main__":
    main()
