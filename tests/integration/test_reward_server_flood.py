"""The reward server under a socket flood: one peer holding ~600 idle sockets, the way a misbehaving client (or an
attacker inside the cluster) would, against a real server process with its default bounds. Loopback has the whole
127.0.0.0/8, so the flood comes from 127.0.0.2 and the authorised client from 127.0.0.1, two peers."""

import re
import selectors
import socket
import threading
import urllib.error
import urllib.request

import pytest

from sage_grpo.core.rewards.base import RewardUnavailable
from sage_grpo.core.rewards.remote import RemoteReward
from sage_grpo.core.rewards.server import ServerSettings
from sage_grpo.core.rewards.simple import Brightness
from tests.integration.test_reward_server import (
    PROMPTS,
    Served,
    batch,
    user_rewards_importable,  # noqa: F401 (an autouse fixture: the served user rewards import here too)
)

pytestmark = pytest.mark.integration

FLOOD_SOCKETS = 600
FLOODER = "127.0.0.2"
TOKEN = "flood-test-token"


class IdleFlood:
    """``count`` sockets from ``source`` that connect and send nothing; those the server closes are reopened every
    0.2 s, so the peer keeps ``count`` open from its side for as long as the flood runs."""

    def __init__(self, port: int, source: str, count: int):
        self.port, self.source = port, source
        self.selector = selectors.DefaultSelector()
        self.first_answers: list[bytes] = []  # what the server said to each socket it closed, in order
        self.stop = threading.Event()
        for _ in range(count):
            self._open()
        self.thread = threading.Thread(target=self._hold, daemon=True)

    def _open(self) -> None:
        held = socket.socket()
        held.bind((self.source, 0))
        held.connect(("127.0.0.1", self.port))
        self.selector.register(held, selectors.EVENT_READ)

    def _hold(self) -> None:
        while not self.stop.is_set():
            for key, _ in self.selector.select(timeout=0.2):  # readable: answered, or closed by the server
                held = key.fileobj
                self.selector.unregister(held)
                try:
                    self.first_answers.append(held.recv(64).split(b"\r\n")[0])
                except OSError as error:
                    self.first_answers.append(repr(error).encode())
                held.close()
                self._open()
            self.stop.wait(0.2)

    def __enter__(self) -> "IdleFlood":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()
        self.selector.close()


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_an_authorised_client_is_scored_while_one_peer_holds_600_idle_sockets(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOOD_TOKEN", TOKEN)
    # Default bounds (max_connections 512, 64 per client) but a read timeout longer than the test, so every idle
    # socket the server accepts stays held the whole time, however slow the machine.
    served = Served(
        tmp_path, [{"name": "brightness"}], env={"FLOOD_TOKEN": TOKEN}, token_env="FLOOD_TOKEN", read_timeout_s=600
    )
    try:
        with IdleFlood(served.port, FLOODER, FLOOD_SOCKETS) as flood:
            statuses = [health(served.url) for _ in range(5)]
            client = RemoteReward(served.url, retries=0, timeout=30, token_env="FLOOD_TOKEN")
            scored = [client(batch()[:2], PROMPTS[:2]) for _ in range(10)]  # retries=0: one 503 raises
            with pytest.raises(RewardUnavailable, match="401"):  # the token is still required
                RemoteReward(served.url, retries=0, timeout=30)(batch()[:1], PROMPTS[:1])
            statuses += [health(served.url) for _ in range(5)]
            refused = list(flood.first_answers)
    finally:
        served.stop()
    assert statuses == [200] * 10
    expected = Brightness()(batch()[:2], PROMPTS[:2])["brightness"]
    assert all(scores["brightness"] == pytest.approx(expected) for scores in scored)
    # The server kept at most its per-client limit of the flood's sockets and told the rest so at once.
    per_client = ServerSettings().max_connections_per_client
    assert len(refused) >= FLOOD_SOCKETS - per_client
    assert set(refused) == {b"HTTP/1.1 503 Service Unavailable"}, set(refused)
    log = served.log()
    assert f"refused request from {FLOODER}: 503" in log and "Traceback" not in log
    assert log.count(f"from {FLOODER}: 503") == 1  # once while the peer stays at its limit, not once a socket


def test_a_pipelined_request_left_unfinished_is_cut_at_the_read_deadline(tmp_path):
    # One packet: a whole GET /health, then the start of a second request that never ends. The second request's
    # bytes arrive before the first answer, so the deadline must start when that answer is sent, not on new bytes.
    served = Served(tmp_path, [{"name": "brightness"}], read_timeout_s=1.0)
    try:
        with socket.create_connection(("127.0.0.1", served.port), timeout=30) as connection:
            connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nPOST /score HTTP/1.1\r\nHost: x\r\n")
            answers = connection.makefile("rb").read()  # until the server closes the connection
    finally:
        served.stop()
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answers) == [b"200", b"408"], answers[-300:]  # one after the other
    assert "refused request from 127.0.0.1: 408" in served.log()
