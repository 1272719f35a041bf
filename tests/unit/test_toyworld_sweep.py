"""The ToyWorld sweep through the recipe (``benchmarks/toyworld/sweep.py``): arms expand to config overrides, a
duplicate or a prefix of another arm is refused, a rerun skips the finished runs, a run on other pretrained weights
cannot join, and the report puts gold first with Welch + Holm. No training here: ``run_one`` is replaced by a stand-in
that returns a record (tests/integration/test_toyworld_sweep_run.py runs the real thing)."""

import json
import sys
from pathlib import Path

import pytest

# benchmarks/ is not an installed package: import it from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.toyworld import report, sweep, world  # noqa: E402
from sage_grpo.core.errors import UserError  # noqa: E402

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def test_every_shipped_arm_is_its_own_experiment_and_none_is_a_prefix_of_another():
    jobs = sweep.plan(list(sweep.ARMS), seeds=1)
    assert len(jobs) == len(sweep.ARMS)
    resolved = {arm.name: experiment for arm, experiment, _ in jobs}
    assert resolved["kl none"]["trust_region"]["strategy"] == "none"
    assert resolved["base"]["trust_region"]["strategy"] == "moving"
    assert resolved["flow"]["sde"]["variant"] == "flow" and resolved["flow"]["sde"]["eta"] == 0.7
    pinned = resolved["equalizer off lambda 0.3"]["trust_region"]
    assert pinned["kl_minimum"] == pinned["kl_maximum"] == pinned["kl_initial"] == sweep.FIXED_LAMBDA
    assert "output_dir" not in resolved["base"]["run"] and "seed" not in resolved["base"]


def test_the_jobs_go_seed_by_seed_so_a_sweep_cut_short_stays_paired():
    jobs = sweep.plan(["base", "kl none"], seeds=2)
    assert [(arm.name, seed) for arm, _, seed in jobs] == [("base", 0), ("kl none", 0), ("base", 1), ("kl none", 1)]


def test_an_arm_that_is_another_once_resolved_is_refused_naming_both(monkeypatch):
    monkeypatch.setitem(sweep.ARMS, "kl moving", sweep.Arm("kl moving", ("trust_region.strategy=moving",)))
    with pytest.raises(UserError, match="arms 'base' and 'kl moving' are the same experiment"):
        sweep.plan(["base", "kl moving"], seeds=1)


def test_an_arm_that_is_the_first_iterations_of_another_is_refused(monkeypatch):
    monkeypatch.setitem(sweep.ARMS, "base 10", sweep.Arm("base 10", ("run.max_iterations=10",)))
    with pytest.raises(UserError, match="arm 'base 10' is the first 10 iterations of arm 'base'"):
        sweep.plan(["base 10", "base"], seeds=1)
    # Ten iterations of another arm are a different experiment: allowed beside the base.
    shorter_none = sweep.Arm("kl none 10", ("trust_region.strategy=none", "run.max_iterations=10"))
    monkeypatch.setitem(sweep.ARMS, "kl none 10", shorter_none)
    sweep.plan(["base", "kl none 10"], seeds=1)


def test_an_unknown_arm_or_a_bad_override_is_one_line(monkeypatch):
    with pytest.raises(UserError, match="unknown arm 'kl sometimes'"):
        sweep.plan(["kl sometimes"], seeds=1)
    monkeypatch.setitem(sweep.ARMS, "bad", sweep.Arm("bad", ("trust_region.strategy=sometimes",)))
    with pytest.raises(UserError, match="trust_region.strategy=sometimes: .*strategy") as error:
        sweep.plan(["bad"], seeds=1)
    assert "\n" not in str(error.value)


@pytest.fixture
def fake_runs(monkeypatch):
    """``run_one`` replaced by a record-maker (gold falls by the seed's amount), the weights check and the start
    evaluation by constants: the sweep's bookkeeping alone. Returns the (arm, seed) pairs it was asked to run."""
    calls = []

    def run_one(arm, seed, resolved, work, extra=()):
        calls.append((arm.name, seed))
        evaluation = {"iteration": 5, "gold": 0.5 - 0.1 * seed, "reward": 0.9, "static": 0.1, "wrong_way": 0.0}
        return {
            "arm": arm.name,
            "seed": seed,
            "experiment": resolved,
            "weights_sha256": sweep.weights_of(resolved),
            "evaluations": [evaluation],
            "history": [],
            "train_s_per_iteration": 1.0,
        }

    monkeypatch.setattr(sweep, "run_one", run_one)
    monkeypatch.setattr(sweep, "check_weights", lambda resolved: sweep.weights_of(resolved))
    start = {"iteration": 0, "gold": 0.4, "reward": 0.8, "static": 0.3, "wrong_way": 0.2}
    monkeypatch.setattr(sweep, "start_evaluation", lambda *args: start)
    return calls


