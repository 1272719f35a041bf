"""The ToyWorld evidence: held-out captions disjoint from training, the statistics behind every verdict (Welch,
paired, one-sample t, Holm), duplicate arms refused, a sweep that resumes from its finished runs, and the sliding
SDE window (``sde.window_schedule``) against its closed-form positions."""

import json
import math
import sys
from pathlib import Path

import pytest

# benchmarks/ is not an installed package: import it from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.toyworld import compare, report, stats, world  # noqa: E402
from sage_grpo.core.errors import UserError  # noqa: E402
from sage_grpo.core.sde import sliding_window  # noqa: E402
from sage_grpo.stages.rollout import SDEConfig  # noqa: E402

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------------------------
# Held-out captions
# ----------------------------------------------------------------------------------------------------------------


def test_held_out_captions_are_disjoint_from_training_and_each_word_is_trained():
    held_out, train = set(world.HELD_OUT_CAPTIONS), set(world.TRAIN_CAPTIONS)
    assert not held_out & train and held_out | train == set(world.CAPTIONS)
    pairs = [world.parse_caption(c) for c in world.HELD_OUT_CAPTIONS]
    # A Latin square: every colour and every direction held out exactly once, so each is trained with 3 others.
    assert sorted(c for c, _ in pairs) == sorted(world.COLOURS) and sorted(d for _, d in pairs) == sorted(
        world.DIRECTIONS
    )
    trained_pairs = [world.parse_caption(c) for c in world.TRAIN_CAPTIONS]
    assert all(sum(c == colour for c, _ in trained_pairs) == 3 for colour in world.COLOURS)
    assert all(sum(d == direction for _, d in trained_pairs) == 3 for direction in world.DIRECTIONS)


def test_the_default_rolls_out_only_training_captions_and_evaluates_the_held_out_ones():
    config = compare.Config()
    assert set(config.captions) == set(world.TRAIN_CAPTIONS)
    assert set(config.eval_captions) == set(world.HELD_OUT_CAPTIONS)


# ----------------------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------------------


def test_one_sample_t_reproduces_the_issue_headline():
    """The earlier sweep's default gains: t = 3.41, df = 5, p = 0.019 (issue 29 recomputed them by hand)."""
    test = stats.one_sample([0.0249, 0.0515, 0.0217, 0.0017, 0.0142, 0.048])
    assert test["t"] == pytest.approx(3.41, abs=0.01) and test["df"] == 5
    assert test["p"] == pytest.approx(0.019, abs=0.0005)


@pytest.mark.parametrize(
    ("t", "df", "p"), [(2.570582, 5, 0.05), (4.032143, 5, 0.01), (12.7062, 1, 0.05), (1.959964, 1e6, 0.05)]
)
def test_two_sided_p_at_tabulated_t_quantiles(t, df, p):
    assert stats.welch([0.0, 1.0], [0.0, 1.0])["t"] == 0.0  # equal samples: t = 0
    assert stats._two_sided(t, df) == pytest.approx(p, rel=1e-4)
    assert stats._two_sided(-t, df) == pytest.approx(p, rel=1e-4)


def test_welch_uses_the_welch_satterthwaite_degrees_of_freedom():
    x, y = [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0, 10.0]
    vx, vy = (5 / 3) / 4, 10.0 / 5  # sample variances over n
    test = stats.welch(x, y)
    assert test["difference"] == -3.5 and test["se"] == pytest.approx(math.sqrt(vx + vy))
    assert test["t"] == pytest.approx(-3.5 / math.sqrt(vx + vy))
    assert test["df"] == pytest.approx((vx + vy) ** 2 / (vx**2 / 3 + vy**2 / 4))
    assert (test["t"], test["df"]) == (pytest.approx(-2.2514, abs=1e-4), pytest.approx(5.5208, abs=1e-4))
    assert test["p"] == pytest.approx(0.0691, abs=2e-4)  # between the tabulated 0.05 (2.50) and 0.10 (1.96) at df 5.5


def test_welch_needs_two_values_a_side_and_no_spread_gives_no_p():
    assert stats.welch([1.0], [1.0, 2.0]) is None
    assert math.isnan(stats.welch([1.0, 1.0], [2.0, 2.0])["p"])
    assert stats.welch([1.0, float("nan"), 2.0], [3.0, 4.0])["n"] == 4  # NaN (e.g. never reached) is left out


def test_paired_test_uses_only_the_shared_seeds():
    x = {0: 1.0, 1: 2.0, 2: 3.5, 3: 9.0}
    y = {0: 0.5, 1: 1.0, 2: 2.0}
    test = stats.paired(x, y)
    assert test["n"] == 3 and test["difference"] == pytest.approx((0.5 + 1.0 + 1.5) / 3)
    assert stats.paired({0: 1.0}, {0: 2.0}) is None


