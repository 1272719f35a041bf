"""``check-reward``'s sensitivity table: the same videos perturbed (frames, fps, resolution, brightness,
saturation), the reward's response per dimension, and the perturbation that games its total."""

from pathlib import Path

import pytest
import torch

from sage_grpo.core.rewards import VideoBatch
from sage_grpo.pipeline.check_reward import PERTURBATIONS, VideoSize, check_reward, mean_change, synthetic_videos

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture(autouse=True)
def user_rewards_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def report(target, overrides=(), **options) -> dict[str, list[str]]:
    """The sensitivity table's rows by perturbation, each row's cells; and the other lines under "lines"."""
    lines = []
    check_reward(target, list(overrides), out=lines.append, num_videos=2, size=VideoSize(4, 8, 6, 10.0), **options)
    text = "\n".join(lines).splitlines()
    rows = {line.strip()[:16].strip(): line.strip()[16:].split() for line in text if line.startswith("    ")}
    return rows | {"lines": text}


def test_each_perturbation_changes_its_own_dimension_by_its_closed_form():
    rows = report("user_rewards.kit:Shape", ["weights={}"])
    assert rows["perturbation"] == ["frames", "height", "width"]  # reported only: no total column
    assert rows["frames x2"] == ["+4", "+0", "+0"] and rows["frames /2"] == ["-2", "+0", "+0"]
    assert rows["resolution x2"] == ["+0", "+8", "+6"] and rows["resolution /2"] == ["+0", "-4", "-3"]
    assert rows["fps x2"] == ["+0", "+0", "+0"] and rows["brightness x1.3"] == ["+0", "+0", "+0"]
    assert not any(line.startswith("  gameable") for line in rows["lines"])


def test_a_brightness_reward_is_gamed_by_exposure_and_not_by_frames_or_fps():
    rows = report("brightness")
    assert rows["perturbation"] == ["total", "brightness"]
    assert float(rows["brightness x1.3"][0]) > 0.05 and float(rows["brightness x0.7"][0]) < -0.05
    assert rows["fps x2"] == ["+0", "+0"] and abs(float(rows["frames x2"][0])) < 1e-6
    assert "  gameable    brightness x1.3 raises the total by +" in "\n".join(rows["lines"])


def test_sensitivity_can_be_skipped():
    assert "perturbation" not in report("brightness", sensitivity=False)


def test_perturbations_keep_the_videos_and_change_one_thing():
    videos = synthetic_videos(2, VideoSize(4, 8, 6, 10.0), seed=0)
    shapes = {name: (len(p := perturb(videos)), p[0].shape, p.fps) for name, perturb in PERTURBATIONS.items()}
    assert shapes["frames x2"] == (2, (8, 8, 6, 3), 10.0) and shapes["fps /2"] == (2, (4, 8, 6, 3), 5.0)
    assert shapes["resolution /2"] == (2, (4, 4, 3, 3), 10.0)
    grey = PERTURBATIONS["saturation x0.5"](VideoBatch([torch.full((1, 2, 2, 3), 128, dtype=torch.uint8)], 1.0))
    assert (grey[0] == 128).all()  # grey has no saturation to change
    assert mean_change([1.0, None, 3.0], [0.5, 2.0, None]) == 0.5 and mean_change([None], [1.0]) is None