def test_a_rerun_skips_the_finished_runs_and_reruns_a_changed_arm(fake_runs, tmp_path, monkeypatch):
    first = sweep.sweep(["base", "kl none"], 2, tmp_path, tmp_path / "work")
    assert fake_runs == [("base", 0), ("kl none", 0), ("base", 1), ("kl none", 1)]
    assert [e["iteration"] for e in first["runs"][0]["evaluations"]] == [0, 5]  # the pretrained model's first
    fake_runs.clear()
    second = sweep.sweep(["base", "kl none"], 3, tmp_path, tmp_path / "work")
    assert fake_runs == [("base", 2), ("kl none", 2)]  # only the new seed
    assert second["runs"][:2] == first["runs"][:2] and len(second["runs"]) == 6
    fake_runs.clear()
    monkeypatch.setitem(sweep.ARMS, "kl none", sweep.Arm("kl none", ("trust_region.strategy=fixed",)))
    sweep.sweep(["base", "kl none"], 1, tmp_path, tmp_path / "work")
    assert fake_runs == [("kl none", 0)]  # its experiment changed: rerun
    fake_runs.clear()
    collected = sweep.sweep(["base", "kl none"], 3, tmp_path, tmp_path / "work", run=False)
    # Only what this experiment finished: the changed arm's seeds 1 and 2 are the old experiment's.
    assert fake_runs == [] and len(collected["runs"]) == 4


def test_a_run_on_other_weights_refuses_to_join(fake_runs, tmp_path):
    results = sweep.sweep(["base"], 1, tmp_path, tmp_path / "work")
    (run,) = results["runs"]
    with pytest.raises(UserError, match="measured on weights ff+, not this sweep's .*: it cannot join"):
        sweep.join(results, {**run, "weights_sha256": "f" * 64})
    path = sweep.run_path(tmp_path, "base", 0)
    path.write_text(json.dumps({**run, "weights_sha256": "f" * 64}))
    with pytest.raises(UserError, match="was measured on pretrained weights ff+, this sweep's are"):
        sweep.sweep(["base"], 1, tmp_path, tmp_path / "work")
    assert json.loads(path.read_text())["weights_sha256"] == "f" * 64  # refused, never run over


def _run(arm: str, seed: int, golds: list[float]) -> dict:
    evaluations = [
        {"iteration": 5 * i, "gold": g, "reward": 0.8 + 0.01 * i, "static": 0.3, "wrong_way": 0.1, "right_way": 0.2}
        for i, g in enumerate(golds)
    ]
    return {"arm": arm, "seed": seed, "evaluations": evaluations, "train_s_per_iteration": 2.0}


def test_the_report_puts_gold_first_and_decides_claims_by_welch_and_holm():
    runs = [_run("kl dual", s, [0.30, 0.40 + 0.01 * s, 0.35 + 0.01 * s]) for s in range(3)]
    runs += [_run("kl none", s, [0.30, 0.33 + 0.01 * s, 0.10 + 0.01 * s]) for s in range(3)]
    results = {"runs": runs, "weights_sha256": "a" * 64, "base_config": "configs/toyworld.yaml", "command": "c"}
    text = report.markdown(results, "results.json")
    header = next(line for line in text.splitlines() if line.startswith("| arm | seeds"))
    assert header.index("gold start") < header.index("proxy start")
    rows = {(r["claim"], r["measure"]): r for r in report.verdicts(report.summarise(runs))}
    end = rows["the dual trust region keeps more gold than no KL", "end"]
    assert end["test"]["difference"] == pytest.approx(0.25) and end["verdict"] == "holds"
    peak = rows["the dual trust region keeps more gold than no KL", "peak"]
    assert peak["test"]["difference"] == pytest.approx(0.07)
    assert end["holm_p"] == pytest.approx(min(1.0, 2 * min(end["test"]["p"], peak["test"]["p"])))
    assert "Not run yet" in text and "SAGE's sampler keeps more gold than CPS's" in text
    assert "| kl dual | 3 | 10 | 0.300 ± 0.000 | 0.360 ± 0.006 | 0.410 ± 0.006 (5/5/5) |" in text


