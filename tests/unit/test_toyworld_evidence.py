"""The ToyWorld evidence: held-out captions disjoint from training, the statistics behind every verdict (Welch,
paired, one-sample t, Holm), and the sliding SDE window (``sde.window_schedule``) against its closed-form positions."""

import math
import sys
from pathlib import Path

import pytest

# benchmarks/ is not an installed package: import it from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.toyworld import stats, world  # noqa: E402
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
