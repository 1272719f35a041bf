"""The reward server, a real process, against what a client nobody vouched for would send: sockets that never
finish a request, a reward call that hangs, and metadata built to break the decoder or collide
with a reward's own parameter names. Each family must leave the server scoring real requests."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from sage_grpo.core.rewards import RewardSpec
from sage_grpo.core.rewards.base import RewardUnavailable
from sage_grpo.core.rewards.remote import RemoteReward
from sage_grpo.stages.score import Scorer
from tests.integration.test_reward_server import (
    GOOD_VIDEO,
    PROMPTS,
    Served,
    batch,
    exchange,
    good_request,
    post,
    safetensors_body,
    user_rewards_importable,  # noqa: F401 (an autouse fixture: the served user rewards import here too)
)

pytestmark = pytest.mark.integration

TOKEN = "probe-token"
AUTHORIZED = f"Authorization: Bearer {TOKEN}\r\n"


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def wait_for(condition, within_s: float):
    """``condition()``'s first truthy value, polled until ``within_s`` passes (then the last value)."""
    deadline = time.monotonic() + within_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


# --- Sockets that never finish a request must not take the workers from real requests ----------------------------

BODY = b"x" * 100
ATTACKS = {  # bytes sent, then the socket idles until the server cuts it (and the attacker opens another)
    "connected, nothing sent": b"",
    "half a request line": b"POST /sco",
    "headers never ended": b"POST /score HTTP/1.1\r\nHost: x\r\n",
    "authorized head, body never sent": post(b"", length=len(BODY), extra=AUTHORIZED),
    "authorized head, half the body": post(BODY[:50], length=len(BODY), extra=AUTHORIZED),
    "no token, body never sent": post(b"", length=len(BODY)),
    "wrong token, body never sent": post(b"", length=len(BODY), extra="Authorization: Bearer guess\r\n"),
}


def hold_sockets(port: int, raw: bytes, count: int, stop: threading.Event, answers: list) -> None:
    """Keep ``count`` sockets that sent ``raw`` open; each one the server answers or cuts is reopened at once."""
    while not stop.is_set():
        sockets = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(count)]
        try:
            for held in sockets:
                held.sendall(raw)
            for held in sockets:
                answers.append(held.makefile("rb").readline())
        except OSError as error:
            answers.append(repr(error).encode())
        finally:
            for held in sockets:
                held.close()


@pytest.mark.parametrize("attack", ATTACKS)
def test_sockets_that_never_finish_a_request_do_not_starve_scoring(tmp_path, monkeypatch, attack):
    monkeypatch.setenv("PROBE_TOKEN", TOKEN)
    served = Served(
        tmp_path,
        [{"name": "brightness"}],
        env={"PROBE_TOKEN": TOKEN},
        token_env="PROBE_TOKEN",
        workers=4,
        read_timeout_s=1.0,
    )
    stop, answers = threading.Event(), []
    attacker = threading.Thread(target=hold_sockets, args=(served.port, ATTACKS[attack], 8, stop, answers))
    try:
        attacker.start()
        time.sleep(0.3)  # the 8 sockets (twice the workers) are open before the real requests start
        client = RemoteReward(served.url, retries=0, timeout=30, token_env="PROBE_TOKEN")
        scored = [client(batch()[:2], PROMPTS[:2]) for _ in range(40)]  # raises on any 503
    finally:
        stop.set()
        attacker.join(timeout=30)
        served.stop()
    assert all(len(scores["brightness"]) == 2 for scores in scored)
    # Each held socket was answered for what it did (408 cut, 401 refused), never 503 for lack of a worker.
    statuses = {answer.split()[1] for answer in answers if answer.startswith(b"HTTP/")}
    assert statuses and statuses <= {b"408", b"401"}, answers[:5]
    assert "Traceback" not in served.log()


# --- A reward call that outlives its timeout -----------------------------------------------------------------------


def hanging_server(tmp_path, seconds: float, max_hung_calls: int) -> Served:
    """A server whose reward sleeps ``seconds`` on the prompt "hang" (else scores at once), with a 1 s timeout."""
    return Served(
        tmp_path,
        [{"name": "user_rewards.served:HangsOn", "kwargs": {"prompt": "hang", "seconds": seconds}}],
        request_timeout_s=1,
        max_hung_calls=max_hung_calls,
    )


def score(url: str, prompts: list[str]) -> dict:
    return RemoteReward(url, retries=0, timeout=30)(batch()[: len(prompts)], prompts)


def test_a_hung_call_makes_the_server_unhealthy_until_it_can_score_again(tmp_path):
    # No abandoned call may run beside fresh rewards: the server is unhealthy until the hung call returns (4 s).
    served = hanging_server(tmp_path, seconds=4, max_hung_calls=0)
    try:
        assert health(served.url)[0] == 200
        with pytest.raises(RewardUnavailable, match="503"):
            score(served.url, ["hang"])
        status, unhealthy = wait_for(lambda: (answer := health(served.url))[0] == 503 and answer, within_s=5)
        with pytest.raises(RewardUnavailable, match="503"):  # refused at once while unhealthy, not queued
            score(served.url, ["a cat"])
        assert wait_for(lambda: health(served.url)[0] == 200, within_s=30)
        scores = score(served.url, ["a cat", "a dog"])
    finally:
        served.stop()
    assert status == 503 and unhealthy["status"] == "unhealthy" and "abandoned" in unhealthy["reason"]
    assert scores["mean"] == pytest.approx([float(video.float().mean()) for video in batch()[:2]])
    assert "rewards rebuilt" in served.log() and "Traceback" not in served.log()


