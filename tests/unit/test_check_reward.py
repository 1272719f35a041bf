"""``check-reward``: a reward is imported, built and called on synthetic videos of the configured size with the data
source's prompts and columns; bad rewards are one-line errors."""

import json
from pathlib import Path

import pytest
import yaml

from sage_grpo.core.errors import UserError
from sage_grpo.pipeline.check_reward import VideoSize, check_reward, parse_size, synthetic_videos
from sage_grpo.stages.score import RewardFailure

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture(autouse=True)
def user_rewards_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def run_config(tmp_path, rewards, model_kwargs=None, styles=("anime", "anime", "real")):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"prompt {i}", "style": style}) + "\n" for i, style in enumerate(styles))
    )
    config = {
        "rewards": rewards,
        "data": {"source": str(data), "eval_fraction": 0.0},
        "model": {"name": "tiny-hunyuan15", "kwargs": model_kwargs or {}},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def check(target, overrides=(), **options):
    lines = []
    assert check_reward(target, list(overrides), out=lines.append, **options) == 0
    return "\n".join(lines)


def test_a_config_reward_gets_the_sources_prompts_and_columns_and_is_reported(tmp_path):
    config = run_config(tmp_path, [{"name": "user_rewards.kit:StyleMatch", "kwargs": {"wanted": "anime"}}])
    report = check(config, num_videos=3)
    assert "metadata columns: style" in report
    assert "style_match (weight 1)" in report
    assert "style_match min 0  mean 0.6667  max 1  (no None)" in report  # anime, anime, real
    assert "s/video" in report and "peak RSS" in report


def test_videos_have_the_configured_size_else_the_defaults(tmp_path):
    config = run_config(
        tmp_path,
        [{"name": "user_rewards.kit:Shape", "weights": {}}],
        model_kwargs={"num_frames": 3, "height": 16, "width": 24},
    )
    report = check(config, num_videos=2)
    assert "frames      min 3  mean 3  max 3" in report and "width       min 24" in report
    assert "(reported, not summed)" in report
    assert "height      min 64" in check("user_rewards.kit:Shape", ["weights={}"], num_videos=1)


def test_a_spec_with_overrides_and_another_data_source(tmp_path):
    config = run_config(tmp_path, [{"name": "brightness"}], styles=("real", "real"))
    data = yaml.safe_load(Path(config).read_text())["data"]["source"]
    report = check("user_rewards.kit:StyleMatch", ["kwargs.wanted=real", "batch_size=1"], data=data, num_videos=2)
    assert "style_match min 1  mean 1  max 1" in report and "prompts from " + data in report


def test_synthetic_videos_differ_between_videos_and_over_time():
    videos = synthetic_videos(2, VideoSize(num_frames=3, height=8, width=8), seed=0)
    assert videos.fps == 24.0 and videos[0].shape == (3, 8, 8, 3)
    assert not (videos[0] == videos[1]).all() and not (videos[0][0] == videos[0][2]).all()


@pytest.mark.parametrize(
    "target, overrides, error, message",
    [
        ("user_rewards.kit:Nope", [], UserError, "cannot load reward 'user_rewards.kit:Nope'"),
        ("brightness", ["kwargs.traget=1"], UserError, "kwargs: got an unexpected keyword argument"),
        ("user_rewards.kit:StyleMatch", [], UserError, "needs the prompt column(s) style"),
        ("user_rewards.safety:WrongLength", [], UserError, "has 3 scores for 4 videos"),
        ("user_rewards.kit:NeverScores", [], UserError, "scored none of the 4 videos"),
        ("user_rewards.kit:Judge", [], UserError, "reports 2 dimensions (judge, judge_confidence) and no weights"),
        ("user_rewards.kit:Exits", ["weights={}"], RewardFailure, "failed for 4 of 4 samples"),
    ],
)
def test_a_bad_reward_is_one_line(target, overrides, error, message):
    with pytest.raises(error) as raised:
        check(target, overrides)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_rewards_only_file_is_checked_too(tmp_path):
    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump({"rewards": [{"name": "brightness"}, {"name": "colorfulness"}], "port": 8000}))
    report = check(str(path), num_videos=1)
    assert "reward 'brightness': ok" in report and "reward 'colorfulness': ok" in report


def test_a_size_from_the_command_line():
    assert parse_size("3x16X24", fps=8) == VideoSize(num_frames=3, height=16, width=24, fps=8)
    for bad in ("3x16", "ax16x24", "0x16x24"):
        with pytest.raises(UserError):
            parse_size(bad)
