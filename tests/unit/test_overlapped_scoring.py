"""Scoring overlapped with generation: ``generate(on_batch=...)`` hands each decoded batch over as soon as it is done,
and ``Scorer.overlapped`` scores it in a worker thread while the next batch is generated, ending with the same
ScoredBatch as ``Scorer.score`` on the whole rollout."""

from pathlib import Path

import pytest
import torch

from sage_grpo.core.errors import UserError
from sage_grpo.core.models.tiny import tiny_hunyuan15
from sage_grpo.core.rewards import RewardSpec, VideoBatch
from sage_grpo.stages.rollout import SDEConfig, generate
from sage_grpo.stages.score import Scorer

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parents[1] / "fixtures"
SDE = SDEConfig(variant="sage", eta=0.5, steps=3, shift=3.0)


@pytest.fixture(autouse=True)
def user_rewards_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def scorer(*specs, **scoring):
    return Scorer([RewardSpec(**spec) for spec in specs], **{"retry_delay_s": 0.0} | scoring)


def random_videos(count, seed=0):
    return torch.randint(0, 256, (count, 2, 8, 8, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def adapter():
    return tiny_hunyuan15(seed=0)


def test_generate_hands_over_every_batch_as_decoded_and_the_rollout_is_unchanged(adapter):
    handed = []
    rollout = generate(
        adapter,
        ["a red ball", "a blue car"],
        2,
        SDE,
        seed=1,
        batch_size=3,
        progress=False,
        on_batch=lambda videos, index: handed.append((videos.clone(), index.tolist())),
    )
    plain = generate(adapter, ["a red ball", "a blue car"], 2, SDE, seed=1, batch_size=3, progress=False)
    assert [index for _, index in handed] == [[0, 1, 2], [3]]
    for videos, index in handed:
        assert torch.equal(videos, rollout.videos[index])
    assert torch.equal(rollout.videos, plain.videos) and torch.equal(rollout.log_probs, plain.log_probs)
    with pytest.raises(ValueError, match="decode"):
        generate(adapter, ["a"], 2, SDE, seed=1, decode=False, on_batch=lambda videos, index: None)


def test_overlapped_result_equals_scoring_everything_at_once():
    specs = ({"name": "brightness"}, {"name": "user_rewards.kit:StyleMatch", "batch_size": 2})
    prompts = list("abcde")
    metadata = [{"style": s} for s in ("anime", "real", "anime", "anime", "real")]
    videos = random_videos(5)
    whole = scorer(*specs).score(VideoBatch.from_tensor(videos, 8), prompts, metadata)
    run = scorer(*specs)
    with run.overlapped(prompts, metadata, fps=8) as sink:
        sink.submit(videos[3:], [3, 4])  # batches may arrive in any order
        sink.submit(videos[:3], torch.arange(3))
        overlapped = sink.result()
    assert overlapped == whole
    # Each batch was scored on its own: StyleMatch saw sub-batches of at most 2 within each submitted batch.
    assert [call["style"] for call in run.rewards[1][1].calls] == [["anime", "real"], ["anime", "real"], ["anime"]]


def test_a_batch_is_scored_while_the_next_one_is_generated(adapter):
    from user_rewards.overlap import Gate

    Gate.opened.clear()
    run = scorer({"name": "user_rewards.overlap:Gate"})
    prompts = ["a red ball", "a blue car"]
    sample_prompts = [p for p in prompts for _ in range(2)]

    def on_batch(videos, index):
        sink.submit(videos, index)
        if index.tolist() == [2, 3]:  # the second batch is generated: only now may the first one's scoring end
            Gate.opened.set()

    with run.overlapped(sample_prompts, fps=adapter.fps) as sink:
        rollout = generate(adapter, prompts, 2, SDE, seed=1, batch_size=2, progress=False, on_batch=on_batch)
        scored = sink.result()
    calls = run.rewards[0][1].calls
    assert calls[0]["saw_opened"]  # batch 0 was still being scored
    assert all(call["thread"] != "MainThread" for call in calls)
    assert all(call["grad"] for call in calls)  # the grad mode of the thread that opened the sink, not generate's
    assert (
        scored.total
        == scorer({"name": "user_rewards.overlap:Gate"})
        .score(VideoBatch.from_tensor(rollout.videos, adapter.fps), sample_prompts)
        .total
    )


def test_a_rewards_error_is_raised_by_result_and_every_sample_must_be_submitted():
    run = scorer({"name": "user_rewards.overlap:WrongLength"})
    with run.overlapped(list("ab"), fps=8) as sink:
        sink.submit(random_videos(2), [0, 1])
        with pytest.raises(UserError, match="WrongLength"):
            sink.result()
    with scorer({"name": "brightness"}).overlapped(list("abc"), fps=8) as sink:
        sink.submit(random_videos(2), [0, 1])
        with pytest.raises(ValueError, match="2 of 3 samples"):
            sink.result()
        with pytest.raises(ValueError, match="repeat"):
            sink.submit(random_videos(1), [1])
