"""Exports on tiny HunyuanVideo 1.5: the LoRA adapter and the full transformer load back into fresh models with
diffusers' own loaders and reproduce the trained model's outputs; the LoRA scale is in the weights, so a loader
that ignores the adapter config reproduces them too."""

import json
import os
from pathlib import Path

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel
from safetensors import safe_open
from safetensors.torch import load_file, save

from sage_grpo import core
from sage_grpo.core.export import (
    EXPORT_MANIFEST,
    LORA_WEIGHT_NAME,
    export_full,
    export_lora,
    export_policy,
    model_record,
    read_export_manifest,
)
from sage_grpo.core.lora import LoraConfig, add_lora
from sage_grpo.core.models.tiny import tiny_hunyuan15_pipeline

pytestmark = pytest.mark.unit


def transformer_inputs(transformer) -> dict[str, torch.Tensor]:
    config = transformer.config
    generator = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=generator)
    return {
        "hidden_states": randn(1, config.in_channels, 3, 8, 8),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": randn(1, 6, config.text_embed_dim),
        "encoder_attention_mask": torch.ones(1, 6),
        "encoder_hidden_states_2": randn(1, 4, config.text_embed_2_dim),
        "encoder_attention_mask_2": torch.ones(1, 4),
        "image_embeds": torch.zeros(1, 4, config.image_embed_dim),
    }


@torch.no_grad()
def output(transformer) -> torch.Tensor:
    return transformer(**transformer_inputs(transformer), return_dict=False)[0]


@torch.no_grad()
def perturb(params) -> None:
    """Stand-in for training: random values everywhere (LoRA's B starts at zero, which would hide a lost adapter)."""
    generator = torch.Generator().manual_seed(1)
    for param in params:
        param.add_(0.2 * torch.randn(param.shape, generator=generator))


@pytest.fixture
def trained_lora():
    # alpha != rank: a loader that ignored the exported config would scale the adapter wrongly.
    transformer = add_lora(tiny_hunyuan15_pipeline().transformer, LoraConfig(enabled=True, rank=4, alpha=8.0))
    perturb(p for p in transformer.parameters() if p.requires_grad)
    return transformer


def test_lora_export_loads_into_a_fresh_pipeline_and_reproduces_the_trained_outputs(trained_lora, tmp_path):
    export_dir = export_lora(trained_lora, tmp_path / "lora")

    fresh = tiny_hunyuan15_pipeline()
    base_output = output(fresh.transformer)
    fresh.transformer.load_lora_adapter(export_dir, weight_name=LORA_WEIGHT_NAME)  # diffusers' own loader

    assert not torch.equal(output(trained_lora), base_output)
    torch.testing.assert_close(output(fresh.transformer), output(trained_lora), rtol=1e-6, atol=1e-6)


def test_lora_export_loaded_without_its_config_still_has_the_trained_strength(trained_lora, tmp_path):
    """What a tool that assumes lora_alpha == r does: here diffusers given the bare weights, without metadata."""
    export_dir = export_lora(trained_lora, tmp_path / "lora")
    fresh = tiny_hunyuan15_pipeline().transformer

    fresh.load_lora_adapter(load_file(export_dir / LORA_WEIGHT_NAME))

    assert fresh.peft_config["default_0"].lora_alpha == fresh.peft_config["default_0"].r  # the assumption
    torch.testing.assert_close(output(fresh), output(trained_lora), rtol=1e-6, atol=1e-6)


def test_lora_export_is_in_the_diffusers_format_with_the_scale_folded_into_lora_b(trained_lora, tmp_path):
    export_dir = export_lora(trained_lora, tmp_path / "lora")

    with safe_open(export_dir / LORA_WEIGHT_NAME, framework="pt") as weights:
        keys, metadata = list(weights.keys()), weights.metadata()
        exported = {key: weights.get_tensor(key) for key in keys}
    assert keys and all(key.startswith("transformer.") and ".lora_" in key for key in keys)
    adapter_config = json.loads(metadata["lora_adapter_metadata"])
    assert adapter_config["transformer.r"] == 4 and adapter_config["transformer.lora_alpha"] == 4
    trained = dict(trained_lora.named_parameters())
    for key, tensor in exported.items():
        name = key.removeprefix("transformer.").replace(".weight", ".default.weight")
        scale = 8.0 / 4 if ".lora_B." in key else 1.0
        torch.testing.assert_close(tensor, scale * trained[name].detach(), rtol=0, atol=0, msg=key)
    assert read_export_manifest(export_dir)["kind"] == "lora"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora"]  # no staging directory left behind


@pytest.mark.parametrize("name", ["wan", "hunyuan15", "my_models.factory:build"])
def test_the_export_manifest_records_the_base_model_to_build_again(trained_lora, tmp_path, name):
    record = model_record(name, pretrained="org/base-model", kwargs={"seed": 3})

    export_dir = export_policy(trained_lora, tmp_path / "lora", model=record)

    assert read_export_manifest(export_dir)["model"] == {
        "name": name,
        "pretrained": "org/base-model",
        "kwargs": {"seed": 3},
    }


