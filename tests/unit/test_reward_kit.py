"""The reward plug-in kit: prompt metadata as keyword arguments, bounded and contained reward calls, the failed-sample
limit and the no-weights default."""

import logging
import time
from pathlib import Path

import pytest
import torch

from sage_grpo.core.errors import UserError
from sage_grpo.core.rewards import RewardSpec, VideoBatch
from sage_grpo.stages.score import RewardFailure, Scorer

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture(autouse=True)
def user_rewards_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def videos(count):
    return VideoBatch([torch.zeros(2, 8, 8, 3, dtype=torch.uint8) for _ in range(count)], fps=8.0)


def scorer(*specs, **scoring):
    return Scorer([RewardSpec(**spec) for spec in specs], **{"retry_delay_s": 0.0} | scoring)


# --- Prompt metadata reaches rewards as keyword arguments --------------------------------------------------------


def test_a_reward_gets_its_named_column_aligned_with_its_sub_batches():
    run = scorer({"name": "user_rewards.kit:StyleMatch", "batch_size": 2})
    metadata = [{"style": "anime", "id": "1"}, {"style": "real"}, {"style": "anime"}]
    result = run.score(videos(3), ["a", "b", "c"], metadata)
    assert result.dimensions["style_match"] == [1.0, 0.0, 1.0] and result.total == [1.0, 0.0, 1.0]
    assert run.rewards[0][1].calls == [
        {"prompts": ["a", "b"], "style": ["anime", "real"]},
        {"prompts": ["c"], "style": ["anime"]},
    ]


def test_kwargs_rewards_get_every_column_with_none_where_a_prompt_lacks_it():
    run = scorer({"name": "user_rewards.kit:AllColumns"})
    result = run.score(videos(2), ["a", "b"], [{"style": "anime", "fps": 24}, {"style": "real"}])
    assert run.rewards[0][1].seen == {"style": ["anime", "real"], "fps": [24, None]}
    assert result.dimensions["columns_set"] == [2.0, 1.0]


def test_plain_and_optional_column_rewards_run_with_or_without_metadata():
    run = scorer({"name": "brightness"}, {"name": "user_rewards.kit:OptionalSeed", "weights": {}})
    assert run.score(videos(2), ["a", "b"]).dimensions["seeded"] == [-1.0, -1.0]
    assert run.score(videos(2), ["a", "b"], [{"seed": 7}, {"other": 1}]).dimensions["seeded"] == [7.0, -1.0]


def test_a_required_column_no_prompt_has_is_one_line_naming_reward_and_column():
    run = scorer({"name": "user_rewards.kit:StyleMatch"})
    with pytest.raises(UserError) as error:
        run.check_metadata([{"mood": "calm"}])
    message = str(error.value)
    assert "user_rewards.kit:StyleMatch" in message and "style" in message and "mood" in message
    assert "\n" not in message
    with pytest.raises(UserError, match="needs the prompt column"):
        run.score(videos(1), ["a"])
    run.check_metadata([{"style": "anime"}, {}])  # one prompt having it is enough: the others get None


# --- Bounded, contained reward calls -----------------------------------------------------------------------------


@pytest.fixture
def hang_release():
    from user_rewards.kit import Hangs

    Hangs.release.clear()
    yield
    Hangs.release.set()  # lets the abandoned threads finish


def test_a_reward_that_never_returns_times_out_is_retried_and_fails_its_samples(hang_release, caplog):
    run = scorer(
        {"name": "user_rewards.kit:Hangs", "weights": {"hangs": 1.0}},
        {"name": "brightness"},
        timeout_s=0.2,
        retries=1,
        max_failed_fraction=1.0,
    )
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="sage_grpo.stages.score"):
        result = run.score(videos(3), ["a", "b", "c"])
    assert time.monotonic() - started < 5
    assert result.total == [None] * 3 and result.failed == {"user_rewards.kit:Hangs": 3}
    assert all(value is not None for value in result.dimensions["brightness"])
    assert run.rewards[0][1].calls == 2  # one call, one retry
    timeouts = [r.getMessage() for r in caplog.records if "scoring.timeout_s" in r.getMessage()]
    assert len(timeouts) == 2 and all("'user_rewards.kit:Hangs'" in message for message in timeouts)


