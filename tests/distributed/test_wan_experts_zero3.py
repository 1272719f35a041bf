"""Two-expert Wan 2.2 trained on 2 ranks with DeepSpeed ZeRO-3 (gloo on CPU): both experts in one engine, full and
LoRA; an expert left out of ``train_experts`` stays bit-identical even under AdamW weight decay; resume repeats an
update bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = Path(__file__).with_name("wan_experts_worker.py")
HIGH_STEPS, LOW_STEPS = [0, 1, 2], [3, 4, 5]  # the last step (to sigma 0) trains too


def _launch(out: Path, *flags: str) -> list[dict]:
    torchrun(2, str(WORKER), "--out", str(out), *flags)
    return [json.loads((out / f"report_rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_both_experts_train_in_one_zero3_engine(tmp_path, kind):
    flags = ["--lora"] if kind == "lora" else []
    reports = _launch(tmp_path, *flags)
    for report in reports:
        assert report["trained_steps"] == HIGH_STEPS + LOW_STEPS
        first = report["history"][0]
        assert first["logprob_mismatch"] == 0.0  # every transition rescored by the expert that made it
        for expert in ("high", "low"):
            assert report["changed"][expert] == {"trainable": True, "frozen": False}, expert
            # The moving anchor holds this rank's shards of both experts' trainable weights.
            assert report["anchored"][expert] == report["trainable"][expert] > 0
        assert report["history"][1]["position_kl"] > 0
    if kind == "full":  # resumed in fresh processes from the checkpoint after update 1, update 2 lands bit for bit
        torchrun(2, str(WORKER), "--out", str(tmp_path), "--resume-from", str(tmp_path))
        for rank, report in enumerate(reports):
            resumed = json.loads((tmp_path / f"resumed_rank{rank}.json").read_text())
            assert resumed["weights_sha256"] == report["weights_sha256"]


def test_an_expert_left_out_is_bit_identical_under_weight_decay(tmp_path):
    """Only the low-noise steps train: the high-noise expert is frozen, outside the optimizer, so not even AdamW's
    weight decay (which DeepSpeed applies to a zero gradient) moves it."""
    for report in _launch(tmp_path, "--train-experts", "low", "--weight-decay", "0.1"):
        assert report["trained_steps"] == LOW_STEPS
        assert report["history"][0]["logprob_mismatch"] == 0.0
        assert report["changed"]["high"] == {"trainable": False, "frozen": False}
        assert report["changed"]["low"]["trainable"]
        assert report["trainable"]["high"] == 0 and report["anchored"]["high"] == 0
