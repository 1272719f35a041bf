"""DeepSpeed's JSON, in one place: the shipped configs load; "auto" fields are filled from the run as DeepSpeed's HF
integration fills them (bucket sizes from the hidden size); a value that disagrees with the run is refused, not
overwritten; and a JSON DeepSpeed would reject or crash on (a bad shape, its own shorthand, nesting past the JSON
reader's depth) is one config line naming ``deepspeed.config``, while every integer ZeRO stage is accepted."""

import json
from pathlib import Path

import pytest

from sage_grpo.stages.engine import deepspeed_config
from tests.helpers import refused_in_one_line

pytestmark = pytest.mark.unit

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
DEEP = 100_000


# --- Filled from the run ------------------------------------------------------------------------------------------


def test_auto_fields_are_filled_from_the_run_config():
    config = deepspeed_config(
        "zero3", micro_batch_size=2, accumulation_steps=19, max_grad_norm=0.5, bf16=True, world_size=1
    )
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 19
    assert config["train_batch_size"] == 38
    assert config["gradient_clipping"] == 0.5 and config["bf16"]["enabled"] is True
    assert config["zero_optimization"]["stage"] == 3


def test_a_json_that_disagrees_with_the_run_config_is_rejected(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"gradient_clipping": 2.0, "zero_optimization": {"stage": 3}}))
    with pytest.raises(ValueError, match="gradient_clipping"):
        deepspeed_config(str(path), micro_batch_size=1, accumulation_steps=1, max_grad_norm=1.0, bf16=False)


@pytest.mark.parametrize("name", ["zero2", "zero3", "zero3_offload"])
def test_every_shipped_deepspeed_config_loads(name):
    assert deepspeed_config(name, micro_batch_size=1, accumulation_steps=4, max_grad_norm=1.0, bf16=False)


def _fill(path, **overrides):
    return deepspeed_config(
        str(path), **{"micro_batch_size": 2, "accumulation_steps": 3, "max_grad_norm": 1.0, "bf16": False, **overrides}
    )


def test_auto_fields_are_filled_and_buckets_follow_the_hidden_size(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": "auto",
                "bf16": {"enabled": "auto"},
                "zero_optimization": {
                    "stage": 3,
                    "reduce_bucket_size": "auto",
                    "stage3_prefetch_bucket_size": "auto",
                    "stage3_param_persistence_threshold": 1000,
                },
            }
        )
    )
    config = _fill(path, world_size=4, hidden_size=64)
    assert config["train_batch_size"] == 2 * 3 * 4 and config["gradient_accumulation_steps"] == 3
    assert config["bf16"]["enabled"] is False
    zero = config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (64 * 64, int(0.9 * 64 * 64))
    assert zero["stage3_param_persistence_threshold"] == 1000  # a value the user set stays


@pytest.mark.parametrize(
    "field,value", [("train_batch_size", 7), ("bf16", {"enabled": True}), ("gradient_accumulation_steps", 2)]
)
def test_a_value_that_disagrees_with_the_run_is_refused_not_overwritten(tmp_path, field, value):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({field: value}))
    with pytest.raises(ValueError, match="disagrees with the run config"):
        _fill(path, world_size=1)


# --- Refused in one line ---------------------------------------------------------------------------------------------

REFUSED_JSON = {
    "missing": None,
    "invalid": "{not json",
    "list": "[1, 2]",
    "stage9": '{"zero_optimization": {"stage": 9}}',
    "disagrees": '{"gradient_clipping": 5.0}',
    "optimizer": '{"optimizer": {"type": "Adam", "params": {"lr": 1}}}',
    "fp16": '{"fp16": {"enabled": true}}',
    "offload": '{"zero_optimization": {"stage": 3, "offload_param": {"device": "tape"}}}',
    "nvme_without_path": '{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}',
    "nvme_on_stage2": '{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}',
}


@pytest.mark.parametrize("kind", sorted(REFUSED_JSON))
def test_each_bad_deepspeed_config_is_one_line(capsys, tmp_path, kind):
    text = REFUSED_JSON[kind]
    path = tmp_path / f"{kind}.json"
    if text is not None:
        path.write_text(text)
    refused_in_one_line(capsys, ["config", str(DEMO), f"deepspeed.config={path}"], "deepspeed.config")


SHORTHAND_OR_DEPTH = {
    "bf16-true": '{"bf16": true}',
    "fp16-true": '{"fp16": true}',
    "bf16-null": '{"bf16": null}',
    "bf16-enabled-yes": '{"bf16": {"enabled": "yes"}}',
    "fp16-enabled-number": '{"fp16": {"enabled": 1}}',
    "zero-a-list": '{"zero_optimization": [3]}',
    "stage-true": '{"zero_optimization": {"stage": true}}',
    "stage-false": '{"zero_optimization": {"stage": false}}',
    "stage-string": '{"zero_optimization": {"stage": "3"}}',
    "stage-float": '{"zero_optimization": {"stage": 3.0}}',
    "offload-string": '{"zero_optimization": {"stage": 3, "offload_optimizer": "cpu"}}',
    "offload-param-string": '{"zero_optimization": {"stage": 3, "offload_param": "nvme"}}',
    "offload-list": '{"zero_optimization": {"stage": 3, "offload_param": ["cpu"]}}',
    "offload-device-number": '{"zero_optimization": {"stage": 3, "offload_param": {"device": 1}}}',
    "offload-device-object": '{"zero_optimization": {"stage": 3, "offload_param": {"device": {"cpu": 1}}}}',
    "nested-lists": "[" * DEEP + "]" * DEEP,
    "nested-objects": '{"a": ' * DEEP + "1" + "}" * DEEP,
    "nested-in-a-block": '{"zero_optimization": ' + "[" * DEEP + "]" * DEEP + "}",
    "utf-16": '{"bf16": {"enabled": "auto"}}'.encode("utf-16"),
}


@pytest.mark.parametrize("kind", sorted(SHORTHAND_OR_DEPTH))
def test_each_deepspeed_json_deepspeed_shorthand_or_depth_would_crash_on_is_one_line(capsys, tmp_path, kind):
    text = SHORTHAND_OR_DEPTH[kind]
    path = tmp_path / f"{kind}.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    refused_in_one_line(capsys, ["config", str(DEMO), f"deepspeed.config={path}"], "deepspeed.config")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_integer_zero_stage_is_still_accepted(capsys, tmp_path, stage):
    from sage_grpo.pipeline import cli

    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": stage}}))
    assert cli.main(["config", str(DEMO), f"deepspeed.config={path}"]) == 0, capsys.readouterr().err
