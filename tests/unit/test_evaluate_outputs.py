"""What an evaluation hands the tracker: per-prompt scores, key frames, the table rows and the frame grid."""

import math

import numpy as np
import pytest
import torch

from sage_grpo.core.models import build_adapter
from sage_grpo.core.rewards.registry import RewardSpec
from sage_grpo.stages import evaluate as evaluation
from sage_grpo.stages.rollout import SDEConfig
from sage_grpo.stages.score import Scorer

pytestmark = pytest.mark.unit

PROMPTS = ["a red fox runs through snow", "a neon sign", "a cat on a sofa"]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    adapter = build_adapter("tiny-hunyuan15", guidance_scale=1.0)
    scorer = Scorer([RewardSpec(name="brightness")])
    scorer.setup(torch.device("cpu"))
    out = tmp_path_factory.mktemp("eval")
    result = evaluation.evaluate(
        adapter, PROMPTS, SDEConfig(steps=3), scorer, seed=7, out_dir=out, batch_size=1, write_videos=2, write=True
    )
    return adapter, result


def test_evaluation_keeps_each_prompts_scores_and_key_frames(evaluated):
    adapter, result = evaluated
    assert result.prompts == PROMPTS and len(result.videos) == 2
    assert set(result.scores) == {"brightness", "reward"} and len(result.scores["reward"]) == 3
    assert result.metrics["eval/reward"] == pytest.approx(np.mean(result.scores["reward"]))
    assert result.frames.shape == (3, 3, adapter.height, adapter.width, 3) and result.frames.dtype == np.uint8


def test_key_frames_are_first_middle_and_last():
    videos = torch.arange(7, dtype=torch.uint8).view(1, 7, 1, 1, 1).expand(2, 7, 2, 2, 3)
    assert evaluation.key_frames(videos)[:, :, 0, 0, 0].tolist() == [[0, 3, 6], [0, 3, 6]]


def test_table_rows_name_scores_and_video_paths_and_missing_scores_are_null(evaluated):
    _, result = evaluated
    result = evaluation.Evaluation(
        result.metrics, result.videos, result.prompts, {**result.scores, "judge": [0.5, None, math.nan]}, result.frames
    )
    table = evaluation.eval_table(result, 4, "eval/iteration-00004")
    assert table["iteration"] == [4, 4, 4] and table["prompt"] == PROMPTS
    assert table["judge"] == [0.5, None, None] and table["reward"] == pytest.approx(result.scores["reward"])
    assert table["video"][:2] == [f"eval/iteration-00004/{path.name}" for path in result.videos]
    assert table["video"][2] == ""


def test_frame_grid_shows_the_frames_one_row_per_video():
    red = np.zeros((2, 3, 16, 16, 3), dtype=np.uint8)
    red[0, ..., 0] = 255
    red[1, ..., 2] = 255
    one = evaluation.frame_grid(red[:1], ["red"])
    two = evaluation.frame_grid(red, ["red", "blue"])
    assert one.dtype == np.uint8 and one.shape[2] == 3 and two.shape[0] > 1.5 * one.shape[0]
    pure = lambda image, channel: ((image[..., channel] > 240) & (image.sum(-1) < 300)).sum()  # noqa: E731
    assert pure(one, 0) > 0 and pure(one, 2) == 0 and pure(two, 2) > 0


def test_paired_deltas_are_the_mean_difference_over_prompts_both_scored_with_its_standard_error():
    start = {"reward": [0.1, 0.5, None, 0.3], "VQ": [1.0, 2.0, 3.0, 4.0], "gone": [1.0, 1.0, 1.0, 1.0]}
    now = {"reward": [0.2, 0.9, 0.4, math.nan], "VQ": [1.5, 2.5, 3.5, 4.5], "new": [0.0, 0.0, 0.0, 0.0]}
    deltas = evaluation.paired_deltas(start, now)
    differences = [0.1, 0.4]  # the pairs of prompts 0 and 1: prompt 2 failed at the start, prompt 3 now
    assert deltas["eval/reward/delta"] == pytest.approx(0.25)
    assert deltas["eval/reward/delta_se"] == pytest.approx(np.std(differences, ddof=1) / math.sqrt(2))
    # A shift the same on every prompt is known exactly: the paired design cancels the prompts' spread.
    assert deltas["eval/VQ/delta"] == pytest.approx(0.5) and deltas["eval/VQ/delta_se"] == pytest.approx(0.0)
    assert set(deltas) == {"eval/reward/delta", "eval/reward/delta_se", "eval/VQ/delta", "eval/VQ/delta_se"}


def test_a_single_pair_has_a_delta_but_no_standard_error():
    deltas = evaluation.paired_deltas({"reward": [0.1, None]}, {"reward": [0.3, 0.2]})
    assert deltas["eval/reward/delta"] == pytest.approx(0.2) and math.isnan(deltas["eval/reward/delta_se"])
