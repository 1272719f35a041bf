"""The ToyWorld through the front door: the gold judge scores what the caption asks (a static or wrong-way square
scores 0 where the proxy gives its MQ and VQ full marks), and the plug-in adapter refuses weights whose sha256 is not
the config's."""

import sys
from pathlib import Path

import pytest
import torch

# benchmarks/ is not an installed package: import it from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.toyworld import model, pretrain, world  # noqa: E402
from benchmarks.toyworld.rewards import GoldJudge, ToyWorldReward  # noqa: E402
from sage_grpo.core.errors import UserError  # noqa: E402
from sage_grpo.core.models.base import frames_to_uint8  # noqa: E402
from sage_grpo.core.rewards.base import VideoBatch  # noqa: E402

pytestmark = pytest.mark.unit

CAPTION = "a red square moving right"


def _batch(*videos: torch.Tensor) -> VideoBatch:
    return VideoBatch.from_tensor(frames_to_uint8(torch.stack(videos)), fps=8)


def test_gold_scores_what_the_caption_asks_where_the_proxy_is_fooled():
    correct = world.render(world.Scene("red", "right", 5, 2))
    static = correct[:1].expand_as(correct).clone()  # the first frame held: a square that does not move
    wrong_way = world.render(world.Scene("red", "left", 5, 9))
    wrong_colour = world.render(world.Scene("blue", "right", 5, 2))
    videos, captions = _batch(correct, static, wrong_way, wrong_colour), [CAPTION] * 4
    gold, proxy = GoldJudge()(videos, captions), ToyWorldReward(parts=True)(videos, captions)
    assert gold["gold"][0] == pytest.approx(1.0, abs=1e-3)
    assert gold["gold"][1:] == [0.0, 0.0, 0.0]
    assert (gold["static"], gold["wrong_way"]) == ([0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0])
    assert gold["right_way"] == [1.0, 0.0, 0.0, 1.0]  # the wrong colour still moves the captioned way
    # The loophole the proxy leaves: the static square's motion and quality are perfect, only direction drops.
    assert proxy["MQ"][1] == pytest.approx(1.0, abs=1e-3) and proxy["VQ"][1] == pytest.approx(1.0, abs=1e-3)
    assert proxy["TA"][1] == pytest.approx(0.5, abs=1e-3)


def test_the_adapter_refuses_weights_of_another_checksum(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    weights = tmp_path / "toyworld.safetensors"
    save_file(model.build_transformer(0).state_dict(), str(weights))
    monkeypatch.setattr(pretrain, "cache_path", lambda config: weights)
    with pytest.raises(UserError, match="have sha256 .* not model.kwargs.sha256 0+"):
        model.toyworld_adapter(sha256="0" * 64)
    adapter = model.toyworld_adapter(sha256=model.weights_sha256(weights))
    trained = {name for name, p in adapter.transformer.named_parameters() if p.requires_grad}
    assert trained and not any(name.startswith(model.UNUSED_BRANCHES) for name in trained)
    monkeypatch.setattr(pretrain, "cache_path", lambda config: tmp_path / "missing.safetensors")
    monkeypatch.setattr(pretrain, "SHIPPED_DIR", tmp_path / "nothing-shipped")
    with pytest.raises(UserError, match="run python -m benchmarks.toyworld.pretrain first"):
        model.toyworld_adapter()


def test_the_shipped_weights_rebuild_the_pinned_cache_file_bit_for_bit(tmp_path, monkeypatch):
    """A fresh machine has no cache: the repository's trained weights plus the untouched initial branches make the
    very file configs/toyworld.yaml pins, so its sha256 check passes without 21 minutes of pretraining."""
    import yaml

    monkeypatch.setattr(pretrain, "CACHE_DIR", tmp_path / "cache")
    kwargs = yaml.safe_load((Path(__file__).parents[2] / "configs" / "toyworld.yaml").read_text())["model"]["kwargs"]
    adapter = model.toyworld_adapter(**kwargs)  # refuses any other weights
    default = pretrain.pretrain_config()
    assert model.weights_sha256(pretrain.cache_path(default)) == kwargs["sha256"]
    shipped = pretrain.load_file(str(pretrain.shipped_path(default)))
    assert shipped and not any(name.startswith(model.UNUSED_BRANCHES) for name in shipped)
    assert adapter.transformer.proj_out.weight.requires_grad
