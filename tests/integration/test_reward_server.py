"""The reward server in a real process on loopback, and the ``remote`` reward calling it."""

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from sage_grpo.core.errors import UserError
from sage_grpo.core.rewards import RewardSpec, VideoBatch
from sage_grpo.core.rewards.base import RewardUnavailable
from sage_grpo.core.rewards.remote import RemoteReward
from sage_grpo.core.rewards.server import _Job, _merged_columns
from sage_grpo.core.rewards.simple import Brightness
from sage_grpo.core.rewards.wire import ScoringRequest, encode_request
from sage_grpo.stages.score import Scorer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
SERVED_REWARDS = [
    {"name": "tiny-videoalign"},
    {"name": "brightness", "kwargs": {"target": 0.8}},
    {"name": "user_rewards.safety:KeywordSafety"},
]
# The client weighs what the server reports raw: setting B on VideoAlign plus the two cheap rewards.
CLIENT_WEIGHTS = {"VQ": 0.5, "MQ": 0.5, "TA": 1.0, "brightness": 2.0, "safety": 1.0}


@pytest.fixture(autouse=True)
def user_rewards_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


# The server as ``sagegrpo serve-reward`` runs it, with ServerSettings given directly (the bounds are small here).
LAUNCH = (
    "import json, logging, sys; from sage_grpo.core.rewards.server import ServerSettings, load_reward_specs, serve; "
    "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s'); "
    "serve(load_reward_specs(sys.argv[1]), '127.0.0.1', 0, 'cpu', ServerSettings(**json.loads(sys.argv[2])))"
)