def test_holm_adjusts_step_down_and_keeps_nan_out_of_the_count():
    # sorted 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 -> max(0.06, 0.04) = 0.06
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    adjusted = stats.holm([0.02, float("nan"), 0.5])
    assert adjusted[0] == pytest.approx(0.04) and math.isnan(adjusted[1]) and adjusted[2] == 0.5
    assert stats.holm([0.9, 0.8]) == [1.0, 1.0]


def _fake_run(arm: str, seed: int, gain: float, drift: float = 0.1, vq: float = 0.0) -> dict:
    before = {"reward": 0.8, "TA": 0.4, "VQ": 0.6, "MQ": 0.2, "colour": 0.8, "direction": 0.1, "drift": 0.13}
    middle = dict(before, reward=0.8 + gain / 2)
    after = dict(before, reward=0.8 + gain, TA=0.4 + gain, VQ=0.6 + vq)
    history = [{"drift": drift, "reward": 0.8, "kl_grad_ratio/position": 0.003, "lambda_kl": 0.4}] * 4
    return {
        "arm": arm,
        "seed": seed,
        "config": dataclass_config(),
        "train_s": 8.0,
        "wall_s": 10.0,
        "history": history,
        "evaluations": [
            dict(before, iteration=0, train_s=0.0, train=before),
            dict(middle, iteration=2, train_s=4.0, train=middle),
            dict(after, iteration=4, train_s=8.0, train=dict(after, reward=0.8 + 2 * gain)),
        ],
    }


def dataclass_config() -> dict:
    import dataclasses

    return json.loads(json.dumps(dataclasses.asdict(compare.Config())))


def _fake_sweep() -> list[dict]:
    runs = [_fake_run("default", s, g) for s, g in enumerate([0.05, 0.06, 0.055, 0.052, 0.058, 0.051])]
    runs += [_fake_run(report.HEADLINE_ARM, s, g) for s, g in enumerate([0.11, 0.12, 0.115, 0.112, 0.118, 0.111])]
    runs += [_fake_run("kl none", s, g, vq=-0.2 - s / 100) for s, g in enumerate([0.0, 0.01, -0.01])]  # below
    runs += [_fake_run("kl fixed", s, g) for s, g in enumerate([0.0, 0.1, 0.06])]  # overlaps the default
    runs += [_fake_run("flow 20 steps shift 5", s, 0.0, drift=d) for s, d in enumerate([0.10, 0.11, 0.12])]
    runs += [_fake_run("sage 20 steps shift 5", s, 0.0, drift=d) for s, d in enumerate([0.20, 0.21, 0.22])]
    return runs


def test_verdicts_follow_welch_and_holm():
    claims = {c["claim"]: c for c in report.verdicts(report.summarise(_fake_sweep()))}
    learning = claims[report.CLAIMS[0].text]
    assert learning["verdict"] == "agrees" and learning["test"] == "one-sample t" and learning["df"] == 5
    none = claims["The moving trust region gains more reward than no KL"]
    assert none["verdict"] == "agrees" and none["test"] == "Welch t" and none["p_holm"] >= none["p"]
    assert none["paired"]["n"] == 3  # the seeds both arms ran
    assert claims["The moving trust region keeps VQ higher than no KL (VQ gain)"]["verdict"] == "agrees"
    assert claims["The dual trust region gains more reward than a fixed anchor"]["verdict"] == "not run"
    # SAGE's rollouts drift more here: the manifold claim is contradicted, not confirmed.
    (manifold,) = [c for c in report.CLAIMS if c.text.startswith("SAGE's manifold-aware noise")]
    assert claims[manifold.text]["verdict"] == "disagrees"
    ran = [c for c in claims.values() if c["verdict"] != "not run"]
    assert [c["p_holm"] for c in ran] == pytest.approx(stats.holm([c["p"] for c in ran]), nan_ok=True)


def test_a_raw_p_below_alpha_is_not_a_verdict_when_holm_lifts_it():
    runs = [_fake_run("default", s, g) for s, g in enumerate([0.005, 0.03, 0.02, 0.02])]  # one-sample p = 0.036
    runs += [_fake_run("kl none", s, g) for s, g in enumerate([0.01, 0.03, 0.02])]  # about the same: p ~ 0.7
    summary = report.summarise(runs)
    gain = report.Claim("gain", "default", None, "reward gain")
    (alone,) = report.verdicts(summary, [gain])
    assert alone["p"] == alone["p_holm"] == pytest.approx(0.0358, abs=1e-4) and alone["verdict"] == "agrees"
    with_another = report.verdicts(summary, [gain, report.Claim("vs none", "default", "kl none", "reward gain")])
    assert with_another[0]["p_holm"] == pytest.approx(2 * alone["p"]) and with_another[0]["verdict"] == "inconclusive"