def test_a_reward_that_calls_sys_exit_fails_its_samples_with_one_warning(caplog):
    run = scorer(
        {"name": "user_rewards.kit:Exits", "weights": {}}, {"name": "brightness"}, retries=2, max_failed_fraction=1.0
    )
    with caplog.at_level(logging.WARNING, logger="sage_grpo.stages.score"):
        result = run.score(videos(2), ["a", "b"])
    assert result.failed == {"user_rewards.kit:Exits": 2} and result.total == [None, None]
    assert run.rewards[0][1].calls == 1  # exiting is deliberate: not retried
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'user_rewards.kit:Exits'" in warnings[0] and "SystemExit" in warnings[0]


def test_sys_exit_is_contained_without_a_timeout_too():
    run = scorer({"name": "user_rewards.kit:Exits", "weights": {}}, timeout_s=None, max_failed_fraction=1.0)
    assert run.score(videos(1), ["a"]).failed == {"user_rewards.kit:Exits": 1}


def test_ctrl_c_in_a_reward_still_stops_the_run():
    run = scorer({"name": "brightness"})

    def interrupted(videos, prompts):
        raise KeyboardInterrupt

    run.rewards[0] = (run.rewards[0][0], interrupted)
    with pytest.raises(KeyboardInterrupt):
        run.score(videos(1), ["a"])


def test_the_worker_thread_inherits_grad_mode():
    seen = []
    run = scorer({"name": "brightness"})
    run.rewards[0] = (run.rewards[0][0], lambda v, p: seen.append(torch.is_grad_enabled()) or {"b": [1.0]})
    with torch.no_grad():
        run.score(videos(1), ["a"])
    run.score(videos(1), ["a"])
    assert seen == [False, True]


# --- The failed-sample limit -------------------------------------------------------------------------------------


def test_more_failed_samples_than_allowed_stops_the_run_naming_the_reward_and_the_error():
    spec = {"name": "user_rewards.kit:FailsFor", "kwargs": {"bad": ["a", "c"]}, "batch_size": 1}
    prompts = ["a", "b", "c", "d"]
    assert scorer(spec, retries=0, max_failed_fraction=0.5).score(videos(4), prompts).failed == {
        "user_rewards.kit:FailsFor": 2
    }  # exactly half: allowed
    with pytest.raises(RewardFailure) as error:
        scorer(spec, retries=0, max_failed_fraction=0.25).score(videos(4), prompts)
    message = str(error.value)
    assert message == (
        "reward 'user_rewards.kit:FailsFor' failed for 2 of 4 samples, more than "
        "scoring.max_failed_fraction=0.25; last error: RuntimeError: cannot judge 'c'"
    )
    assert isinstance(error.value, UserError)


# --- Weights: extra dimensions are reported, not summed, unless weighted ------------------------------------------


def test_one_dimension_without_weights_counts_with_weight_one():
    result = scorer({"name": "brightness"}).score(videos(1), ["a"])
    assert result.weights == {"brightness": 1.0} and result.total == result.dimensions["brightness"]


def test_several_dimensions_without_weights_is_a_one_line_error_saying_what_to_set():
    with pytest.raises(UserError) as error:
        scorer({"name": "user_rewards.kit:Judge"}).score(videos(1), ["a"])
    assert "reports 2 dimensions (judge, judge_confidence) and no weights" in str(error.value)
    assert "\n" not in str(error.value)


def test_default_weights_leave_the_extra_dimension_reported_only():
    result = scorer({"name": "user_rewards.kit:WeightedJudge"}).score(videos(2), ["a", "b"])
    assert result.weights == {"judge": 1.0}
    assert result.dimensions["judge_confidence"] == [0.5, 0.5] and result.total == [1.0, 1.0]