class Served:
    """A reward server subprocess: its URL, port, pid and stderr (the log)."""

    def __init__(self, tmp_path, rewards, env=None, **settings):
        config = tmp_path / "rewards.yaml"
        config.write_text(yaml.safe_dump({"rewards": rewards}))
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(FIXTURES)]), **(env or {})}
        cli = [
            sys.executable,
            "-m",
            "sage_grpo.pipeline.cli",
            "serve-reward",
            str(config),
            "--port",
            "0",
            "--device",
            "cpu",
        ]
        command = [sys.executable, "-c", LAUNCH, str(config), json.dumps(settings)] if settings or env else cli
        self._log_path = tmp_path / "server.log"
        with self._log_path.open("w") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=log, text=True
            )
        line = self.process.stdout.readline()
        if not line.startswith("serving rewards on "):
            self.stop()
            pytest.fail(f"server did not start: {line!r} {self.log()}")
        self.url = line.removeprefix("serving rewards on ").strip()
        self.port = int(self.url.rsplit(":", 1)[1])

    def log(self) -> str:
        return self._log_path.read_text()

    def status(self, field: str) -> int:
        """A number from /proc/PID/status (Threads, VmRSS in kB)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
        raise KeyError(field)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = Served(tmp_path_factory.mktemp("server"), SERVED_REWARDS)
    yield served.url
    served.stop()


def batch():
    generator = torch.Generator().manual_seed(5)
    return VideoBatch(
        [torch.randint(0, 256, (8, 40, 56, 3), dtype=torch.uint8, generator=generator) for _ in range(5)], fps=4.0
    )


PROMPTS = ["a red car", "blood on the floor", "a cat", "the sky", "a dog running"]


def test_health_lists_the_served_rewards(server):
    with urllib.request.urlopen(f"{server}/health", timeout=10) as response:
        assert json.load(response) == {
            "status": "ok",
            "rewards": [reward["name"] for reward in SERVED_REWARDS],
            "max_body_bytes": 1024 * 2**20,
        }


def test_remote_scores_equal_in_process_scores(server):
    remote = Scorer(
        [RewardSpec(name="remote", kwargs={"url": server, "batch_size": 2, "timeout": 60}, weights=CLIENT_WEIGHTS)],
        retries=0,
    )
    local = Scorer(
        [
            RewardSpec(name="tiny-videoalign", weights="setting_b"),
            RewardSpec(name="brightness", kwargs={"target": 0.8}, weights={"brightness": 2.0}),
            RewardSpec(name="user_rewards.safety:KeywordSafety", weights={"safety": 1.0}),
        ]
    )
    over_http, in_process = remote.score(batch(), PROMPTS), local.score(batch(), PROMPTS)
    assert set(over_http.dimensions) == {"VQ", "MQ", "TA", "Overall", "brightness", "safety", "prompt_words"}
    for name, values in in_process.dimensions.items():
        assert over_http.dimensions[name] == pytest.approx(values, abs=1e-6), name
    assert over_http.total == pytest.approx(in_process.total, abs=1e-6)
    assert over_http.dimensions["safety"][1] == 0.0


def test_server_down_retries_then_scores_none(caplog):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    scorer = Scorer(
        [
            RewardSpec(
                name="remote",
                kwargs={"url": f"http://127.0.0.1:{port}", "retries": 2, "backoff": 0.0, "timeout": 5},
                weights={"VQ": 1.0},
            )
        ],
        max_failed_fraction=1.0,
    )
    with caplog.at_level(logging.WARNING, logger="urllib3.connectionpool"):
        result = scorer.score(batch(), PROMPTS)
    retries = [
        record
        for record in caplog.records
        if record.name == "urllib3.connectionpool" and "Retrying" in record.getMessage()
    ]
    assert len(retries) == 2
    assert result.total == [None] * 5 and result.dimensions["VQ"] == [None] * 5
    assert scorer.failures["remote"] == 5


def test_failing_served_reward_answers_500_and_the_client_retries_it(tmp_path, caplog):
    served = Served(tmp_path, [{"name": "user_rewards.safety:Flaky", "kwargs": {"failures": 100}}])
    try:
        scorer = Scorer(
            [RewardSpec(name="remote", kwargs={"url": served.url, "retries": 1, "backoff": 0.0})],
            max_failed_fraction=1.0,
        )
        with caplog.at_level(logging.WARNING):
            result = scorer.score(batch()[:2], PROMPTS[:2])
    finally:
        served.stop()
    assert result.total == [None, None] and result.failed == {"remote": 2}
    assert any(
        "answered 500" in record.getMessage() and "judge API timed out" in record.getMessage()
        for record in caplog.records
    )
    assert served.log().count("judge API timed out") == 2 and "Traceback" not in served.log()  # one line per failure


def test_bad_config_exits_2_with_one_line(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"rewards": [{"name": "brightness", "wieghts": {"x": 1}}]}))
    result = subprocess.run(
        [sys.executable, "-m", "sage_grpo.pipeline.cli", "serve-reward", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "rewards.0.wieghts" in result.stderr


# --- The server as a shared service: bounds, bad requests, authentication, batching ------------------------------
# Every case runs against a real server process over loopback, with small bounds so that each finishes in seconds.

READ_TIMEOUT_S = 1.5
BRIGHTNESS = [{"name": "brightness"}]


def exchange(port: int, raw: bytes, *, timeout: float = 10.0) -> int | None:
    """Send raw bytes, read the answer's status code; None when the server closed without answering."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        with contextlib.suppress(OSError):  # the server refused the body and closed while we were still sending
            connection.sendall(raw)
        try:
            answer = connection.makefile("rb").readline()
        except ConnectionResetError:
            return None
    return int(answer.split()[1]) if answer.startswith(b"HTTP/") else None


def post(body: bytes, *, length: object = None, extra: str = "") -> bytes:
    length = len(body) if length is None else length
    head = (
        f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n{extra}\r\n"
        if length != ""
        else f"POST /score HTTP/1.1\r\nHost: x\r\n{extra}\r\n"
    )
    return head.encode() + body


def safetensors_body(videos: dict, **metadata) -> bytes:
    from safetensors.torch import save

    return save(videos, metadata={key: value for key, value in metadata.items()})


def video(*shape, dtype=torch.uint8) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