def test_the_headline_is_tested_at_every_evaluation_on_both_caption_sets():
    runs = _fake_sweep()
    held_out, train = report.by_evaluation(runs, "default"), report.by_evaluation(runs, "default", "train")
    assert [row["iteration"] for row in held_out] == [0, 2, 4] and held_out[0]["test"] is None
    assert held_out[2]["test"]["difference"] == pytest.approx(0.0543, abs=1e-4)
    assert held_out[1]["test"]["t"] == pytest.approx(held_out[2]["test"]["t"])  # half the gain, half the spread
    assert train[2]["test"]["difference"] == pytest.approx(2 * held_out[2]["test"]["difference"])


def test_the_headline_is_held_to_the_bar_of_a_decisive_default():
    runs = _fake_sweep()  # the headline gains 0.11-0.12 with the direction unchanged; p < 0.01 from the midpoint
    text = report.decisiveness(runs)
    assert "bar: below 0.01 at every evaluation: met" in text and "(bar: 0.1: met)" in text
    assert "x1.00 (bar: x2: not met)" in text and "Over 6 seeds, from the midpoint (iteration 2)" in text
    small = [dict(run, arm=report.HEADLINE_ARM) for run in runs if run["arm"] == "default"]  # gains ~0.05
    assert "(bar: 0.1: not met)" in report.decisiveness(small)
    assert report.decisiveness([]) == "It has not run."
    fell = [dict(run, arm=report.HEADLINE_ARM) for run in runs if run["arm"] == "kl none"]  # VQ -0.20, -0.21, -0.22
    assert "mean change): MQ +0.000, VQ -0.210, colour +0.000, direction +0.000." in report.decisiveness(fell)


def test_the_pilot_table_shows_each_candidate_along_its_run():
    pilot = {"command": "python -m benchmarks.toyworld.compare --collect", "runs": [_fake_run("lr 0.001", 0, -0.3)]}
    for evaluation in pilot["runs"][0]["evaluations"]:
        evaluation["iteration"] *= 5  # evaluations at 0, 10, 20
    text = report.pilot_section(pilot, "benchmarks/toyworld/results/pilot", base=_fake_run("default", 0, 0.0))
    assert "| lr 0.001 | 4 | 0.800 → 0.650 → 0.500 | +0.000 | +0.000 | 0.400 |" in text
    assert text.index("| default | 4 | 0.800 |") < text.index("| lr 0.001 |")  # the base first, at the same seed


def test_an_arms_update_settings_reach_the_updater_config():
    config = compare.ARMS[report.HEADLINE_ARM].config(compare.Config())
    update = compare.update_config_of(config)
    assert config.iterations == 180 and update.lr_warmup_steps == 10 and update.micro_batch_size == 96
    reused = compare.update_config_of(compare.PILOT_ARMS["4 updates per rollout"].config(compare.Config()))
    assert reused.updates_per_rollout == 4 and reused.accumulation_steps(96, 4) == 1


def test_the_sweep_wall_time_counts_overlapping_sittings_once_and_gaps_not_at_all():
    sittings = [
        {"started": "2026-12-05T11:00:00Z", "wall_s": 600.0},  # 11:00-11:10
        {"started": "2026-12-05T11:05:00Z", "wall_s": 600.0},  # 11:05-11:15, overlaps the first
        {"started": "2026-12-05T12:00:00Z", "wall_s": 60.0},  # after an hour's gap
    ]
    assert report.elapsed(sittings) == 15 * 60 + 60
    assert report.elapsed(sittings[:1]) == 600.0


def test_collapse_counts_seeds_whose_vq_fell_past_the_stated_amount():
    summary = report.summarise(_fake_sweep())
    assert summary["kl none"]["collapsed"]["mean"] == 1.0 and summary["default"]["collapsed"]["mean"] == 0.0


