"""The diffusers-format export of a two-expert Wan 2.2: each trained expert in its WanPipeline component's subfolder,
loaded back into WanPipeline (full weights, or LoRA through ``load_lora_weights(..., load_into_transformer_2=True)``)
it renders what the trained model renders for the same seed."""

import json

import pandas as pd
import pytest
import torch
from diffusers import WanTransformer3DModel

from sage_grpo.core.export import LORA_WEIGHT_NAME, export_policy, read_export_manifest
from sage_grpo.core.lora import LoraConfig, add_lora
from sage_grpo.core.models.tiny import tiny_wan22
from sage_grpo.core.models.wan import WanAdapter
from sage_grpo.stages.rollout import SDEConfig, generate

pytestmark = pytest.mark.unit

PROMPTS = ["a red fox runs through snow"]
ODE = SDEConfig(variant="ode", steps=6, shift=5.0)


def _trained(train_experts=None, lora: bool = False) -> WanAdapter:
    """A tiny two-expert Wan whose trainable weights moved away from the base, as training would move them."""
    adapter = tiny_wan22(guidance_scale=3.0, guidance_scale_2=2.0, train_experts=train_experts)
    adapter.transformer.requires_grad_(False)
    for module in adapter.trainable_modules():
        if lora:
            add_lora(module, LoraConfig(enabled=True, rank=4, alpha=8.0))
        else:
            module.requires_grad_(True)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in adapter.transformer.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return adapter


def _final_latents(adapter: WanAdapter) -> torch.Tensor:
    return generate(adapter, PROMPTS, 2, ODE, seed=3, batch_size=2, decode=False).latents[:, -1]


def _reloaded(pipeline, **components) -> WanAdapter:
    pipeline.register_modules(**components)
    return WanAdapter(pipeline, guidance_scale=3.0, guidance_scale_2=2.0, height=64, width=64, num_frames=9,
                      max_sequence_length=16, identity="reloaded")  # fmt: skip


def test_full_export_loads_into_wan_pipeline_and_renders_the_same(tmp_path):
    trained = _trained()
    export_policy(trained.transformer, tmp_path / "export")
    manifest = read_export_manifest(tmp_path / "export")
    assert manifest["kind"] == "full"
    assert {name.split("/")[0] for name in manifest["files"]} == {"transformer", "transformer_2"}
    base = tiny_wan22().pipeline
    reloaded = _reloaded(
        base,
        transformer=WanTransformer3DModel.from_pretrained(tmp_path / "export", subfolder="transformer"),
        transformer_2=WanTransformer3DModel.from_pretrained(tmp_path / "export", subfolder="transformer_2"),
    )
    assert torch.equal(_final_latents(reloaded), _final_latents(trained))
    assert not torch.equal(
        _final_latents(tiny_wan22(guidance_scale=3.0, guidance_scale_2=2.0)), _final_latents(trained)
    )


def test_lora_export_loads_into_both_experts_and_renders_the_same(tmp_path):
    trained = _trained(lora=True)
    export_policy(trained.transformer, tmp_path / "export")
    assert read_export_manifest(tmp_path / "export")["kind"] == "lora"
    pipeline = tiny_wan22().pipeline
    pipeline.load_lora_weights(tmp_path / "export" / "transformer", weight_name=LORA_WEIGHT_NAME)
    pipeline.load_lora_weights(
        tmp_path / "export" / "transformer_2", weight_name=LORA_WEIGHT_NAME, load_into_transformer_2=True
    )
    reloaded = _reloaded(pipeline)
    torch.testing.assert_close(_final_latents(reloaded), _final_latents(trained), rtol=1e-5, atol=1e-5)


def test_an_expert_that_did_not_train_is_left_to_the_base_checkpoint(tmp_path):
    export_policy(_trained(train_experts=["low"]).transformer, tmp_path / "export")
    files = json.loads((tmp_path / "export" / "export.json").read_text())["files"]
    assert {name.split("/")[0] for name in files} == {"transformer_2"}
    # Exporting again replaces the earlier export (its files, in their subfolder, all match its manifest).
    export_policy(_trained(train_experts=["low"]).transformer, tmp_path / "export")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_pyfunc_loads_both_experts_of_an_export(tmp_path, lora):
    """What a registered version's pyfunc loads (``VideoPolicyModel.load_context``) generates the trained model's
    video through WanPipeline, both experts included."""
    from types import SimpleNamespace

    import numpy as np

    from sage_grpo.core.export import model_record
    from sage_grpo.core.registry import VideoPolicyModel

    trained = _trained(lora=lora)
    export_policy(trained.transformer, tmp_path / "export", model=model_record("tiny-wan22"))
    policy = VideoPolicyModel()
    context = SimpleNamespace(
        artifacts={"export": str(tmp_path / "export")},
        model_config={"base_model": "tiny-wan22", "kind": "lora" if lora else "full"},
    )
    policy.load_context(context)
    params = {"num_inference_steps": 2, "seed": 0}
    video = policy.predict(context, pd.DataFrame({"prompt": PROMPTS}), params=params)

    def rendered(pipeline) -> np.ndarray:
        frames = pipeline(
            prompt=PROMPTS,
            num_inference_steps=2,
            height=trained.height,
            width=trained.width,
            num_frames=trained.num_frames,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
        ).frames
        return (frames * 255).round().clip(0, 255).astype("uint8")

    np.testing.assert_array_equal(video, rendered(trained.pipeline))
    assert not np.array_equal(video, rendered(tiny_wan22().pipeline))  # the export was applied, not the base alone
