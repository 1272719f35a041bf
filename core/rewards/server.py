"""``serve-reward CONFIG --port P``: serve configured rewards over HTTP for the ``remote`` reward.

Endpoints: ``GET /health`` -> ``{"status": "ok", "rewards": [names]}``; ``POST /score`` with a safetensors request
(see ``wire``) -> ``{"dimensions": {...}}`` with every reward's raw, unweighted dimensions (the client weighs them).
A reward that raises answers 500 with a one-line ``{"error": ...}``, which the client retries. Rewards are called
one request at a time: GPU reward models are not thread-safe, and one model at full batch is the fast path anyway.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from pydantic import BaseModel, ConfigDict, Field

from .. import config_loading
from ..errors import UserError
from .base import Scores, VideoBatch, check_scores, join_batches, merge_dimensions
from .registry import RewardSpec, build_reward
from .wire import decode_request, encode_response

logger = logging.getLogger(__name__)


class RewardService:
    """The configured rewards, called under one lock; their dimensions merged into one dict."""

    def __init__(self, specs: list[RewardSpec]):
        self.rewards = [(spec, build_reward(spec)) for spec in specs]
        self.lock = threading.Lock()

    def setup(self, device: str) -> None:
        for _, reward in self.rewards:
            if hasattr(reward, "setup"):
                reward.setup(device)

    def names(self) -> list[str]:
        return [spec.name for spec, _ in self.rewards]

    def score(self, videos: VideoBatch, prompts: list[str]) -> Scores:
        dimensions: Scores = {}
        owners: dict[str, str] = {}
        with self.lock:
            for spec, reward in self.rewards:
                size = spec.batch_size or len(videos)
                chunks = [check_scores(reward(videos[start:start + size], prompts[start:start + size]),
                                       len(prompts[start:start + size]), spec.name)
                          for start in range(0, len(videos), size)]
                merge_dimensions(dimensions, join_batches(chunks), spec.name, owners)
        return dimensions


class _Handler(BaseHTTPRequestHandler):
    server: "_RewardHTTPServer"

    def do_GET(self):
        if self.path != "/health":
            return self._reply(404, {"error": f"no such path {self.path}"})
        self._reply(200, {"status": "ok", "rewards": self.server.service.names()})

    def do_POST(self):
        if self.path != "/score":
            return self._reply(404, {"error": f"no such path {self.path}"})
        try:
            videos, prompts = decode_request(self.rfile.read(int(self.headers["Content-Length"])))
        except Exception as error:  # any malformed body is the client's fault: 400, not a retried 500
            return self._reply(400, {"error": f"bad request: {error}"})
        try:
            dimensions = self.server.service.score(videos, prompts)
        except Exception as error:
            logger.exception("scoring failed")
            return self._reply(500, {"error": f"{type(error).__name__}: {error}".splitlines()[0]})
        self._send(200, encode_response(dimensions))

    def _reply(self, status: int, payload: dict) -> None:
        self._send(status, json.dumps(payload).encode())

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # http.server logs every request to stderr; keep that at debug level
        logger.debug(format, *args)


class _RewardHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], service: RewardService):
        super().__init__(address, _Handler)
        self.service = service


def serve(specs: list[RewardSpec], host: str, port: int, device: str) -> None:
    """Build and set up the rewards, then serve until interrupted. Port 0 picks a free port; the chosen address is
    printed as ``serving rewards on http://HOST:PORT`` once the server accepts connections."""
    service = RewardService(specs)
    service.setup(device)
    try:
        server = _RewardHTTPServer((host, port), service)
    except OSError as error:  # port taken, or an address this machine does not have
        raise UserError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    print(f"serving rewards on http://{host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


class _ServedRewards(BaseModel):
    # extra="ignore": a full training config can be served as is; only its rewards are read.
    model_config = ConfigDict(extra="ignore")

    rewards: list[RewardSpec] = Field(min_length=1)


def load_reward_specs(path: str) -> list[RewardSpec]:
    """The ``rewards:`` list of a YAML config; problems are one-line UserErrors naming the key."""
    return config_loading.validate(_ServedRewards, config_loading.read_yaml(path), source=path).rewards


