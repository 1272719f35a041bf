"""Real servers for integration tests: moto's standalone S3 server as a subprocess, never moto's in-process mocks,
so that requests cross a real socket and botocore's retries, timeouts and transfer manager run as in production."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import boto3
import pytest

from tests.helpers import free_port, wait_until_answering
from tests.integration.mlflow_fixture import mlflow_server  # noqa: F401  (a real `mlflow server`, module scope)

MOTO_SERVER = Path(sys.executable).parent / "moto_server"
STARTUP_TIMEOUT_S = 30.0


class MotoServer:
    """``moto_server -H 127.0.0.1 -p <port>`` from this interpreter's bin directory, logging to ``workdir``."""

    def __init__(self, workdir: Path):
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._log = workdir / "moto-server.log"
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        if not MOTO_SERVER.exists():
            pytest.fail(f"{MOTO_SERVER} not found: install the dev extra (moto[server])")
        with open(self._log, "ab") as log:
            self._process = subprocess.Popen(
                [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(self.port)], stdout=log, stderr=subprocess.STDOUT
            )
        self._wait_until_answering()

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=10)

    def _wait_until_answering(self) -> None:
        try:
            wait_until_answering(
                f"{self.endpoint_url}/moto-api/",
                self._process,
                STARTUP_TIMEOUT_S,
                on_failure=lambda: self._log.read_text()[-2000:],
                any_http_answer=True,
            )
        except RuntimeError:
            self.stop()
            raise


class RestartableEndpoint:
    """A port that forwards to a moto server and can be stopped and started again on the same port.

    ``stop()`` looks to clients exactly like the server dying: open connections are cut and new ones refused.
    ``start()`` is the server coming back. Only the forwarding stops, not moto, because moto keeps buckets and
    objects in memory: a restarted moto process would come back empty, which real S3 never does, and a test could
    not tell a broken checkpoint from one the restart erased.
    """

    def __init__(self, server_port: int):
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._server_address = ("127.0.0.1", server_port)
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._connections: list[socket.socket] = []

    def start(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR: the same port right away
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            doomed = [self._listener, *self._connections] if self._listener else self._connections
            self._listener, self._connections = None, []
        for sock in doomed:
            _cut(sock)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stop() closed the listener
            upstream = socket.create_connection(self._server_address)
            with self._lock:
                if self._listener is not listener:  # stopped while this connection was being set up
                    _cut(client)
                    _cut(upstream)
                    return
                self._connections += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_forward, args=(source, sink), daemon=True).start()


def _forward(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
    except OSError:
        pass  # cut by stop(), or by the other direction finishing
    finally:
        _cut(source)
        _cut(sink)


def _cut(sock: socket.socket) -> None:
    # shutdown() wakes threads blocked in accept() or recv() on the socket; close() alone does not on Linux.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[str]:
    """Endpoint URL of a moto S3 server shared by the session."""
    server = MotoServer(tmp_path_factory.mktemp("moto"))
    server.start()
    try:
        yield server.endpoint_url
    finally:
        server.stop()


@pytest.fixture
def restartable_s3_server(s3_server) -> Iterator[RestartableEndpoint]:
    """A second endpoint of the session's server that the test can ``stop()`` and ``start()``; state survives."""
    endpoint = RestartableEndpoint(urlparse(s3_server).port)
    endpoint.start()
    try:
        yield endpoint
    finally:
        endpoint.stop()


@pytest.fixture
def aws_credentials(monkeypatch, tmp_path) -> None:
    """Dummy credentials, and nothing from the developer's own AWS config, so no test can reach a real account."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def make_bucket(aws_credentials) -> Callable[[str], str]:
    """``make_bucket(endpoint_url)`` creates a fresh, empty bucket on that server and returns its name."""

    def create(endpoint_url: str) -> str:
        bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=endpoint_url).create_bucket(Bucket=bucket)
        return bucket

    return create


@pytest.fixture
def s3_bucket(s3_server, make_bucket) -> str:
    """A fresh, empty bucket on the session's server."""
    return make_bucket(s3_server)
