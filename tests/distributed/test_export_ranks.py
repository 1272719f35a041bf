"""Exports of a model partitioned by DeepSpeed ZeRO-3 (gloo on CPU, 1 and 2 processes launched by torchrun): the
files are complete, equal to DeepSpeed's own gathered weights, and load back with diffusers' loaders."""

import json
from pathlib import Path

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel
from safetensors.torch import load_file

from sage_grpo.core.export import LORA_WEIGHT_NAME, read_export_manifest
from sage_grpo.core.lora import add_lora
from sage_grpo.core.models.tiny import tiny_hunyuan15
from tests.helpers import torchrun
from tests.unit.test_export import output

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = Path(__file__).with_name("export_worker.py")
WORLDS = (1, 2)


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exports")
    for world in WORLDS:
        torchrun(world, str(WORKER), "--out", str(out))
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_full_export_of_a_zero3_engine_holds_the_gathered_weights_and_loads_with_from_pretrained(exports, world):
    export_dir = exports / f"full_world{world}"
    reference = load_file(exports / f"full_reference_world{world}.safetensors")

    loaded = HunyuanVideo15Transformer3DModel.from_pretrained(export_dir)

    manifest = read_export_manifest(export_dir)
    assert manifest["kind"] == "full" and manifest["model"]["name"] == "tiny-hunyuan15"
    parameters = dict(loaded.named_parameters())
    assert parameters.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(parameters[name], tensor), name
    assert not torch.equal(output(loaded), output(tiny_hunyuan15(seed=0).transformer))  # trained, not the base


def test_two_ranks_export_the_same_weights_as_one(exports):
    single = load_file(exports / "full_world1" / "diffusion_pytorch_model.safetensors")
    sharded = load_file(exports / "full_world2" / "diffusion_pytorch_model.safetensors")
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[name], sharded[name]) for name in single)


@pytest.mark.parametrize("world", WORLDS)
def test_lora_export_of_a_zero3_engine_reproduces_the_trained_model(exports, world):
    from tests.distributed.export_worker import LORA

    trained = add_lora(tiny_hunyuan15(seed=0).transformer, LORA)
    trained.load_state_dict(load_file(exports / f"lora_reference_world{world}.safetensors"), strict=False)
    fresh = tiny_hunyuan15(seed=0).transformer

    fresh.load_lora_adapter(exports / f"lora_world{world}", weight_name=LORA_WEIGHT_NAME)

    assert json.loads((exports / f"lora_world{world}" / "export.json").read_text())["kind"] == "lora"
    torch.testing.assert_close(output(fresh), output(trained), rtol=1e-5, atol=1e-6)
