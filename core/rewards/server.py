"""``serve-reward CONFIG --port P``: serve configured rewards over HTTP for the ``remote`` reward.

Endpoints: ``GET /health`` -> ``{"status": "ok", "rewards": [names], "max_body_bytes": N}`` (open, for probes);
``POST /score`` with a safetensors request (see ``wire``) -> ``{"dimensions": {...}}`` with every reward's raw,
unweighted dimensions (the client weighs them). Each reward gets the request's prompt columns it takes (keyword
arguments, as in process); a request lacking a column a reward requires is answered 422 naming it.

A shared service that treats every request as untrusted data (``ServerSettings`` holds the bounds):
- it binds loopback unless told otherwise, and never unpickles;
- at most ``workers`` connections are handled at once (a fixed thread pool); one more is answered 503 at once and
  the client retries, so slow or idle connections cannot grow threads or memory without bound;
- a request must arrive whole within ``read_timeout_s`` (headers and body together: a client that trickles bytes is
  cut), and ``Content-Length`` is checked against ``max_body_mb`` before anything is read;
- with a token configured, ``/score`` needs ``Authorization: Bearer <token>`` (compared in constant time);
- every bad request is answered 4xx with one log line, never a traceback; a reward that raises answers 500 (the
  client retries) and one that does not finish within ``request_timeout_s`` answers 503.
Rewards run on one scoring thread (GPU reward models are not thread-safe); requests that wait for it together are
merged into one batch of up to ``max_batch`` videos (the reward contract scores each video on its own, so merging
changes no score) and each client gets its own slice back.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import json
import logging
import socket
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from http.server import BaseHTTPRequestHandler, HTTPServer

from pydantic import BaseModel, ConfigDict, Field

from .. import config_loading
from ..errors import UserError
from ..secrets import read_secret
from .base import (
    Columns,
    MetadataParameters,
    Scores,
    VideoBatch,
    check_scores,
    join_batches,
    merge_dimensions,
    slice_columns,
)
from .registry import RewardSpec, build_reward
from .wire import BadRequest, ScoringRequest, decode_request, encode_response

logger = logging.getLogger(__name__)


class ServerSettings(BaseModel):
    """The service's bounds; peak request memory is about ``workers x max_body_mb``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_body_mb: float = Field(1024.0, gt=0)  # one request's body (8 videos of 121 x 480 x 848 fit in 1 GB)
    workers: int = Field(8, ge=1)  # connections handled at once
    read_timeout_s: float = Field(60.0, gt=0)  # to receive one whole request
    request_timeout_s: float = Field(600.0, gt=0)  # to score one request, waiting for the scorer included
    max_batch: int = Field(32, ge=1)  # videos per merged reward call (a bigger single request is scored alone)
    token_env: str | None = None  # environment variable holding the bearer token clients must send
    token_file: str | None = None  # or a file holding it (a mounted secret)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)


class RewardService:
    """The configured rewards; their dimensions merged into one dict. Not thread-safe: call from one thread."""

    def __init__(self, specs: list[RewardSpec]):
        self.rewards = [(spec, build_reward(spec)) for spec in specs]
        self._parameters = {spec.name: MetadataParameters.of(reward) for spec, reward in self.rewards}

    def setup(self, device: str) -> None:
        for _, reward in self.rewards:
            if hasattr(reward, "setup"):
                reward.setup(device)

    def names(self) -> list[str]:
        return [spec.name for spec, _ in self.rewards]

    def check_columns(self, columns: Columns) -> None:
        """A UserError (one line) when a reward requires a column ``columns`` lacks."""
        for spec, _ in self.rewards:
            self._parameters[spec.name].select(columns, spec.name)

    def score(self, videos: VideoBatch, prompts: list[str], columns: Columns | None = None) -> Scores:
        dimensions: Scores = {}
        owners: dict[str, str] = {}
        for spec, reward in self.rewards:
            selected = self._parameters[spec.name].select(columns or {}, spec.name)
            size = spec.batch_size or len(videos)
            chunks = [
                check_scores(
                    reward(
                        videos[start : start + size],
                        prompts[start : start + size],
                        **slice_columns(selected, start, start + size),
                    ),
                    len(prompts[start : start + size]),
                    spec.name,
                )
                for start in range(0, len(videos), size)
            ]
            merge_dimensions(dimensions, join_batches(chunks), spec.name, owners)
        return dimensions