def test_report_writes_tests_headline_and_the_earlier_sweep(tmp_path):
    earlier = {
        "command": "python -m benchmarks.toyworld.compare --jobs 2",
        "wall_s": 600.0,
        "jobs": 2,
        "machine": {"cpus": 2},
        "runs": [{**_fake_run("equalizer off", s, g), "config": {}} for s, g in enumerate([0.0, 0.01, 0.02])]
        + [{**_fake_run("default", s, g), "config": {}} for s, g in enumerate([0.03, 0.04, 0.05])],
    }
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    sitting = {"wall_s": 120.0, "jobs": 1, "cpus": 2, "torch": "x", "load_average_at_start": [3.0, 3.0, 3.0]}
    saved = {
        "profile": "custom",
        "command": "python -m benchmarks.toyworld.compare --arms default",
        "sittings": [
            sitting | {"started": "2026-12-05T11:00:00Z", "load_average_at_end": [4.0, 5.0, 5.0]},
            sitting | {"started": "2026-12-05T12:00:00Z", "load_average_at_end": [2, 2, 2], "command": "first"},
        ],
        "runs": _fake_sweep(),
    }
    md = tmp_path / "RESULTS.md"
    md.write_text(f"# Results\n\n{report.BEGIN}\nold\n{report.END}\n\n## Other\n")
    report.write(saved, tmp_path / "out", md, earlier_path=tmp_path / "earlier.json")
    text = md.read_text()
    assert "| claim | verdict | difference ± SE | test | t (df) | p | Holm p |" in text
    assert "wall time **4.0 min** over 2 sitting(s)" in text and "load average 2.0-5.0" in text
    assert "### The learning claim at every evaluation" in text
    assert (
        "    first\n    python -m benchmarks.toyworld.compare --arms default\n" in text
    )  # the sittings', then the report's
    assert "Earlier sweep" in text and "| equalizer off | 3 |" in text and text.endswith("## Other\n")
    assert (tmp_path / "out" / "curves.png").stat().st_size > 0
    saved_back = json.loads((tmp_path / "out" / "results.json").read_text())  # NaN stored as null: valid JSON
    assert saved_back["verdicts"][0]["verdict"] == "agrees"
    scratch = tmp_path / "scratch.md"  # a report to a file that does not exist yet holds the section alone
    report.write(saved, tmp_path / "out", scratch, earlier_path=tmp_path / "earlier.json")
    assert scratch.read_text().startswith(report.BEGIN) and scratch.read_text().endswith(report.END)


# ----------------------------------------------------------------------------------------------------------------
# One row per experiment, and a sweep that resumes
# ----------------------------------------------------------------------------------------------------------------


def test_experiment_resolves_defaults_and_settings_that_cannot_act():
    Config = compare.Config
    key = compare.experiment
    assert key(Config(kl="dual", anchor_interval=1)) == key(Config(kl="step_wise"))  # were bit-identical
    assert key(Config(kl="moving", anchor_interval=1)) == key(Config(kl="none"))
    assert key(Config(variant="cps", eta=0.5)) == key(Config(variant="cps"))  # CPS's own eta is 0.5
    assert key(Config(kl="fixed", anchor_interval=5)) == key(Config(kl="fixed"))  # a fixed anchor never refreshes
    assert key(Config(window_every=2)) == key(Config())  # only a sliding window moves
    assert key(Config(anchor_interval=5)) != key(Config())
    assert key(Config(window="sliding", window_every=2)) != key(Config(window="sliding"))


def test_every_shipped_arm_is_a_distinct_experiment():
    compare.check_distinct(list(compare.ALL_ARMS), compare.Config())
    assert not compare.ARMS.keys() & compare.PILOT_ARMS.keys()  # the full sweep leaves the pilot out


def test_duplicate_arms_are_refused_in_one_line_naming_both(monkeypatch, capsys):
    monkeypatch.setitem(compare.ALL_ARMS, "anchor N=1", compare._arm("anchor N=1", anchor_interval=1))
    monkeypatch.setattr(sys, "argv", ["compare", "--arms", "kl none", "anchor N=1", "--out", "/nonexistent"])
    with pytest.raises(SystemExit) as stopped:
        compare.main()
    assert stopped.value.code == UserError.exit_code
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "'kl none'" in error and "'anchor N=1'" in error


def test_a_finished_run_is_reused_only_for_the_same_experiment(tmp_path):
    config = compare.Config()
    path = compare.run_path(tmp_path, "kl none", 2)
    assert compare.finished(tmp_path, "kl none", config, 2) is None
    compare.write_atomically(path, json.dumps({"seed": 2, "experiment": compare.experiment(config)}))
    assert compare.finished(tmp_path, "kl none", config, 2)["seed"] == 2
    assert compare.finished(tmp_path, "kl none", compare.Config(learning_rate=3e-4), 2) is None  # changed: rerun
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left behind


