"""The hacking guard on the ToyWorld's recorded gold/proxy runs (benchmarks/toyworld/guard_runs.py, results in
benchmarks/toyworld/results/guard/): each evaluation's eval/reward and gold judge, replayed through the guard as the
recipe reads them (``stages.evaluate.hacking_divergence`` on the metric history). At the shipped thresholds it fires
on the hacking run before gold has fallen GOLD_DROP_BOUND below its best, and never on the run whose proxy and gold
move together; the replay at each run's own settings reproduces where the live guard fired."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from sage_grpo.stages.evaluate import GUARD_FIRED, HackingGuardConfig, hacking_divergence

pytestmark = pytest.mark.unit

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "toyworld" / "results" / "guard"
GOLD_DROP_BOUND = 0.005  # the most gold may have fallen below its best when the guard fires (docs/rewards.md)
SHIPPED = HackingGuardConfig(judges=["gold"])  # the shipped thresholds; gold's failure counts left out


def recorded(arm: str) -> dict:
    return json.loads((RESULTS / f"{arm}.json").read_text())


def replayed_firings(evaluations: list[dict], guard: HackingGuardConfig) -> list[int]:
    """The iterations where the guard fires when the recorded evaluations arrive one by one."""
    history: list[dict[str, float]] = []
    for point in evaluations:
        metrics = {
            "iteration": point["iteration"],
            "eval/reward": point["eval_reward"],
            **{f"eval/judge/{name}": point[name] for name in ("gold", "static", "wrong_way")},
        }
        if hacking_divergence([*history, metrics], guard) is not None:
            metrics[GUARD_FIRED] = 1.0
        history.append(metrics)
    return [metrics["iteration"] for metrics in history if GUARD_FIRED in metrics]


@pytest.mark.parametrize("arm", ["hacking", "aligned"])
def test_the_replay_reproduces_the_live_guard(arm):
    run = recorded(arm)
    live = [point["iteration"] for point in run["evaluations"] if point["fired"]]
    assert replayed_firings(run["evaluations"], HackingGuardConfig(**run["guard"])) == live


def test_it_fires_on_the_hacking_run_before_gold_falls_by_the_bound():
    evaluations = recorded("hacking")["evaluations"]
    gold = {point["iteration"]: point["gold"] for point in evaluations}
    first = replayed_firings(evaluations, SHIPPED)[0]
    best_before = max(value for iteration, value in gold.items() if iteration <= first)
    assert best_before - gold[first] <= GOLD_DROP_BOUND
    assert max(gold.values()) - gold[max(gold)] > GOLD_DROP_BOUND  # unguarded, gold went on to fall further


def test_it_never_fires_on_the_run_whose_proxy_and_gold_move_together():
    evaluations = recorded("aligned")["evaluations"]
    proxy, gold = ([point[name] for point in evaluations] for name in ("eval_reward", "gold"))
    assert statistics.correlation(proxy, gold) > 0.9
    assert replayed_firings(evaluations, SHIPPED) == []
    # The default's margin: at min_judge_drop 0 a flat stretch fires it.
    assert replayed_firings(evaluations, SHIPPED.model_copy(update={"min_judge_drop": 0.0})) != []
