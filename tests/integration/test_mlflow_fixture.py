"""The shared ``mlflow server`` fixture survives its port being taken between picking it and binding it (another
xdist worker's server did exactly that in CI)."""

import socket
import urllib.request

import pytest

from tests.integration.mlflow_fixture import MlflowServer

pytestmark = pytest.mark.integration


def test_a_first_start_moves_off_a_port_taken_before_the_server_binds_it(tmp_path):
    server = MlflowServer(tmp_path)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", server.port))
        squatter.listen()
        taken = server.port
        server.start()
        try:
            assert server.port != taken and server.url.endswith(f":{server.port}")
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as answer:
                assert answer.status == 200
        finally:
            server.stop()
