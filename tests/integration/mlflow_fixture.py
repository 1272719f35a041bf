"""A real ``mlflow server`` subprocess for integration tests, restartable on the same port and backend store.

Import the fixture into a test module or conftest: ``from tests.integration.mlflow_fixture import mlflow_server``.
It is module-scoped because the server takes 10-20 s to start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import free_port, wait_until_answering

MLFLOW = Path(sys.executable).parent / "mlflow"
STARTUP_TIMEOUT_S = 90.0
# free_port() only knows a port was free when it asked; the server binds it seconds later (its imports take that
# long), and a test on another xdist worker can take it first. A first start then moves to another port.
PORT_ATTEMPTS = 3


class MlflowServer:
    """``stop`` kills the server abruptly (an outage); ``start`` brings it back with the same runs and artifacts."""

    def __init__(self, workdir: Path, artifacts_destination: str | None = None, environment: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._workdir = workdir
        self._destination = artifacts_destination or str(workdir / "artifacts")
        self._environment = environment or {}
        self._process: subprocess.Popen | None = None
        self._has_run = False  # once it has, restarts keep its port: clients hold the URL

    def start(self) -> None:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._start_once()
                self._has_run = True
                return
            except RuntimeError as error:
                if self._has_run or attempt == PORT_ATTEMPTS or "address already in use" not in str(error):
                    raise
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"

    def _start_once(self) -> None:
        command = [
            str(MLFLOW),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self._workdir / 'mlflow.db'}",
            "--artifacts-destination",
            self._destination,
        ]
        # The job runner is a second process the tests never use; skipping it makes start-up faster.
        environment = {**os.environ, **self._environment, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self._workdir / "mlflow-server.log", "ab") as log:
            # A session of its own: mlflow spawns uvicorn, and stop() must end the whole group.
            self._process = subprocess.Popen(
                command, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_until_healthy()

    def stop(self) -> None:
        if self._process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait(timeout=30)
        self._process = None

    def _wait_until_healthy(self) -> None:
        log = self._workdir / "mlflow-server.log"
        try:
            wait_until_answering(
                f"{self.url}/health",
                self._process,
                STARTUP_TIMEOUT_S,
                on_failure=lambda: log.read_text(errors="replace")[-2000:],
            )
        except RuntimeError:
            self.stop()
            raise


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
