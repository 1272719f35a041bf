"""examples/custom_reward: its reward, imported by path (not installed), gets its prompt file's column through
ingest and the Scorer, and passes check-reward with the example's own config snippet."""

from pathlib import Path

import pytest

from sage_grpo.core.config_loading import read_yaml
from sage_grpo.core.rewards import RewardSpec, VideoBatch
from sage_grpo.pipeline.check_reward import VideoSize, check_reward, synthetic_videos
from sage_grpo.stages.ingest import DataConfig, ingest
from sage_grpo.stages.score import Scorer

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "custom_reward"


@pytest.fixture(autouse=True)
def example_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    monkeypatch.chdir(REPO)  # the snippet's data.source is relative to the repository


def test_the_example_reward_scores_its_prompts_by_their_target_color_column():
    snippet = read_yaml(EXAMPLE / "reward.yaml")
    prompts = ingest(DataConfig(**snippet["data"], eval_fraction=0.0))
    scorer = Scorer([RewardSpec(**spec) for spec in snippet["rewards"]])
    ids = list(range(len(prompts.train)))
    videos = synthetic_videos(len(ids), VideoSize(num_frames=4, height=16, width=16), seed=1)
    result = scorer.score(videos, [p.text for p in prompts.train], prompts.metadata_for(ids))
    has_target = ["target_color" in p.metadata for p in prompts.train]
    assert has_target.count(False) == 1  # the example holds one prompt without a target
    assert [value is None for value in result.dimensions["color_match"]] == [not t for t in has_target]
    assert [value is None for value in result.total] == [not t for t in has_target]
    assert all(0.0 <= value <= 1.0 for value in result.dimensions["color_match"] if value is not None)
    assert result.weights == {"color_match": 1.0} and all(v is not None for v in result.dimensions["saturation"])


def test_a_video_in_the_target_colour_scores_higher_than_one_in_another():
    import torch

    scorer = Scorer([RewardSpec(name="custom_reward:ColorMatch")])
    orange = torch.tensor([255, 136, 0], dtype=torch.uint8).expand(2, 8, 8, 3).contiguous()
    blue = torch.tensor([0, 0, 255], dtype=torch.uint8).expand(2, 8, 8, 3).contiguous()
    total = scorer.score(
        VideoBatch([orange, blue], fps=24), ["a", "b"], [{"target_color": "#ff8800"}, {"target_color": "#ff8800"}]
    ).total
    assert total[0] > total[1]


def test_the_example_snippet_passes_check_reward():
    lines = []
    assert check_reward(str(EXAMPLE / "reward.yaml"), [], num_videos=4, out=lines.append) == 0
    report = "\n".join(lines)
    assert "metadata columns: target_color" in report
    assert "color_match (weight 1), saturation (reported, not summed)" in report
    assert "(1 None)" in report  # the prompt without a target
