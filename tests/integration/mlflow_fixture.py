"""A real ``mlflow server`` subprocess for integration tests, restartable on the same port and backend store.

Import the fixture into a test module or conftest: ``from tests.integration.mlflow_fixture import mlflow_server``.
It is module-scoped because the server takes 10-20 s to start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

MLFLOW = Path(sys.executable).parent / "mlflow"
STARTUP_TIMEOUT_S = 90.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class MlflowServer:
    """``stop`` kills the server abruptly (an outage); ``start`` brings it back with the same runs and artifacts."""

    def __init__(self, workdir: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._workdir = workdir
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        command = [
            str(MLFLOW), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{self._workdir / 'mlflow.db'}",
            "--artifacts-destination", str(self._workdir / "artifacts"),
        ]
        # The job runner is a second process the tests never use; skipping it makes start-up faster.
        environment = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self._workdir / "mlflow-server.log", "ab") as log:
            # A session of its own: mlflow spawns uvicorn, and stop() must end the whole group.
            self._process = subprocess.Popen(
                command, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_until_healthy()

    def stop(self) -> None:
        if self._process is None:
            return
        try:
            os.killpg(self._process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._process.wait(timeout=30)
        self._process = None

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline and self._process.poll() is None:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=1).close()
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        log = (self._workdir / "mlflow-server.log").read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"mlflow server on port {self.port} did not come up:\n{log}")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
