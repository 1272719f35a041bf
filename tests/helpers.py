"""What many tests need, in one place: a free loopback port, and waiting for a server process to answer HTTP."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now (loopback only)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_answering(
    url: str,
    process: subprocess.Popen,
    timeout_s: float,
    *,
    on_failure: Callable[[], str],
    any_http_answer: bool = False,
) -> None:
    """Poll ``url`` until it answers (any HTTP status counts with ``any_http_answer``), the process dies, or the
    timeout passes; then raise with ``on_failure()`` (e.g. the server's log tail) after the caller's cleanup."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            if any_http_answer:
                return
            time.sleep(0.1)
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up:\n{on_failure()}")