def test_a_model_record_refuses_kwargs_json_cannot_hold():
    with pytest.raises(ValueError, match="cannot be recorded"):
        model_record("tiny-wan", kwargs={"dtype": torch.float32})


def test_reexport_replaces_the_previous_export_whole(trained_lora, tmp_path):
    export_dir = tmp_path / "full"
    export_full(tiny_hunyuan15_pipeline().transformer, export_dir)

    export_lora(trained_lora, export_dir)

    assert sorted(p.name for p in export_dir.iterdir()) == [EXPORT_MANIFEST, LORA_WEIGHT_NAME]


def test_the_same_adapter_exports_to_the_same_bytes(trained_lora, tmp_path):
    """safetensors writes its metadata keys in a random order on every save (safetensors/safetensors#584); the export
    sorts them, so exporting the same adapter again gives the same sha256."""
    exports = [export_lora(trained_lora, tmp_path / f"lora-{index}") for index in range(20)]

    contents = {(export_dir / LORA_WEIGHT_NAME).read_bytes() for export_dir in exports}
    assert len(contents) == 1
    assert len({(export_dir / EXPORT_MANIFEST).read_bytes() for export_dir in exports}) == 1
    # Only the order changed: these are the bytes safetensors itself writes whenever its order is the sorted one.
    tensors = load_file(exports[0] / LORA_WEIGHT_NAME)
    with safe_open(exports[0] / LORA_WEIGHT_NAME, framework="pt") as weights:
        metadata = weights.metadata()
    assert contents.pop() in {save(tensors, metadata=metadata) for _ in range(20)}


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_exported_files_are_synced_before_the_export_moves_into_place(kind, trained_lora, tmp_path, monkeypatch):
    """safetensors and huggingface_hub write without fsync: the export syncs each file itself, or a power loss after
    the rename could leave an export whose files are empty."""
    synced, at_the_move = set(), {}
    fsync, move_into_place = os.fsync, core.export.move_into_place

    def recording_fsync(descriptor):
        synced.add(Path(os.readlink(f"/proc/self/fd/{descriptor}")))
        fsync(descriptor)

    def recording_move(staging, target):
        at_the_move["files"] = {path.resolve() for path in staging.rglob("*") if path.is_file()}
        at_the_move["synced"] = set(synced)
        move_into_place(staging, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(core.export, "move_into_place", recording_move)
    model = trained_lora if kind == "lora" else tiny_hunyuan15_pipeline().transformer

    export_policy(model, tmp_path / kind)

    assert len(at_the_move["files"]) >= 2  # the weights and export.json at least
    assert at_the_move["files"] <= at_the_move["synced"]


def test_a_tampered_export_fails_verification(trained_lora, tmp_path):
    export_dir = export_lora(trained_lora, tmp_path / "lora")
    with open(export_dir / LORA_WEIGHT_NAME, "r+b") as weights:
        weights.seek(-1, 2)
        weights.write(b"\x00" if weights.read(1) != b"\x00" else b"\x01")

    with pytest.raises(ValueError, match="does not match the sha256"):
        read_export_manifest(export_dir)


def test_lora_export_needs_an_adapter(tmp_path):
    with pytest.raises(ValueError, match="no LoRA adapter"):
        export_lora(tiny_hunyuan15_pipeline().transformer, tmp_path / "lora")


def test_full_export_round_trips_through_from_pretrained(tmp_path):
    trained = tiny_hunyuan15_pipeline().transformer
    perturb(trained.parameters())

    export_dir = export_full(trained, tmp_path / "full")
    loaded = HunyuanVideo15Transformer3DModel.from_pretrained(export_dir)

    assert read_export_manifest(export_dir)["kind"] == "full"
    assert loaded.state_dict().keys() == trained.state_dict().keys()
    for name, tensor in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    torch.testing.assert_close(output(loaded), output(trained), rtol=0, atol=0)
    assert not torch.equal(output(tiny_hunyuan15_pipeline().transformer), output(trained))


def test_full_export_writes_tensors_that_are_views_into_larger_storage(tmp_path):
    """What DeepSpeed's ZeRO-3 consolidation hands back on CPU: weights that are views into a layer's flat buffer.
    safetensors refuses to write a tensor that does not cover its storage."""
    trained = tiny_hunyuan15_pipeline().transformer
    perturb(trained.parameters())
    weight = trained.x_embedder.proj.weight
    flat = torch.cat([weight.detach().flatten(), torch.zeros(7)])
    weight.data = flat[: weight.numel()].view(weight.shape)

    export_dir = export_policy(trained, tmp_path / "full")

    loaded = HunyuanVideo15Transformer3DModel.from_pretrained(export_dir)
    assert torch.equal(loaded.x_embedder.proj.weight, weight)
    torch.testing.assert_close(output(loaded), output(trained), rtol=0, atol=0)


def test_full_export_refuses_a_model_with_lora_adapters(trained_lora, tmp_path):
    with pytest.raises(ValueError, match="export_lora"):
        export_full(trained_lora, tmp_path / "full")