def test_hung_calls_are_replaced_until_too_many_still_run(tmp_path):
    served = hanging_server(tmp_path, seconds=60, max_hung_calls=2)
    try:
        after_hangs = []
        for _ in range(2):  # each hung call is abandoned and fresh rewards score what follows
            with pytest.raises(RewardUnavailable, match="503"):
                score(served.url, ["hang"])
            after_hangs.append(wait_for(lambda: _scores_or_none(served.url), within_s=30))
        with pytest.raises(RewardUnavailable, match="503"):  # a third: more than max_hung_calls still running
            score(served.url, ["hang"])
        unhealthy = wait_for(lambda: health(served.url)[0] == 503, within_s=5)
        time.sleep(2)
        still_unhealthy = health(served.url)
    finally:
        served.stop()
    assert all(scores is not None and len(scores["mean"]) == 2 for scores in after_hangs)
    assert unhealthy and still_unhealthy[0] == 503 and "3 abandoned reward calls" in still_unhealthy[1]["reason"]
    assert served.log().count("rewards rebuilt") == 2 and "Traceback" not in served.log()


def _scores_or_none(url: str) -> dict | None:
    try:
        return score(url, ["a cat", "a dog"])
    except RewardUnavailable:
        return None


# --- Metadata built to break the decoder: one 4xx line each, and the server goes on ---------------------------------

DEEP = "[" * 100_000 + "]" * 100_000
HOSTILE_METADATA = {  # name: safetensors metadata (prompts, fps, columns) of a one-video request
    "columns nested 100,000 deep": {"prompts": '["a"]', "fps": "4", "columns": '{"x": [' + DEEP + "]}"},
    "a column value nested 100,000 deep": {"prompts": '["a"]', "fps": "4", "columns": '{"x": ' + DEEP + "}"},
    "prompts nested 100,000 deep": {"prompts": DEEP, "fps": "4"},
    "a 5,000-digit integer in a column": {"prompts": '["a"]', "fps": "4", "columns": '{"x": [' + "9" * 5000 + "]}"},
    "a 5,000-digit integer as prompts": {"prompts": "9" * 5000, "fps": "4"},
    "fps nested": {"prompts": '["a"]', "fps": "[[[4]]]"},
    "a lone surrogate in a prompt": {"prompts": '["a \\ud800 b"]', "fps": "4"},
    "a lone surrogate in a column name": {"prompts": '["a"]', "fps": "4", "columns": '{"\\udfff": [1]}'},
}


@pytest.fixture(scope="module")
def columns_server(tmp_path_factory):
    rewards = [{"name": "user_rewards.kit:AllColumns"}, {"name": "user_rewards.kit:AllColumnsRenamed"}]
    served = Served(tmp_path_factory.mktemp("columns"), rewards)
    yield served
    served.stop()


@pytest.mark.parametrize("name", HOSTILE_METADATA)
def test_hostile_metadata_is_one_4xx_line(columns_server, name):
    before = columns_server.log().count("refused")
    status = exchange(columns_server.port, post(safetensors_body({"video_0": GOOD_VIDEO}, **HOSTILE_METADATA[name])))
    assert status == 400
    log = columns_server.log()
    assert log.count("refused") == before + 1 and "Traceback" not in log
    assert "columns_set" in good_request(columns_server.url)


# A reward taking ``**columns`` cannot receive a column named like a parameter its call fills by position (Python
# raises "got multiple values"): such a column is not passed to it; every other column is, over HTTP as in process.
COLLIDING_COLUMNS = ["self", "this", "clips", "texts", "videos_", "__class__"]


@pytest.mark.parametrize("column", COLLIDING_COLUMNS)
def test_columns_named_like_a_rewards_parameters_score_as_in_process(columns_server, column):
    metadata = [{column: "x", "style": "anime"}, {column: None}]
    rewards = ["user_rewards.kit:AllColumns", "user_rewards.kit:AllColumnsRenamed"]
    local = Scorer([RewardSpec(name=name, weights={}) for name in rewards]).score(batch()[:2], PROMPTS[:2], metadata)
    remote = Scorer([RewardSpec(name="remote", kwargs={"url": columns_server.url}, weights={})], retries=0)
    over_http = remote.score(batch()[:2], PROMPTS[:2], metadata)
    assert over_http.dimensions == local.dimensions and not over_http.failed
    # ``self`` cannot reach AllColumns' **columns, ``this``/``clips``/``texts`` cannot reach AllColumnsRenamed's.
    receives = {"columns_set": column != "self", "renamed_columns_set": column not in ("this", "clips", "texts")}
    for dimension, received in receives.items():
        assert local.dimensions[dimension] == [1.0 + received, 0.0], dimension
    assert "Traceback" not in columns_server.log()