def test_the_report_replaces_the_section_whatever_generated_it(tmp_path):
    md = tmp_path / "RESULTS.md"
    old = "<!-- toyworld:begin (generated by an older script) -->\nold\n<!-- toyworld:end -->"
    md.write_text(f"# Results\n\n{old}\n\n## Other\n")
    report.write({"runs": [_run("base", 0, [0.1, 0.2])], "weights_sha256": "a", "base_config": "b"}, md, "r.json")
    text = md.read_text()
    assert "\nold\n" not in text and text.startswith(f"# Results\n\n{report.BEGIN}") and text.endswith("## Other\n")


def test_the_evaluation_files_are_the_held_out_captions_and_the_training_ones():
    held_out = (REPO / "configs" / "toyworld_held_out_prompts.txt").read_text().splitlines()
    assert held_out == world.sample_tagged(world.HELD_OUT_CAPTIONS, 16)
    assert {world.parse_caption(p) for p in held_out} == {world.parse_caption(c) for c in world.HELD_OUT_CAPTIONS}
    assert (REPO / "configs" / "toyworld_train_prompts.txt").read_text().splitlines() == world.TRAIN_CAPTIONS
    resolved = sweep.experiment(())
    assert resolved["data"]["source"].endswith("toyworld_train_prompts.txt")
    assert resolved["eval"]["source"].endswith("toyworld_held_out_prompts.txt")


def _drifted(arm: str, seed: int, kl: float, gold: float) -> dict:
    run = _run(arm, seed, [0.5, gold])
    run["evaluations"][0]["kl_from_start"], run["evaluations"][-1]["kl_from_start"] = 0.0, kl
    return run


def test_the_frontier_asks_whether_the_trust_region_beats_a_smaller_lr_at_the_same_drift():
    """No KL's runs lie on gold = 0.5 - 0.01 sqrt(KL) (+-0.001 by seed); the dual runs sit 0.02 above that line."""
    jitter = [0.001, -0.001, 0.0005]
    runs = [
        _drifted(arm, s, kl, 0.5 - 0.01 * kl**0.5 + jitter[s])
        for arm, kl in (("none lr 3e-5", 1.0), ("kl none", 4.0), ("none lr 3e-4", 16.0))
        for s in range(3)
    ]
    runs += [_drifted("kl dual", s, 2.25, 0.5 - 0.015 + 0.02 + jitter[s]) for s in range(3)]
    summary = report.summarise(runs)
    frontier = report.beyond_lr(summary)
    assert frontier["intercept"] == pytest.approx(0.5, abs=1e-3) and frontier["slope"] == pytest.approx(-0.01, abs=1e-3)
    assert frontier["test"]["difference"] == pytest.approx(0.02, abs=1e-3)
    rows = {r["claim"]: r for r in report.verdicts(summary)}
    assert rows[report.BEYOND_LR]["verdict"] == "holds"
    text = report.markdown({"runs": runs, "weights_sha256": "a", "base_config": "b"}, "r.json")
    assert "| dual | 1e-4 | 3 | 2.250 ± 0.000 | 0.505 ± 0.001 |" in text
    # Without two drifts on the no-KL side there is no line, and no claim.
    assert report.beyond_lr(report.summarise([r for r in runs if r["arm"] in ("kl none", "kl dual")])) is None


def _timed(arm: str, seed: int, proxies: list[float], s_per_iteration: float) -> dict:
    run = _run(arm, seed, [0.5] * len(proxies))
    for evaluation, proxy in zip(run["evaluations"], proxies):
        evaluation["reward"] = proxy
    return {**run, "train_s_per_iteration": s_per_iteration}


