"""The reward contract, weighting, failure handling, and the built-in rewards on tiny random models."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import BaseModel, ValidationError

from sage_grpo.core.config_loading import validate
from sage_grpo.core.errors import UserError
from sage_grpo.core.grpo import group_advantages
from sage_grpo.core.rewards import RewardSpec, VideoBatch, build_reward, videoalign
from sage_grpo.core.rewards.clip import tiny_clipscore, tiny_pickscore
from sage_grpo.core.rewards.frames import sampled_frame_count, smart_resize, uniform_frame_indices
from sage_grpo.stages.score import Scorer

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture(autouse=True)
def user_rewards_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


class _Rewards(BaseModel):
    rewards: list[RewardSpec]


def videos(count=4, frames=8, height=32, width=48, fps=8.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return VideoBatch(
        [
            torch.randint(0, 256, (frames, height, width, 3), dtype=torch.uint8, generator=generator)
            for _ in range(count)
        ],
        fps,
    )


def constant_video(value, frames=4, size=16):
    return torch.full((frames, size, size, 3), value, dtype=torch.uint8)


def scorer(*specs, retries=2, max_failed_fraction=0.5):
    return Scorer(
        [RewardSpec(**spec) for spec in specs],
        retries=retries,
        retry_delay_s=0.0,
        max_failed_fraction=max_failed_fraction,
    )


def test_video_batch_is_a_list_of_uint8_videos_with_an_fps():
    stacked = torch.zeros(3, 4, 8, 8, 3, dtype=torch.uint8)
    batch = VideoBatch.from_tensor(stacked, fps=24)
    assert len(batch) == 3 and batch[0].shape == (4, 8, 8, 3)
    assert isinstance(batch[1:], VideoBatch) and len(batch[1:]) == 2 and batch[1:].fps == 24
    with pytest.raises(ValueError, match="uint8"):
        VideoBatch([stacked[0].float()], fps=24)


# ----------------------------------------------------------------------------------------------------------------
# Config, registry and weighting
# ----------------------------------------------------------------------------------------------------------------


def test_user_reward_by_dotted_path_is_loaded_weighted_and_reported():
    batch = VideoBatch([constant_video(255), constant_video(0), constant_video(255)], fps=8)
    prompts = ["a cat", "blood everywhere", "a dog in the park"]
    result = scorer(
        {"name": "user_rewards.safety:KeywordSafety", "kwargs": {"banned": "blood"}, "weights": {"safety": 2.0}},
        {"name": "brightness"},
    ).score(batch, prompts)
    assert result.dimensions["safety"] == [1.0, 0.0, 1.0]
    assert result.dimensions["prompt_words"] == [2, 2, 5]  # reported, not weighted
    assert result.dimensions["brightness"] == pytest.approx([0.0, -1.0, 0.0])
    assert result.total == pytest.approx([2.0, -1.0, 2.0])
    assert result.failed == {}


def test_weight_presets_are_the_papers_settings():
    spec = "tiny-videoalign"  # the real videoalign needs model paths to validate
    assert RewardSpec(name=spec, weights="setting_a").explicit_weights() == {"VQ": 1.0, "MQ": 1.0, "TA": 1.0}
    assert RewardSpec(name=spec, weights="setting_b").explicit_weights() == {"VQ": 0.5, "MQ": 0.5, "TA": 1.0}
    with pytest.raises(ValidationError, match="setting_c"):
        RewardSpec(name=spec, weights="setting_c")


def test_empty_weights_report_without_weighting():
    result = scorer(
        {"name": "brightness", "weights": {}}, {"name": "user_rewards.safety:KeywordSafety", "weights": {"safety": 1.0}}
    ).score(videos(2), ["a", "b"])
    assert "brightness" in result.dimensions
    assert result.total == [1.0, 1.0]


def test_weighting_a_dimension_the_reward_lacks_is_a_user_error():
    with pytest.raises(UserError, match=r"'brightness' has no dimension\(s\) MQ, TA, VQ"):
        scorer({"name": "brightness", "weights": "setting_a"}).score(videos(2), ["a", "b"])


@pytest.mark.parametrize(
    "spec, key, message",
    [
        ({"name": "no_such_reward"}, "rewards.0.name", "unknown reward 'no_such_reward'"),
        ({"name": "user_rewards.safety:Missing"}, "rewards.0.name", "cannot load reward 'user_rewards.safety:Missing'"),
        ({"name": "no_such_package.rewards:Safety"}, "rewards.0.name", "No module named 'no_such_package'"),
        ({"name": "brightness", "kwargs": {"traget": 0.5}}, "rewards.0.kwargs", "unexpected keyword argument 'traget'"),
        ({"name": "remote"}, "rewards.0.kwargs", "missing a required argument: 'url'"),
    ],
)
def test_reward_specs_are_resolved_and_bound_when_the_config_is_validated(spec, key, message):
    with pytest.raises(UserError) as error:
        validate(_Rewards, {"rewards": [spec]})
    assert f"{key}: " in str(error.value) and message in str(error.value) and "\n" not in str(error.value)


def test_a_kwargs_value_the_constructor_rejects_is_a_one_line_user_error():
    # remote checks batch_size in its constructor only (brightness's range is in its signature: checked at config
    # time, tests/unit/test_reward_kwarg_ranges.py).
    with pytest.raises(UserError, match=r"^reward 'remote': remote reward needs batch_size >= 1"):
        build_reward(RewardSpec(name="remote", kwargs={"url": "http://127.0.0.1:1", "batch_size": 0}))


# ----------------------------------------------------------------------------------------------------------------
# Missing scores, failures and contract violations
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nan", [True, False])
def test_missing_score_drops_the_sample_from_its_group(nan):
    result = scorer({"name": "user_rewards.safety:NoScoreFor", "kwargs": {"positions": [1], "nan": nan}}).score(
        videos(6), list("abcdef")
    )
    assert result.dimensions["judge"][1] is None and result.total[1] is None
    advantages = group_advantages(result.total, [0, 0, 0, 1, 1, 1])
    assert advantages.valid.tolist() == [True, False, True, True, True, True]
    assert advantages.values[1] == 0.0
    # the rest of group 0 is normalised among itself: rewards 0 and 2 -> advantages -1 and +1
    assert advantages.values[[0, 2]].tolist() == pytest.approx([-1.0, 1.0], abs=1e-6)


def test_wrong_length_is_a_one_line_user_error_naming_the_reward():
    with pytest.raises(UserError) as error:
        scorer({"name": "user_rewards.safety:WrongLength"}).score(videos(3), list("abc"))
    message = str(error.value)
    assert "user_rewards.safety:WrongLength" in message and "2 scores for 3 videos" in message
    assert "\n" not in message


def test_wrong_type_is_a_user_error_and_not_retried():
    with pytest.raises(UserError, match="WrongType' returned list"):
        scorer({"name": "user_rewards.safety:WrongType"}).score(videos(2), ["a", "b"])


def test_raising_reward_is_retried_then_succeeds():
    run = scorer({"name": "user_rewards.safety:Flaky", "kwargs": {"failures": 2}}, retries=2)
    result = run.score(videos(2), ["a", "b"])
    assert result.total == [1.0, 1.0]
    assert run.rewards[0][1].calls == 3 and not run.failures


def test_reward_failing_after_retries_scores_none_and_is_counted():
    run = scorer(
        {"name": "user_rewards.safety:Flaky", "kwargs": {"failures": 100}, "batch_size": 2},
        {"name": "brightness"},
        retries=1,
        max_failed_fraction=1.0,
    )
    result = run.score(videos(3), list("abc"))
    assert result.total == [None, None, None]
    assert result.failed == {"user_rewards.safety:Flaky": 3}
    assert run.failures["user_rewards.safety:Flaky"] == 3
    assert run.rewards[0][1].calls == 4  # two sub-batches, each tried twice
    assert all(value is not None for value in result.dimensions["brightness"])


# ----------------------------------------------------------------------------------------------------------------
# Cheap pixel rewards
# ----------------------------------------------------------------------------------------------------------------


def test_pixel_rewards_mean_what_their_docstrings_say():
    batch = VideoBatch([constant_video(255), constant_video(0), constant_video(128)], fps=8)
    assert build_reward(RewardSpec(name="brightness"))(batch, list("abc"))["brightness"] == pytest.approx(
        [0.0, -1.0, 128 / 255 - 1], abs=1e-6
    )
    assert build_reward(RewardSpec(name="temporal_smoothness"))(batch, list("abc"))["temporal_smoothness"] == [0.0] * 3
    assert build_reward(RewardSpec(name="colorfulness"))(batch, list("abc"))["colorfulness"] == [0.0] * 3
    red = torch.zeros(4, 16, 16, 3, dtype=torch.uint8)
    red[..., 0] = 255
    flicker = torch.stack([constant_video(0, frames=1)[0], constant_video(255, frames=1)[0]] * 2)
    assert build_reward(RewardSpec(name="colorfulness"))(VideoBatch([red], 8), ["r"])["colorfulness"][0] > 0.3
    assert build_reward(RewardSpec(name="temporal_smoothness"))(VideoBatch([flicker], 8), ["f"]) == {
        "temporal_smoothness": [-1.0]
    }


# ----------------------------------------------------------------------------------------------------------------
# VideoAlign
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frames, fps, height, width, count, size",
    [
        (49, 24.0, 480, 832, 4, (336, 588)),  # 2 s at 24 fps: 4 frames; 400k pixels scaled down under 200704
        (129, 24.0, 720, 1280, 10, (336, 588)),  # 5.4 s: 10.75 -> 10 frames, 16:9 kept within the pixel cap
        (300, 30.0, 448, 448, 20, (448, 448)),  # 10 s: 20 frames; 448x448 = 200704 exactly, kept
        (16, 8.0, 64, 64, 4, (336, 336)),  # tiny frames are upscaled to at least 128 * 28 * 28 pixels
        (3, 24.0, 256, 256, 2, (336, 336)),  # fewer frames than the minimum: the largest even count
    ],
)
def test_frame_sampling_and_sizes_follow_qwen_vl_utils(frames, fps, height, width, count, size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as transformers_resize

    assert sampled_frame_count(frames, fps, videoalign.SAMPLE_FPS) == count
    resized = smart_resize(height, width, 28, videoalign.MIN_PIXELS, videoalign.MAX_PIXELS)
    assert resized == size == transformers_resize(height, width, 28, videoalign.MIN_PIXELS, videoalign.MAX_PIXELS)
    video = torch.zeros(frames, height, width, 3, dtype=torch.uint8)
    assert videoalign.sample_and_resize(video, fps).shape == (count, 3, *size)


def test_frame_indices_span_the_video_and_one_frame_is_too_short():
    assert uniform_frame_indices(49, 4) == [0, 16, 32, 48]
    with pytest.raises(ValueError, match="too short"):
        sampled_frame_count(1, 24.0, 2.0)


def test_patches_match_the_transformers_qwen2vl_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    frames = torch.randint(0, 256, (4, 3, 56, 84), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    patches, grid = videoalign.patchify(frames)
    assert grid == (2, 4, 6)
    # The processor patchifies one image as a temporal pair of copies; a video pair (2t, 2t+1) sits in the same
    # rows, frame 2t in the first temporal slot and 2t+1 in the second.
    processor = Qwen2VLImageProcessorPil()
    ours = patches.view(2, 24, 3, 2, 14 * 14)
    for index, frame in enumerate(frames):
        reference = processor(images=[frame.permute(1, 2, 0).numpy()], do_resize=False, return_tensors="pt")
        assert reference["image_grid_thw"].tolist() == [[1, 4, 6]]
        expected = reference["pixel_values"].view(24, 3, 2, 14 * 14)[:, :, 0]
        torch.testing.assert_close(ours[index // 2, :, :, index % 2], expected, atol=1e-5, rtol=1e-5)


def test_chat_text_holds_the_prompt_and_the_reward_tokens_in_order():
    text = videoalign.chat_text("a corgi surfing")
    assert text.startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|video_pad|><|vision_end|>\nYou are tasked"
    )
    assert "Textual prompt - a corgi surfing\n" in text
    positions = [text.index(token) for token in videoalign.REWARD_TOKENS]
    assert positions == sorted(positions) and text.endswith("END\n<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tiny_raw_and_normalised():
    return videoalign.tiny_videoalign(normalize=False), videoalign.tiny_videoalign(normalize=True)


def test_tiny_videoalign_reports_vq_mq_ta_overall_with_normalisation(tiny_raw_and_normalised):
    raw_reward, normalised_reward = tiny_raw_and_normalised
    batch = VideoBatch(
        [
            torch.randint(0, 256, (12, 40, 60, 3), dtype=torch.uint8),
            torch.randint(0, 256, (6, 30, 30, 3), dtype=torch.uint8),
        ],
        fps=6.0,
    )
    prompts = ["a red car", "a cat on the sky"]
    raw, normalised = raw_reward(batch, prompts), normalised_reward(batch, prompts)
    assert set(raw) == set(normalised) == {"VQ", "MQ", "TA", "Overall"}
    for name, (mean, std) in videoalign.RELEASED_NORMALIZATION.items():
        assert normalised[name] == pytest.approx([(value - mean) / std for value in raw[name]], abs=1e-5)
    for scores in (raw, normalised):
        assert scores["Overall"] == pytest.approx([sum(v) for v in zip(scores["VQ"], scores["MQ"], scores["TA"])])
    # batching and padding do not change a video's score
    alone = normalised_reward(batch[1:], prompts[1:])
    assert alone["TA"] == pytest.approx(normalised["TA"][1:], abs=1e-4)


def test_tiny_videoalign_reads_the_reward_tokens_with_1d_positions(tiny_raw_and_normalised):
    reward = tiny_raw_and_normalised[0]
    batch = VideoBatch([torch.randint(0, 256, (8, 56, 56, 3), dtype=torch.uint8)], fps=4.0)
    inputs = reward.prepare_inputs(batch, ["a dog"])
    model = reward.model
    hidden = model.vlm.model(**inputs, position_ids=torch.arange(inputs["input_ids"].shape[1])[None]).last_hidden_state
    expected = [
        model.rm_head(hidden[0, inputs["input_ids"][0] == token_id]).item() for token_id in model.reward_token_ids
    ]
    assert model(**inputs)[0].tolist() == pytest.approx(expected, abs=1e-5)
    video_tokens = (inputs["input_ids"] == reward.video_pad_id).int() * 2  # token type 2: video
    m_rope = model.vlm.model(**inputs, mm_token_type_ids=video_tokens).last_hidden_state  # 3-D positions differ
    assert not torch.allclose(m_rope, hidden)


def test_released_checkpoint_layout_loads_with_lora_merged(tmp_path):
    base_tokenizer = videoalign.tiny_tokenizer(reward_tokens=False)
    base = videoalign.tiny_model(base_tokenizer).vlm
    base.save_pretrained(tmp_path / "base")
    base_tokenizer.save_pretrained(tmp_path / "base")
    vocabulary, hidden = len(base_tokenizer) + 3, 32
    generator = torch.Generator().manual_seed(3)
    lora_a, lora_b = torch.randn(4, hidden, generator=generator), torch.randn(hidden, 4, generator=generator)
    released = {  # names as the release saved them: peft prefix, transformers 4.45 module paths
        "base_model.model.rm_head.weight": torch.randn(1, hidden, generator=generator),
        "base_model.model.model.embed_tokens.weight": torch.randn(vocabulary, hidden, generator=generator),
        "base_model.model.visual.merger.ln_q.weight": torch.full((32,), 2.0),
    }
    folder = tmp_path / "release" / "checkpoint-7"
    folder.mkdir(parents=True)
    torch.save(released, folder / "non_lora_state_dict.pth")
    from safetensors.torch import save_file

    save_file(
        {
            "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": lora_a,
            "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight": lora_b,
        },
        folder / "adapter_model.safetensors",
    )
    (tmp_path / "release" / "model_config.json").write_text(
        json.dumps(
            {
                "peft_lora_config": {"lora_enable": True, "lora_r": 4, "lora_alpha": 8},
                "inference_config": {
                    "VQ_mean": 1.0,
                    "VQ_std": 2.0,
                    "MQ_mean": 0.0,
                    "MQ_std": 1.0,
                    "TA_mean": 0.0,
                    "TA_std": 1.0,
                },
            }
        )
    )

    reward = videoalign.load_videoalign(str(tmp_path / "base"), str(tmp_path / "release"), dtype="float32")
    model = reward.model
    assert model.reward_token_ids == [vocabulary - 3, vocabulary - 2, vocabulary - 1]
    torch.testing.assert_close(model.rm_head.weight, released["base_model.model.rm_head.weight"])
    torch.testing.assert_close(
        model.vlm.model.language_model.embed_tokens.weight, released["base_model.model.model.embed_tokens.weight"]
    )
    assert model.vlm.lm_head.weight is model.vlm.model.language_model.embed_tokens.weight  # still tied
    assert (model.vlm.model.visual.merger.ln_q.weight == 2.0).all()
    base_q = base.model.language_model.layers[1].self_attn.q_proj.weight
    torch.testing.assert_close(
        model.vlm.model.language_model.layers[1].self_attn.q_proj.weight, base_q + 2.0 * lora_b @ lora_a
    )
    assert reward.normalization["VQ"] == (1.0, 2.0)
    scores = reward(VideoBatch([torch.zeros(4, 28, 28, 3, dtype=torch.uint8)], fps=2.0), ["a cat"])
    assert all(math.isfinite(scores[name][0]) for name in ("VQ", "MQ", "TA", "Overall"))


def test_misnamed_checkpoint_weights_fail_loudly(tmp_path):
    model = videoalign.tiny_model(videoalign.tiny_tokenizer())
    torch.save({"rm_head.weight": torch.zeros(1, 32), "model.no_such.weight": torch.zeros(2)}, tmp_path / "model.pth")
    with pytest.raises(ValueError, match="match no parameter"):
        videoalign.load_released_weights(model, tmp_path, scale=None)


# ----------------------------------------------------------------------------------------------------------------
# CLIPScore and PickScore
# ----------------------------------------------------------------------------------------------------------------


def test_pickscore_is_logit_scale_times_cosine_averaged_over_frames():
    reward = tiny_pickscore()
    generator = torch.Generator().manual_seed(2)
    frame = torch.randint(0, 256, (1, 24, 40, 3), dtype=torch.uint8, generator=generator)
    still = frame.expand(6, -1, -1, -1).contiguous()
    text = reward.tokenizer(["a red car"], return_tensors="pt")
    pixels = reward.image_processor(images=[frame[0].numpy()], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        logits = reward.model(**text, pixel_values=pixels).logits_per_image  # logit_scale * cosine
    assert reward(VideoBatch([still], fps=8), ["a red car"])["pickscore"][0] == pytest.approx(logits.item(), rel=1e-4)

    mixed = torch.cat([frame, torch.randint(0, 256, (1, 24, 40, 3), dtype=torch.uint8, generator=generator)])
    per_frame = [
        reward(VideoBatch([f[None].expand(2, -1, -1, -1)], fps=8), ["a red car"])["pickscore"][0] for f in mixed
    ]
    assert reward(VideoBatch([mixed], fps=8), ["a red car"])["pickscore"][0] == pytest.approx(np.mean(per_frame))


def test_clipscore_is_clamped_and_scaled_cosine():
    batch = videos(3, frames=5)
    scores = tiny_clipscore()(batch, ["a cat", "a dog", "the sky"])["clipscore"]
    assert len(scores) == 3 and all(0.0 <= score <= 2.5 for score in scores)
