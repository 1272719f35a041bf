"""parallel.sequence_parallel_size is refused in one line, when the config loads, where Ulysses cannot split evenly:
the attention heads, the video tokens of a sample, the world size."""

from pathlib import Path

import pytest

from sage_grpo.core.errors import UserError
from sage_grpo.core.models import ModelConfig, sequence_layout
from sage_grpo.pipeline.config import load_run_config

pytestmark = pytest.mark.unit

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def test_a_size_that_divides_heads_tokens_and_world_loads(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert load_run_config(DEMO, ["parallel.sequence_parallel_size=2"]).parallel.sequence_parallel_size == 2


def test_heads_not_divisible_is_one_line():
    with pytest.raises(UserError, match="sequence_parallel_size=4 does not divide the model's 2 attention heads"):
        load_run_config(DEMO, ["model.name=tiny-hunyuan15", "parallel.sequence_parallel_size=4"])


def test_tokens_not_divisible_is_one_line():
    # 4 heads, and 3 latent frames of 9 x 9 latents: 243 video tokens.
    overrides = [
        "model.name=tiny-hunyuan15",
        "model.kwargs={height: 36, width: 36, transformer: {num_attention_heads: 4}}",
        "parallel.sequence_parallel_size=4",
    ]
    with pytest.raises(UserError, match="does not divide the 243 video tokens") as refused:
        load_run_config(DEMO, overrides)
    assert "\n" not in str(refused.value)


def test_world_size_not_a_multiple_is_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UserError, match="sequence_parallel_size=2 does not divide the world size 3"):
        load_run_config(DEMO, ["parallel.sequence_parallel_size=2"])


def test_layout_of_hunyuanvideo15_at_720p_is_the_released_transformer():
    config = ModelConfig(
        name="hunyuan15", pretrained="not/on-disk", kwargs={"height": 720, "width": 1280, "num_frames": 121}
    )
    assert sequence_layout(config) == (16, 31 * 45 * 80)


def test_layout_it_cannot_read_is_left_to_the_build():
    assert sequence_layout(ModelConfig(name="wan", pretrained="not/on-disk")) is None