def test_a_lever_is_timed_to_half_the_default_arms_proxy_gain():
    """The base arm's held-out proxy goes 0.80 -> 0.84 by iteration 20 (threshold 0.82, reached at iteration 10 at
    2 s/iteration: 20 s); the lever reaches it at iteration 15 at 1 s/iteration (15 s), or never (20 s, a bound)."""
    runs = [_timed("base", s, [0.80, 0.81, 0.821 + 0.001 * s, 0.83, 0.84 + 0.001 * s], 2.0 + 0.1 * s) for s in range(3)]
    runs += [_timed("window [0,2]", s, [0.80, 0.80, 0.81, 0.825, 0.83], 1.0) for s in range(2)]
    runs += [_timed("window [0,2]", 2, [0.80, 0.80, 0.80, 0.80, 0.80], 1.0)]
    (row,) = report.lever_rows(runs)
    assert row["timed"] and row["gain"]["threshold"] == pytest.approx(0.8205)
    assert row["seconds"] == pytest.approx([15.0, 15.0, 20.0]) and row["reached"] == 2
    assert row["time"]["difference"] == pytest.approx(50 / 3 - 21.0)
    assert row["s_per_iteration"]["difference"] == pytest.approx(-1.1)
    assert row["proxy"]["difference"] == pytest.approx((0.83 * 2 + 0.80) / 3 - 0.841)


def test_a_lever_is_not_timed_when_the_default_arm_gains_nothing():
    runs = [_timed("base", s, [0.80, 0.81, 0.80 + 0.002 * (s - 1)], 2.0) for s in range(3)]
    runs += [_timed("window [0,2]", s, [0.80, 0.80, 0.79], 1.0) for s in range(2)]
    (row,) = report.lever_rows(runs)
    assert not row["timed"] and row["time"] is None and row["proxy"] is not None
    text = report.markdown({"runs": runs, "weights_sha256": "a", "base_config": "b"}, "r.json")
    assert "not shown, so no lever can be timed to it" in text


def test_the_pretrained_models_evaluation_is_shared_by_arms_that_report_the_same_proxy():
    identity = {name: sweep.start_identity(sweep.experiment(sweep.ARMS[name].overrides)) for name in sweep.ARMS}
    assert identity["dance"] == identity["base"] == identity["dual lr 3e-4"]  # the ODE evaluation ignores them
    assert identity["MQ proxy, kl none"] == identity["MQ proxy, kl dual"] != identity["base"]


def test_a_finished_run_gets_the_start_evaluation_its_arm_reports_now(fake_runs, tmp_path, monkeypatch):
    sweep.sweep(["base"], 1, tmp_path, tmp_path / "work")
    path = sweep.run_path(tmp_path, "base", 0)
    record = json.loads(path.read_text())
    record["evaluations"][0] = {**record["evaluations"][0], "reward": -1.0}  # filed under another arm's proxy
    path.write_text(json.dumps(record))
    (collected,) = sweep.sweep(["base"], 1, tmp_path, tmp_path / "work", run=False)["runs"]
    assert collected["evaluations"][0]["reward"] == -1.0  # collecting reports, and changes nothing
    (rerun,) = sweep.sweep(["base"], 1, tmp_path, tmp_path / "work")["runs"]
    assert rerun["evaluations"][0]["reward"] != -1.0 and fake_runs == [("base", 0)]
    assert json.loads(path.read_text())["evaluations"][0] == rerun["evaluations"][0]


def test_drift_is_recorded_only_when_every_evaluation_has_its_checkpoint(tmp_path, monkeypatch, capsys):
    from benchmarks.toyworld import drift

    record = _run("base", 0, [0.5, 0.4, 0.3])  # evaluations at iterations 0, 5, 10
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    monkeypatch.setattr(drift, "drift_by_iteration", lambda run_dir, base: {0: 0.0, 10: 2.0})  # step 5 is missing
    kept = sweep.with_drift(json.loads(json.dumps(record)), tmp_path / "run", tmp_path)
    assert "kl_from_start" not in kept["evaluations"][-1] and checkpoints.is_dir()
    assert "no checkpoint at iteration(s) [5]" in capsys.readouterr().out
    monkeypatch.setattr(drift, "drift_by_iteration", lambda run_dir, base: {0: 0.0, 5: 1.0, 10: 2.0})
    measured = sweep.with_drift(json.loads(json.dumps(record)), tmp_path / "run", tmp_path)
    assert [e["kl_from_start"] for e in measured["evaluations"]] == [0.0, 1.0, 2.0] and not checkpoints.exists()
    assert json.loads(sweep.run_path(tmp_path, "base", 0).read_text()) == measured
