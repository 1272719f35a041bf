"""Evaluation sharded over data-parallel ranks (each prompt sampled and scored once, gathered on rank 0) gives what
a single rank gives under real ZeRO-3 with gloo: bit for bit on 2 data-parallel ranks, and within float32 rounding on
2 ranks of one sequence-parallel group. The ranks of a sequence-parallel group split the decoding and scoring of the
videos they sample together, in evaluation and in a training rollout, and share the scores."""

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


def _reports(evaluations: Path, layout: str) -> tuple[dict, dict]:
    single = json.loads((evaluations / "world1_k1" / "report.json").read_text())
    sharded = json.loads((evaluations / layout / "report.json").read_text())
    assert len(single["prompts"]) == 5 and len(single["videos"]) == 3
    return single, sharded


def _frames(evaluations: Path, layout: str) -> tuple[np.ndarray, np.ndarray]:
    return np.load(evaluations / "world1_k1" / "frames.npy"), np.load(evaluations / layout / "frames.npy")


def test_data_parallel_evaluation_equals_one_rank_bit_for_bit(evaluations):
    # Each prompt is sampled whole on one rank, by the computation one rank runs, and the scores are summed in
    # prompt order whatever rank scored them (stages/evaluate.py's _assembled): nothing may differ.
    single, sharded = _reports(evaluations, "world2_k1")
    assert sharded == single  # metrics, prompts in order, every score, the written videos' bytes
    single_frames, sharded_frames = _frames(evaluations, "world2_k1")
    assert np.array_equal(single_frames, sharded_frames)


# A sequence-parallel group runs each forward on token shards with all-to-alls between them: the same maths as one
# rank, associated differently in float32, so a pixel can land one uint8 step away from one rank's. That moved a
# score, and eval/reward (-0.5934502 against -0.5934503), by about 1e-7 relative on a loaded machine. Scores and
# metrics are held to 1e-6 relative (ten times that) and key frames to one uint8 step: a shard in the wrong place,
# a prompt scored twice or a wrong order moves them by orders of magnitude more.
SEQUENCE_PARALLEL_REL = 1e-6


def test_sequence_parallel_evaluation_equals_one_rank_within_float32_rounding(evaluations):
    single, sharded = _reports(evaluations, "world2_k2")
    assert sharded["prompts"] == single["prompts"] and sharded["videos"].keys() == single["videos"].keys()
    assert sharded["metrics"] == pytest.approx(single["metrics"], rel=SEQUENCE_PARALLEL_REL)
    assert sharded["scores"].keys() == single["scores"].keys()
    for name, values in single["scores"].items():
        assert sharded["scores"][name] == pytest.approx(values, rel=SEQUENCE_PARALLEL_REL), name
    single_frames, sharded_frames = _frames(evaluations, "world2_k2")
    assert np.abs(single_frames.astype(int) - sharded_frames.astype(int)).max() <= 1


def test_each_batch_is_sampled_on_one_data_parallel_rank(evaluations):
    forwards = lambda layout, rank: int((evaluations / layout / f"forwards_rank{rank}.txt").read_text())  # noqa: E731
    assert forwards("world1_k1", 0) == 3 * 3  # 3 batches x 3 steps
    # Batches [0, 1] and [4] on rank 0, [2, 3] and a discarded one on rank 1 (ZeRO-3 needs equal forwards).
    assert forwards("world2_k1", 0) == forwards("world2_k1", 1) == 2 * 3
    # One sequence-parallel group: both ranks sample every batch, each holding half of its tokens.
    assert forwards("world2_k2", 0) == forwards("world2_k2", 1) == 3 * 3


def _rollout(evaluations: Path, layout: str, rank: int) -> dict:
    return json.loads((evaluations / layout / f"rollout_rank{rank}.json").read_text())


def test_each_rank_of_a_sequence_parallel_group_decodes_its_share(evaluations):
    decoded = lambda layout, rank: _rollout(evaluations, layout, rank)["decoded"]  # noqa: E731
    assert decoded("world1_k1", 0) == {"evaluation": 5, "rollout": 4}
    # Evaluation batches [0, 1], [2, 3], [4], sampled by both ranks of the group: rank 0 decodes the first and the
    # third, rank 1 the second (each decoded all 5 when the group's first rank scored them). The rollout's four
    # batches of one sample: two each.
    assert decoded("world2_k2", 0) == {"evaluation": 3, "rollout": 2}
    assert decoded("world2_k2", 1) == {"evaluation": 2, "rollout": 2}


def test_a_sequence_parallel_groups_rollout_rewards_are_one_ranks(evaluations):
    single = _rollout(evaluations, "world1_k1", 0)["rewards"]
    first, second = (_rollout(evaluations, "world2_k2", rank)["rewards"] for rank in (0, 1))
    assert len(single) == 4 and None not in single
    assert first == second  # the group shares one set of scores
    # Each sample's video decoded and scored on one rank of the group: the tokens' split rounds as in evaluation.
    assert first == pytest.approx(single, rel=SEQUENCE_PARALLEL_REL)