def test_jobs_run_seed_by_seed_so_a_cut_sweep_stays_paired():
    jobs = compare._jobs(["default", "equalizer cap"], 2, compare.Config())  # 4 seeds of the base, 2 of the cap
    assert [(arm, seed) for arm, _, seed in jobs] == [
        ("default", 0),
        ("equalizer cap", 0),
        ("default", 1),
        ("equalizer cap", 1),
        ("default", 2),
        ("default", 3),
    ]


# ----------------------------------------------------------------------------------------------------------------
# The sliding SDE window
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("window", "steps", "every", "expected"),
    [
        # start (s0 + i // every) mod (steps - size): sizes 4 of 8 -> starts 0..3, the last step never covered
        ((0, 4), 8, 5, {0: (0, 4), 4: (0, 4), 5: (1, 5), 15: (3, 7), 20: (0, 4), 27: (1, 5)}),
        ((2, 3), 20, 1, {0: (2, 3), 16: (18, 19), 17: (0, 1), 19: (2, 3)}),
        ((1, 3), 5, 2, {0: (1, 3), 1: (1, 3), 2: (2, 4), 4: (0, 2), 6: (1, 3)}),
    ],
)
def test_sliding_window_positions_match_the_closed_form(window, steps, every, expected):
    for iteration, position in expected.items():
        assert sliding_window(window, steps, iteration, every) == position, iteration


@pytest.mark.parametrize(
    ("window", "steps", "every", "iteration", "message"),
    [
        ((0, 7), 8, 1, 0, "nowhere to slide"),
        ((4, 8), 8, 1, 0, "covers the last step"),
        ((0, 9), 8, 1, 0, "0 <= start < end <= steps=8"),
        ((0, 2), 8, 0, 0, "every=0"),
        ((0, 2), 8, 1, -1, "iteration must be >= 0"),
    ],
)
def test_sliding_window_refuses_bad_values(window, steps, every, iteration, message):
    with pytest.raises(ValueError, match=message):
        sliding_window(window, steps, iteration, every)


def test_sde_config_applies_the_window_of_the_iteration_and_trains_the_same_count_everywhere():
    config = SDEConfig(variant="sage", steps=8, shift=3.0, window=(0, 4), window_schedule="sliding", window_every=5)
    windows = [config.at_iteration(i).window for i in range(0, 40, 5)]
    assert windows == [(0, 4), (1, 5), (2, 6), (3, 7)] * 2
    assert {int(config.at_iteration(i).trained_steps_mask().sum()) for i in range(0, 20, 5)} == {4}
    assert config.at_iteration(7).trained_steps_mask().tolist() == [False] + [True] * 4 + [False] * 3
    fixed = SDEConfig(steps=8, window=(0, 4))
    assert fixed.at_iteration(123) is fixed


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sde.window_schedule=sliding"], "sde: sde.window_schedule=sliding needs sde.window"),
        (["sde.window=[0,7]", "sde.window_schedule=sliding"], "nowhere to slide"),
        (["sde.window=[0,4]", "sde.window_schedule=slide"], "sde.window_schedule: Input should be"),
        (["sde.window=[0,4]", "sde.window_schedule=sliding", "sde.window_every=0"], "sde.window_every"),
    ],
)
def test_a_bad_sliding_window_in_the_run_config_is_one_line(overrides, message):
    from sage_grpo.pipeline.config import load_run_config

    with pytest.raises(UserError) as error:
        load_run_config(REPO / "configs" / "demo.yaml", overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_demo_config_takes_a_sliding_window():
    from sage_grpo.pipeline.config import load_run_config

    config = load_run_config(REPO / "configs" / "demo.yaml", ["sde.window=[0,2]", "sde.window_schedule=sliding"])
    assert config.sde.at_iteration(0).window == (0, 2) and config.sde.at_iteration(1).window == (1, 3)


def test_the_advantage_normalisation_arms_differ_and_the_recorded_runs_still_count_as_finished():
    from benchmarks.toyworld.compare import ARMS, DEFAULT_OUT, Config, experiment, finished

    base = Config()
    group, everyone = (ARMS[f"G=4 {scope} std"].config(base) for scope in ("group", "global"))
    assert group.group_size == everyone.group_size == 4
    assert experiment(group) != experiment(everyone)
    recorded = {(json.loads(path.read_text())["arm"], path) for path in (DEFAULT_OUT / "runs").glob("*-seed*.json")}
    assert recorded, "the held-out sweep's runs are committed"
    for arm, path in recorded:
        seed = int(path.stem.rsplit("-seed", 1)[1])
        assert finished(DEFAULT_OUT, arm, ARMS[arm].config(base), seed) is not None, path.name
