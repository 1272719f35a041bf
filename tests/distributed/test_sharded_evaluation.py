"""Evaluation sharded over data-parallel ranks (each prompt sampled and scored once, gathered on rank 0) gives what
a single rank gives, bit for bit, under real ZeRO-3 with gloo: 2 data-parallel ranks, and 2 ranks of one
sequence-parallel group."""

import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = Path(__file__).with_name("sharded_evaluation_worker.py")


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    torchrun(1, str(WORKER), "--out", str(out))
    torchrun(2, str(WORKER), "--out", str(out))
    torchrun(2, str(WORKER), "--out", str(out), "--sequence-parallel", "2")
    return out


@pytest.mark.parametrize("layout", ["world2_k1", "world2_k2"])
def test_sharded_evaluation_equals_one_rank(evaluations, layout):
    single = json.loads((evaluations / "world1_k1" / "report.json").read_text())
    sharded = json.loads((evaluations / layout / "report.json").read_text())
    assert len(single["prompts"]) == 5 and len(single["videos"]) == 3
    assert sharded == single  # metrics, prompts in order, every score, the written videos' bytes
    frames = [np.load(evaluations / name / "frames.npy") for name in ("world1_k1", layout)]
    assert np.array_equal(frames[0], frames[1])


def test_each_batch_is_sampled_on_one_data_parallel_rank(evaluations):
    forwards = lambda layout, rank: int((evaluations / layout / f"forwards_rank{rank}.txt").read_text())  # noqa: E731
    assert forwards("world1_k1", 0) == 3 * 3  # 3 batches x 3 steps
    # Batches [0, 1] and [4] on rank 0, [2, 3] and a discarded one on rank 1 (ZeRO-3 needs equal forwards).
    assert forwards("world2_k1", 0) == forwards("world2_k1", 1) == 2 * 3
    # One sequence-parallel group: both ranks sample every batch, each holding half of its tokens.
    assert forwards("world2_k2", 0) == forwards("world2_k2", 1) == 3 * 3