class _Job:
    def __init__(self, request: ScoringRequest):
        self.videos, self.prompts, self.columns, self.future = *request, Future()


def _merged_columns(jobs: list[_Job]) -> Columns:
    """The jobs' columns end to end; a job without a column another has gives None there (as a prompt without it)."""
    names = dict.fromkeys(name for job in jobs for name in job.columns)
    return {name: [v for job in jobs for v in job.columns.get(name, [None] * len(job.prompts))] for name in names}


class Batcher:
    """One scoring thread; requests queued while it works are merged (same fps, up to ``max_batch`` videos)."""

    def __init__(self, service: RewardService, max_batch: int):
        self.service, self.max_batch = service, max_batch
        self._queue: collections.deque[_Job] = collections.deque()
        self._ready = threading.Condition()
        threading.Thread(target=self._run, name="reward-scorer", daemon=True).start()

    def submit(self, request: ScoringRequest) -> Future:
        job = _Job(request)
        with self._ready:
            # Jobs whose clients timed out leave now, not when a hung reward returns: the queue (and the videos it
            # holds) stays bounded by the requests actually waiting, at most one per worker.
            for stale in [queued for queued in self._queue if queued.future.cancelled()]:
                self._queue.remove(stale)
            self._queue.append(job)
            self._ready.notify()
        return job.future

    def _run(self) -> None:
        while True:
            # A job whose client gave up (cancelled future) is dropped here, before it costs a reward call.
            jobs = [job for job in self._next_batch() if job.future.set_running_or_notify_cancel()]
            if jobs:
                self._score(jobs)

    def _next_batch(self) -> list[_Job]:
        with self._ready:
            self._ready.wait_for(lambda: self._queue)
            batch = [self._queue.popleft()]
            size = len(batch[0].videos)
            for job in list(self._queue):
                if job.videos.fps == batch[0].videos.fps and size + len(job.videos) <= self.max_batch:
                    self._queue.remove(job)
                    batch.append(job)
                    size += len(job.videos)
            return batch

    def _score(self, jobs: list[_Job]) -> None:
        videos = VideoBatch([video for job in jobs for video in job.videos], jobs[0].videos.fps)
        try:
            dimensions = self.service.score(
                videos, [prompt for job in jobs for prompt in job.prompts], _merged_columns(jobs)
            )
        except Exception as error:  # noqa: BLE001 (a user reward may raise anything; the handler reports it)
            if len(jobs) == 1:
                jobs[0].future.set_exception(error)
                return
            for job in jobs:  # one client's videos must not fail the others' requests: score each alone
                self._score([job])
            return
        start = 0
        for job in jobs:
            end = start + len(job.videos)
            job.future.set_result({name: values[start:end] for name, values in dimensions.items()})
            start = end


class _Watchdog:
    """Cuts a connection whose request has not fully arrived by its deadline (a client trickling bytes resets a
    per-read socket timeout forever; this bounds the whole request). Cutting = shutting the socket's read side,
    which makes the handler's blocked read return at once with what it has."""

    def __init__(self, tick_s: float):
        self._deadlines: dict[socket.socket, float] = {}
        self._cut: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._tick_s = tick_s
        threading.Thread(target=self._run, name="reward-watchdog", daemon=True).start()

    def watch(self, connection: socket.socket, seconds: float) -> None:
        with self._lock:
            self._deadlines[connection] = time.monotonic() + seconds

    def is_cut(self, connection: socket.socket) -> bool:
        with self._lock:
            return connection in self._cut

    def release(self, connection: socket.socket) -> bool:
        """Stop watching; True when the connection had been cut."""
        with self._lock:
            self._deadlines.pop(connection, None)
            cut = connection in self._cut
            self._cut.discard(connection)
            return cut

    def _run(self) -> None:
        while True:
            time.sleep(self._tick_s)
            now = time.monotonic()
            with self._lock:
                for connection in [c for c, deadline in self._deadlines.items() if deadline < now]:
                    del self._deadlines[connection]
                    self._cut.add(connection)
                    with contextlib.suppress(OSError):  # already closed by the client
                        connection.shutdown(socket.SHUT_RD)


