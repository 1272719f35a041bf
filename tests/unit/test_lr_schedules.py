"""Learning-rate schedules against their closed forms; the DeepSpeed JSON filled from the run like DeepSpeed's HF
integration does (auto fields filled, disagreements refused, bucket sizes from the hidden size)."""

import json
import math

import pytest

from sage_grpo.core.lr_schedules import lr_multiplier
from sage_grpo.stages.engine import deepspeed_config

pytestmark = pytest.mark.unit


def test_warmup_is_linear_then_constant():
    assert [lr_multiplier(step, warmup_steps=3) for step in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


@pytest.mark.parametrize("step,expected", [(2, 1.0), (4, 0.5), (6, 0.0), (10, 0.0)])
def test_linear_decay_after_warmup(step, expected):
    assert lr_multiplier(step, schedule="linear", warmup_steps=2, decay_steps=4) == pytest.approx(expected)


def test_cosine_decay_reaches_the_floor():
    values = [lr_multiplier(step, schedule="cosine", decay_steps=8, min_ratio=0.1) for step in range(10)]
    assert values[0] == 1.0 and values[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert values[8] == pytest.approx(0.1) and values[9] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values, values[1:]))


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
