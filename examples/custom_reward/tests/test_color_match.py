"""ColorMatch on hand-made videos (sage-grpo's VideoBatch) and through sage-grpo's Scorer, as a run calls it."""

import pytest
import torch
from custom_reward import ColorMatch

from sage_grpo.core.rewards import RewardSpec, VideoBatch
from sage_grpo.stages.score import Scorer


def solid(rgb, frames=4, size=8):
    return torch.tensor(rgb, dtype=torch.uint8).expand(frames, size, size, 3).contiguous()


def test_the_closer_the_colour_the_higher_the_score_and_no_target_no_score():
    videos = VideoBatch([solid([255, 136, 0]), solid([0, 0, 255]), solid([255, 136, 0])], fps=24)
    scores = ColorMatch()(videos, ["a", "b", "c"], target_color=["#ff8800", "#ff8800", None])
    assert scores["color_match"][0] == pytest.approx(1.0)
    assert 0.0 <= scores["color_match"][1] < 0.5
    assert scores["color_match"][2] is None
    assert scores["saturation"] == pytest.approx([1.0, 1.0, 1.0])


def test_the_scorer_passes_the_column_and_leaves_saturation_out_of_the_total():
    scorer = Scorer([RewardSpec(name="custom_reward:ColorMatch", kwargs={"frames": 2})])
    videos = VideoBatch([solid([255, 136, 0]), solid([128, 128, 128])], fps=24)
    result = scorer.score(videos, ["warm", "grey"], [{"target_color": "#ff8800"}, {"target_color": "#808080"}])
    assert result.weights == {"color_match": 1.0}
    assert result.total == pytest.approx([1.0, 1.0], abs=1e-2)
    assert result.dimensions["saturation"] == pytest.approx([1.0, 0.0])


def test_a_malformed_colour_names_itself():
    with pytest.raises(ValueError, match="'orange' is not of the form #rrggbb"):
        ColorMatch()(VideoBatch([solid([0, 0, 0])], fps=24), ["a"], target_color=["orange"])