class _Refused(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    server: RewardHTTPServer
    _status: int | None = None
    # Answer even a garbled request line with a status line (HTTP/0.9 answers have none; no client speaks it).
    default_request_version = "HTTP/1.0"

    def setup(self) -> None:
        self.timeout = self.server.settings.read_timeout_s  # per socket read and write; the watchdog bounds the sum
        super().setup()
        self.server.watchdog.watch(self.connection, self.server.settings.read_timeout_s)

    def finish(self) -> None:
        if self.server.watchdog.release(self.connection) and self._status is None:
            self._log_refusal(408, f"request not received within {self.server.settings.read_timeout_s:g} s")
        super().finish()

    def parse_request(self) -> bool:
        # A request the watchdog cut arrives truncated: answer what happened (408), not what the fragment looks like.
        parsed = not self.server.watchdog.is_cut(self.connection) and super().parse_request()
        if not self.server.watchdog.is_cut(self.connection):
            return parsed
        if self._status is None:
            self.send_error(408, f"request not received within {self.server.settings.read_timeout_s:g} s")
        return False

    def do_GET(self):
        if self.path != "/health":
            return self._refuse(404, f"no such path {self.path}")
        self._reply(
            200,
            {
                "status": "ok",
                "rewards": self.server.service.names(),
                "max_body_bytes": self.server.settings.max_body_bytes,
            },
        )

    def do_POST(self):
        try:
            if self.path != "/score":
                raise _Refused(404, f"no such path {self.path}")
            self._check_token()
            request = decode_request(self._read_body())
            self.server.batcher.service.check_columns(request.columns)
        except _Refused as refusal:
            return self._refuse(refusal.status, str(refusal))
        except BadRequest as error:
            return self._refuse(400, f"bad request: {error}")
        except UserError as error:  # well-formed, but a reward needs a prompt column the request does not carry
            return self._refuse(422, str(error))
        self._score(request)

    def _check_token(self) -> None:
        token = self.server.token
        if token is None:
            return
        sent = self.headers.get("Authorization", "")
        # compare_digest: the time taken does not reveal how much of a guessed token was right.
        if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
            raise _Refused(401, "missing or wrong bearer token")

    def _read_body(self) -> bytes:
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise _Refused(411, "Content-Length is required")
        try:
            length = int(raw)
        except ValueError:
            raise _Refused(400, f"Content-Length {raw[:40]!r} is not a number") from None
        limit = self.server.settings.max_body_bytes
        if not 0 <= length <= limit:
            raise _Refused(413 if length > limit else 400, f"body of {length} bytes (the limit is {limit})")
        try:
            body = self.rfile.read(length)
        except OSError as error:  # the per-read timeout, or a reset
            raise _Refused(408, f"body not received: {error}") from None
        if len(body) < length:
            raise _Refused(
                408,
                f"body not received within {self.server.settings.read_timeout_s:g} s ({len(body)} of {length} bytes)",
            )
        self.server.watchdog.release(self.connection)  # the request is in; scoring has its own bound
        return body

    def _score(self, request: ScoringRequest) -> None:
        videos = request.videos
        future = self.server.batcher.submit(request)
        timeout = self.server.settings.request_timeout_s
        try:
            dimensions = future.result(timeout=timeout)
        except FutureTimeout:
            future.cancel()  # still queued: never scored; already running: its result is dropped
            logger.error(
                "scoring %d videos did not finish within %g s (a reward is slow or hangs)", len(videos), timeout
            )
            return self._reply(503, {"error": f"scoring did not finish within {timeout:g} s"})
        except Exception as error:  # noqa: BLE001 (a failing reward: the server's problem, one line, retried)
            message = f"{type(error).__name__}: {error}".splitlines()[0][:500]
            logger.error("scoring %d videos failed: %s", len(videos), message)
            logger.debug("scoring failure", exc_info=error)
            return self._reply(500, {"error": message})
        self._send(200, encode_response(dimensions))

    def _refuse(self, status: int, reason: str) -> None:
        self._log_refusal(status, reason)
        self.close_connection = True  # an unread body may still follow; never parse it as the next request
        self._reply(status, {"error": reason})

    def _log_refusal(self, status: int, reason: str) -> None:
        path = ascii((self.path or "-")[:100])[1:-1]  # escaped: a path must not write control characters into the log
        logger.warning(
            "refused %s %s from %s: %d %s", self.command or "-", path, self.client_address[0], status, reason
        )

    def _reply(self, status: int, payload: dict) -> None:
        self._send(status, json.dumps(payload).encode())

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_response(self, code, message=None):
        self._status = code
        super().send_response(code, message)

    def log_error(self, format, *args):  # http.server's own refusals (bad request line, headers): one line
        logger.warning("refused request from %s: %s", self.client_address[0], format % args)

    def log_message(self, format, *args):  # every answered request; the refusals are logged above
        logger.debug(format, *args)


class RewardHTTPServer(HTTPServer):
    """An HTTP server with a fixed pool of ``workers`` connection handlers; see the module docstring."""

    request_queue_size = 128  # the listen backlog: connections the kernel holds before one is accepted

    def __init__(self, address: tuple[str, int], service: RewardService, settings: ServerSettings):
        self.token = read_secret(settings.token_env, settings.token_file, what="reward server token")
        self.service, self.settings = service, settings
        super().__init__(address, _Handler)
        self.batcher = Batcher(service, settings.max_batch)
        self.watchdog = _Watchdog(tick_s=min(0.25, settings.read_timeout_s / 4))
        self._pool = ThreadPoolExecutor(settings.workers, thread_name_prefix="reward-http")
        self._slots = threading.BoundedSemaphore(settings.workers)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            return self._refuse_busy(request, client_address)
        self._pool.submit(self._handle, request, client_address)

    def _handle(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 (a client that vanished mid-answer; logged in one line)
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def _refuse_busy(self, request: socket.socket, client_address) -> None:
        logger.warning("refused connection from %s: 503 all %d workers busy", client_address[0], self.settings.workers)
        body = json.dumps({"error": f"all {self.settings.workers} workers are busy"}).encode()
        try:
            request.settimeout(1.0)
            request.sendall(
                b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        # socketserver prints a full traceback here; a client that hung up is not worth one.
        error = sys.exc_info()[1]
        logger.warning(
            "connection from %s failed: %s: %s",
            client_address[0],
            type(error).__name__,
            str(error).splitlines()[0][:200] if str(error) else "",
        )

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def serve(specs: list[RewardSpec], host: str, port: int, device: str, settings: ServerSettings | None = None) -> None:
    """Build and set up the rewards, then serve until interrupted. Port 0 picks a free port; the chosen address is
    printed as ``serving rewards on http://HOST:PORT`` once the server accepts connections."""
    settings = settings or ServerSettings()
    service = RewardService(specs)
    service.setup(device)
    try:
        server = RewardHTTPServer((host, port), service, settings)
    except OSError as error:  # port taken, or an address this machine does not have
        raise UserError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    auth = "token required" if server.token else "no token"
    print(f"serving rewards on http://{host}:{server.server_address[1]}", flush=True)
    logger.info("reward server: %d workers, bodies up to %g MB, %s", settings.workers, settings.max_body_mb, auth)
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
