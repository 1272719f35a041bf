"""VideoAlign's scoring forward traced on fake tensors (``memory_trace.trace_videoalign``): the hand-written forward
is the model's, and its traced peak is the one measured on real tensors."""

import pytest
import torch

from benchmarks.traced_block_check import profiled_cpu_peak
from sage_grpo.core import memory_trace
from sage_grpo.core.rewards import videoalign
from sage_grpo.core.rewards.base import VideoBatch

pytestmark = pytest.mark.unit


def _inputs(reward: videoalign.VideoAlign):
    """Two 9-frame videos at 8 fps and their prompts, as ``VideoAlign.prepare_inputs`` makes them, and their grid."""
    videos = torch.randint(0, 256, (2, 9, 64, 96, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    inputs = reward.prepare_inputs(VideoBatch(videos, fps=8), ["a cat", "a dog runs"])
    grid = tuple(inputs["video_grid_thw"][0].tolist())
    vision = memory_trace.videoalign_vision_inputs(grid, 2, videoalign.MERGE_SIZE)
    return inputs, vision


def test_the_fake_tensor_forward_is_the_models_forward():
    reward = videoalign.tiny_videoalign()
    inputs, vision = _inputs(reward)
    with torch.no_grad():
        expected = reward.model(**inputs)
        values = memory_trace.videoalign_forward(
            reward.model, inputs["input_ids"], inputs["attention_mask"], inputs["pixel_values_videos"], vision
        )
    at_reward_tokens = [(inputs["input_ids"] == token).float().argmax(dim=1) for token in reward.model.reward_token_ids]
    torch.testing.assert_close(values.gather(1, torch.stack(at_reward_tokens, dim=1)), expected)


def test_the_traced_scoring_peak_of_the_tiny_model_is_the_measured_one():
    reward = videoalign.tiny_videoalign()
    inputs, _ = _inputs(reward)
    measured = profiled_cpu_peak(lambda: torch.no_grad()(reward.model)(**inputs))
    frames, height, width = (int(n) for n in inputs["video_grid_thw"][0] * torch.tensor([2, 14, 14]))
    text_tokens = inputs["input_ids"].shape[1] - frames * height * width // (2 * 14 * 14 * 4)
    config = reward.model.vlm.config.to_dict()
    call = memory_trace.ScoringCall(2, frames, height, width, text_tokens)
    traced = memory_trace.trace_videoalign(config, call, dtype=torch.float32)
    assert traced.peak == pytest.approx(measured, rel=0.15)