GOOD_VIDEO = video(2, 8, 8, 3)
MALFORMED = {  # name: (raw request, expected status)
    "json instead of safetensors": (post(b'{"prompts": ["a"]}'), 400),
    "empty body": (post(b""), 400),
    "truncated safetensors": (post(safetensors_body({"video_0": GOOD_VIDEO}, prompts='["a"]', fps="4")[:-7]), 400),
    "prompts as a dict": (post(safetensors_body({"video_0": GOOD_VIDEO}, prompts='{"a": 1}', fps="4")), 400),
    "zero videos": (post(safetensors_body({}, prompts="[]", fps="4")), 400),
    "prompts not strings": (post(safetensors_body({"video_0": GOOD_VIDEO}, prompts="[1]", fps="4")), 400),
    "prompts not json": (post(safetensors_body({"video_0": GOOD_VIDEO}, prompts="[a", fps="4")), 400),
    "no prompts": (post(safetensors_body({"video_0": GOOD_VIDEO}, fps="4")), 400),
    "fps nan": (post(safetensors_body({"video_0": GOOD_VIDEO}, prompts='["a"]', fps="nan")), 400),
    "fps zero": (post(safetensors_body({"video_0": GOOD_VIDEO}, prompts='["a"]', fps="0")), 400),
    "fps text": (post(safetensors_body({"video_0": GOOD_VIDEO}, prompts='["a"]', fps="fast")), 400),
    "more prompts than videos": (post(safetensors_body({"video_0": GOOD_VIDEO}, prompts='["a", "b"]', fps="4")), 400),
    "columns not json": (post(safetensors_body({"video_0": GOOD_VIDEO}, prompts='["a"]', fps="4", columns="{")), 400),
    "columns a list": (post(safetensors_body({"video_0": GOOD_VIDEO}, prompts='["a"]', fps="4", columns="[1]")), 400),
    "column too short": (
        post(safetensors_body({"video_0": GOOD_VIDEO}, prompts='["a"]', fps="4", columns='{"style": []}')),
        400,
    ),
    "column named prompts": (
        post(safetensors_body({"video_0": GOOD_VIDEO}, prompts='["a"]', fps="4", columns='{"prompts": ["b"]}')),
        400,
    ),
    "misnamed tensor": (post(safetensors_body({"clip": GOOD_VIDEO}, prompts='["a"]', fps="4")), 400),
    "float video": (
        post(safetensors_body({"video_0": video(2, 8, 8, 3, dtype=torch.float32)}, prompts='["a"]', fps="4")),
        400,
    ),
    "3-d video": (post(safetensors_body({"video_0": video(8, 8, 3)}, prompts='["a"]', fps="4")), 400),
    "4 channels": (post(safetensors_body({"video_0": video(2, 8, 8, 4)}, prompts='["a"]', fps="4")), 400),
    "no frames": (post(safetensors_body({"video_0": video(0, 8, 8, 3)}, prompts='["a"]', fps="4")), 400),
    "length not a number": (post(b"x", length="12abc"), 400),
    "negative length": (post(b"x", length=-5), 400),
    "no length": (post(b"x", length=""), 411),
    "length over the limit": (post(b"", length=10 * 2**30), 413),
    "unknown path": (b"POST /admin HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 404),
    "unknown get": (b"GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    "garbage request line": (b"\x00\x01\x02 nonsense\r\n\r\n", 400),
    "tls to plain http": (bytes.fromhex("160301020001") + b"\r\n\r\n", 400),
    "too many headers": (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 150 + b"\r\n", 431),
    "http/1.1 without host": (b"GET /health HTTP/1.1\r\n\r\n", 400),  # RFC 9112 3.2: 400
}


def good_request(url: str, **kwargs) -> dict:
    return RemoteReward(url, retries=0, timeout=30, **kwargs)(batch()[:2], PROMPTS[:2])


@pytest.fixture
def small_server(tmp_path):
    served = Served(tmp_path, BRIGHTNESS, max_body_mb=1, workers=4, read_timeout_s=READ_TIMEOUT_S)
    yield served
    served.stop()


def test_malformed_requests_each_get_their_4xx_and_one_log_line(small_server):
    statuses = {name: exchange(small_server.port, raw) for name, (raw, _) in MALFORMED.items()}
    assert statuses == {name: status for name, (_, status) in MALFORMED.items()}
    log = small_server.log()
    assert "Traceback" not in log
    assert log.count("refused") == len(MALFORMED), log
    assert good_request(small_server.url)["brightness"] == pytest.approx(
        Brightness()(batch()[:2], PROMPTS[:2])["brightness"]
    )


def test_a_slow_client_is_cut_after_the_read_timeout(small_server):
    started = time.monotonic()
    # Declares 1000 bytes, sends 10, then waits: answered 408 once the read timeout passes, not held forever.
    assert exchange(small_server.port, post(b"x" * 10, length=1000)) == 408
    assert READ_TIMEOUT_S <= time.monotonic() - started < READ_TIMEOUT_S + 2
    # A client trickling one byte every 0.3 s never trips a per-read timeout; the whole-request bound cuts it.
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", small_server.port), timeout=10) as trickle:
        try:
            for byte in post(b"x" * 200):
                trickle.sendall(bytes([byte]))
                time.sleep(0.3)
        except OSError:
            pass
    assert time.monotonic() - started < READ_TIMEOUT_S + 2
    assert "Traceback" not in small_server.log() and small_server.log().count("408") == 2
    assert "brightness" in good_request(small_server.url)


def test_many_slow_connections_hold_neither_a_worker_nor_a_thread(small_server):
    idle_threads = small_server.status("Threads")
    connections = [socket.create_connection(("127.0.0.1", small_server.port), timeout=10) for _ in range(40)]
    try:
        for connection in connections:
            connection.sendall(post(b"x" * 10, length=1000))
        threads = small_server.status("Threads")
        scored = good_request(small_server.url)  # 40 slow clients against 4 workers: a whole request is scored
        answers = [connection.makefile("rb").readline() for connection in connections]
    finally:
        for connection in connections:
            connection.close()
    assert threads <= idle_threads  # no thread per connection, none per worker until a request is whole
    assert "brightness" in scored
    assert all(b" 408 " in answer for answer in answers), answers[:3]  # each cut at its read deadline
    assert "Traceback" not in small_server.log()


def test_oversized_bodies_are_refused_before_they_are_read(small_server):
    rss_before = small_server.status("VmRSS")
    chunk = b"\0" * 2**20
    statuses = []
    for _ in range(3):  # 3 clients that each try to push 64 MB at a 1 MB limit
        with socket.create_connection(("127.0.0.1", small_server.port), timeout=10) as connection:
            connection.sendall(post(b"", length=64 * 2**20))
            try:
                for _ in range(64):
                    connection.sendall(chunk)
            except OSError:  # refused and closed: what a client pushing too much should see
                pass
            try:
                statuses.append(connection.makefile("rb").readline())
            except OSError:
                statuses.append(b"reset")
    rss_growth_mb = (small_server.status("VmRSS") - rss_before) / 1024
    assert rss_growth_mb < 16, f"{rss_growth_mb:.0f} MB"
    assert small_server.log().count("413") == 3
    assert "brightness" in good_request(small_server.url)


def test_the_client_splits_batches_to_fit_the_servers_body_limit(tmp_path):
    # One test video is 53,760 bytes: a 0.12 MB limit takes 2 per request, so a batch of 5 needs 3 requests.
    served = Served(tmp_path, BRIGHTNESS, max_body_mb=0.12)
    try:
        scores = RemoteReward(served.url, batch_size=5, retries=0)(batch(), PROMPTS)
    finally:
        served.stop()
    assert scores["brightness"] == pytest.approx(Brightness()(batch(), PROMPTS)["brightness"])
    assert "refused" not in served.log()


def test_a_token_is_required_when_configured_and_never_logged(tmp_path):
    token = "s3cr3t-reward-token"
    served = Served(tmp_path, BRIGHTNESS, env={"REWARD_TOKEN": token}, token_env="REWARD_TOKEN")
    try:
        body = encode_request(batch()[:1], PROMPTS[:1])
        without = exchange(served.port, post(body))
        wrong = exchange(served.port, post(body, extra="Authorization: Bearer guess\r\n"))
        with pytest.raises(RewardUnavailable, match="401"):
            good_request(served.url)
        os.environ["CLIENT_TOKEN"] = token
        try:
            scored = good_request(served.url, token_env="CLIENT_TOKEN")
        finally:
            del os.environ["CLIENT_TOKEN"]
    finally:
        served.stop()
    assert (without, wrong) == (401, 401) and "brightness" in scored
    assert served.log().count("401") == 3 and token not in served.log()


def test_a_hanging_reward_answers_503_within_the_request_timeout(tmp_path):
    # What the server does next (unhealthy, rebuilt rewards) is tested in test_reward_server_hostile_clients.py.
    calls = tmp_path / "calls.txt"
    served = Served(
        tmp_path,
        [{"name": "user_rewards.served:Sleepy", "kwargs": {"seconds": 60, "calls_file": str(calls)}}],
        request_timeout_s=1,
    )
    try:
        with pytest.raises(RewardUnavailable, match="503"):
            good_request(served.url)
    finally:
        served.stop()
    # The server gave up on the call it had started (not the client on the server): one call, still sleeping.
    assert calls.read_text().splitlines() == ["2"]
    assert "did not finish within 1 s" in served.log()


# Rewards taking prompt columns (tests/fixtures/user_rewards/kit.py): one requires ``style``, one takes ``seed`` if
# given, one takes every column.
COLUMN_REWARDS = [
    {"name": "user_rewards.kit:StyleMatch", "kwargs": {"wanted": "anime"}},
    {"name": "user_rewards.kit:OptionalSeed"},
    {"name": "user_rewards.kit:AllColumns"},
]
METADATA = [{"style": "anime", "seed": 3}, {"style": "photo"}, {"style": "anime", "extra": "x"}, {"style": "ink"}, {}]


def test_prompt_columns_reach_the_served_rewards_as_in_process(tmp_path):
    served = Served(tmp_path, COLUMN_REWARDS)
    try:
        remote = Scorer([RewardSpec(name="remote", kwargs={"url": served.url, "batch_size": 2}, weights={})], retries=0)
        over_http = remote.score(batch(), PROMPTS, METADATA)
        local = Scorer([RewardSpec(**reward, weights={}) for reward in COLUMN_REWARDS]).score(
            batch(), PROMPTS, METADATA
        )
        with pytest.raises(UserError, match=r"StyleMatch.*needs the prompt column\(s\) style"):
            remote.score(batch()[:2], PROMPTS[:2], [{"seed": 1}, {"seed": 2}])
    finally:
        served.stop()
    assert over_http.dimensions == local.dimensions
    assert over_http.dimensions["style_match"] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert over_http.dimensions["seeded"] == [3.0, -1.0, -1.0, -1.0, -1.0]
    assert over_http.dimensions["columns_set"] == [2.0, 1.0, 2.0, 1.0, 0.0]  # split in 2s, merged back in order
    log = served.log()
    assert log.count("refused") == 1 and "422" in log and "Traceback" not in log


def test_merged_requests_keep_each_clients_columns():
    def job(columns, size):
        return _Job(ScoringRequest(batch()[:size], PROMPTS[:size], columns))

    merged = _merged_columns([job({"style": ["a", "b"]}, 2), job({}, 1), job({"seed": [7], "style": ["c"]}, 1)])
    assert merged == {"style": ["a", "b", None, "c"], "seed": [None, None, None, 7]}


def sleepy_server(tmp_path, calls) -> Served:
    """A server whose reward sleeps 0.5 s per call and records each call's video count in ``calls``."""
    return Served(
        tmp_path,
        [{"name": "user_rewards.served:Sleepy", "kwargs": {"seconds": 0.5, "calls_file": str(calls)}}],
        max_batch=16,
    )


def test_concurrent_clients_are_batched_together_and_get_their_own_scores(tmp_path):
    calls = tmp_path / "calls.txt"
    served = sleepy_server(tmp_path, calls)
    videos = batch()
    clients = [(videos[index : index + 1], PROMPTS[index : index + 1]) for index in range(5)]
    try:
        with ThreadPoolExecutor(len(clients)) as pool:
            results = list(pool.map(lambda client: RemoteReward(served.url, retries=0)(*client), clients))
    finally:
        served.stop()
    sizes = [int(line) for line in calls.read_text().split()]
    assert sum(sizes) == 5 and len(sizes) < 5, sizes  # requests that waited were scored in one call
    for (client_videos, _), result in zip(clients, results):
        assert result["mean"] == pytest.approx([float(client_videos[0].float().mean())])


def test_one_clients_concurrent_requests_are_merged_into_fewer_reward_calls(tmp_path):
    calls = tmp_path / "calls.txt"
    served = sleepy_server(tmp_path, calls)
    videos = batch()
    try:
        one_at_a_time = RemoteReward(served.url, retries=0, batch_size=1)(videos, PROMPTS)
        sequential_calls = calls.read_text().split()
        calls.write_text("")
        concurrent = RemoteReward(served.url, retries=0, batch_size=1, concurrency=5)(videos, PROMPTS)
    finally:
        served.stop()
    assert sequential_calls == ["1"] * 5
    sizes = [int(line) for line in calls.read_text().split()]
    assert sum(sizes) == 5 and len(sizes) < 5, sizes  # requests that waited for the scorer shared a call
    expected = [float(video.float().mean()) for video in videos]
    assert one_at_a_time["mean"] == pytest.approx(expected) and concurrent["mean"] == pytest.approx(expected)
