"""``serve-reward CONFIG --port P``: serve configured rewards over HTTP for the ``remote`` reward.

Endpoints: ``GET /health`` -> ``{"status": "ok", "rewards": [names], "max_body_bytes": N}`` (open, for probes; 503
with ``"status": "unhealthy"`` and the reason while the server cannot score); ``POST /score`` with a safetensors
request (see ``wire``) -> ``{"dimensions": {...}}`` with every reward's raw, unweighted dimensions (the client weighs
them). Each reward gets the request's prompt columns it takes (keyword arguments, as in process); a request lacking a
column a reward requires is answered 422 naming it.

A shared service that treats every request as untrusted data (``ServerSettings`` holds the bounds):
- it binds loopback unless told otherwise, and never unpickles;
- one asyncio loop receives every request, which must arrive whole (request line, headers and body) within
  ``read_timeout_s``: an idle, trickling or unauthenticated client holds a coroutine and the bytes it sent, never a
  worker; at most ``max_connections`` are open at once (one more is answered 503 at once);
- ``Content-Length`` is checked against ``max_body_mb`` before the body is read, and the bodies held (received or
  being scored) stay within ``workers x max_body_mb`` together (503 beyond);
- with a token configured, ``/score`` needs ``Authorization: Bearer <token>`` (compared in constant time) before its
  body is read;
- a whole request to score is handed to one of ``workers`` threads; with every one busy it is answered 503 at once
  and the client retries; everything else (health, refusals) is answered on the loop;
- every bad request is answered 4xx with one log line, never a traceback; a reward that raises answers 500 (the
  client retries).
Rewards run one call at a time (GPU reward models are not thread-safe); requests that wait for the scorer together
are merged into one batch of up to ``max_batch`` videos (the reward contract scores each video on its own, so merging
changes no score) and each client gets its own slice back. A call that outlives ``request_timeout_s`` is abandoned
(Python cannot stop a thread): its clients get 503, ``/health`` answers 503, and a fresh set of rewards is built for
what follows, since the old set is still inside that call. Abandoned calls still running hold their rewards' memory:
with more than ``max_hung_calls`` of them the server stays unhealthy until one returns (or a supervisor that probes
``/health`` replaces it).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import http.client
import io
import json
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler

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
    max_connections: int = Field(512, ge=1)  # open at once, requests still arriving included
    max_hung_calls: int = Field(2, ge=0)  # abandoned reward calls still running before the server stays unhealthy
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


class CannotScore(RuntimeError):
    """The request's reward call was abandoned (it outlived its timeout), or no rewards are ready to score: 503."""


class Batcher:
    """One reward call at a time; requests queued while it runs are merged (same fps, up to ``max_batch`` videos).

    Each call runs in its own thread, waited on for ``call_timeout_s``; one that outlives it is abandoned and the
    rewards are rebuilt with ``build_service`` (see the module docstring). ``problem`` says why nothing can be scored
    now (None when healthy).
    """

    def __init__(
        self,
        build_service: Callable[[], RewardService],
        max_batch: int,
        call_timeout_s: float,
        max_hung_calls: int,
    ):
        self._build_service, self.max_batch = build_service, max_batch
        self.call_timeout_s, self.max_hung_calls = call_timeout_s, max_hung_calls
        self.service = build_service()
        self.problem: str | None = None
        self._hung: list[threading.Thread] = []
        self._queue: collections.deque[_Job] = collections.deque()
        self._ready = threading.Condition()
        threading.Thread(target=self._run, name="reward-dispatcher", daemon=True).start()

    def submit(self, request: ScoringRequest) -> Future:
        job = _Job(request)
        with self._ready:
            # Jobs whose clients timed out leave now, not when a slow call returns: the queue (and the videos it
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
        if self.problem is not None:  # the rewards could not be rebuilt: nothing can score these
            for job in jobs:
                job.future.set_exception(CannotScore(self.problem))
            return
        videos = VideoBatch([video for job in jobs for video in job.videos], jobs[0].videos.fps)
        prompts = [prompt for job in jobs for prompt in job.prompts]
        outcome: dict[str, object] = {}
        call = threading.Thread(
            target=_call, args=(self.service, outcome, videos, prompts, _merged_columns(jobs)), daemon=True
        )
        call.start()
        call.join(self.call_timeout_s)
        if call.is_alive():
            return self._abandon(call, jobs)
        if "error" in outcome:
            if len(jobs) == 1:
                jobs[0].future.set_exception(outcome["error"])
                return
            for job in jobs:  # one client's videos must not fail the others' requests: score each alone
                self._score([job])
            return
        start = 0
        for job in jobs:
            end = start + len(job.videos)
            job.future.set_result({name: values[start:end] for name, values in outcome["dimensions"].items()})
            start = end

    def _abandon(self, call: threading.Thread, jobs: list[_Job]) -> None:
        """Fail the hung call's jobs and score on with fresh rewards (the old ones are still inside that call)."""
        for job in jobs:
            job.future.set_exception(CannotScore(f"scoring did not finish within {self.call_timeout_s:g} s"))
        self._hung = [thread for thread in self._hung if thread.is_alive()] + [call]
        logger.error(
            "a reward call on %d videos did not finish within %g s: abandoned (%d abandoned calls still running), "
            "rebuilding the rewards",
            sum(len(job.videos) for job in jobs),
            self.call_timeout_s,
            len(self._hung),
        )
        while len(self._hung) > self.max_hung_calls:
            self.problem = (
                f"{len(self._hung)} abandoned reward calls still running (max_hung_calls={self.max_hung_calls})"
            )
            self._hung[0].join(1.0)
            self._hung = [thread for thread in self._hung if thread.is_alive()]
        self.problem = "rebuilding the rewards after a reward call hung"
        try:
            self.service = self._build_service()
        except Exception as error:  # noqa: BLE001 (unhealthy for good, said in one line; /health reports it)
            self.problem = f"rebuilding the rewards failed: {_one_line(error)}"
            logger.error("%s", self.problem)
            return
        self.problem = None
        logger.info("rewards rebuilt; scoring again")


def _call(service: RewardService, outcome: dict, videos: VideoBatch, prompts: list[str], columns: Columns) -> None:
    """One reward call, its dimensions or error left in ``outcome`` (the thread that made it may be abandoned)."""
    try:
        outcome["dimensions"] = service.score(videos, prompts, columns)
    except Exception as error:  # noqa: BLE001 (a user reward may raise anything; the handler reports it)
        outcome["error"] = error
    except BaseException as error:  # noqa: BLE001 (sys.exit in a reward fails its request, not the scorer)
        outcome["error"] = RuntimeError(f"the reward raised {type(error).__name__}: {error}")


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:500]


class _Refused(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


_MAX_LINE = 65536  # a request or header line (http.server's own bound)
_MAX_HEAD = 65536  # the request line and headers together


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    """The request line and headers through the blank line that ends them, or what came before the client stopped."""
    head = b""
    while True:
        try:
            line = await reader.readline()
        except ValueError:  # a line past the stream's limit
            raise _Refused(431, f"a request or header line longer than {_MAX_LINE} bytes") from None
        head += line
        if len(head) > _MAX_HEAD:
            raise _Refused(431, f"request line and headers longer than {_MAX_HEAD} bytes")
        if line in (b"", b"\r\n", b"\n"):
            return head


def _check_token(headers, token: str | None) -> None:
    if token is None:
        return
    sent = headers.get("Authorization", "")
    # compare_digest: the time taken does not reveal how much of a guessed token was right.
    if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
        raise _Refused(401, "missing or wrong bearer token")


def _declared_length(headers, limit: int) -> int:
    raw = headers.get("Content-Length")
    if raw is None:
        raise _Refused(411, "Content-Length is required")
    try:
        length = int(raw)
    except ValueError:
        raise _Refused(400, f"Content-Length {raw[:40]!r} is not a number") from None
    if not 0 <= length <= limit:
        raise _Refused(413 if length > limit else 400, f"body of {length} bytes (the limit is {limit})")
    return length


def _response(status: int, payload: dict) -> bytes:
    """A whole HTTP/1.0 answer, for what is answered before (or instead of) a handler."""
    body = json.dumps(payload).encode()
    retry = "Retry-After: 1\r\n" if status == 503 else ""
    head = (
        f"HTTP/1.0 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n{retry}"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Handler(BaseHTTPRequestHandler):
    """Answers one request that has arrived whole: it reads the request from memory and writes its answer to memory
    (the server's loop does the network I/O), so it never waits on a client."""

    server: RewardHTTPServer
    # Answer even a garbled request line with a status line (HTTP/0.9 answers have none; no client speaks it).
    default_request_version = "HTTP/1.0"

    @classmethod
    def answer(cls, head: bytes, body: bytes, client: str, server: RewardHTTPServer) -> bytes:
        try:
            return cls((head, body), (client, 0), server).wfile.getvalue()
        except Exception as error:  # noqa: BLE001 (a bug of ours costs one line and a 500, not the connection)
            logger.error("answering a request from %s failed: %s", client, _one_line(error))
            return _response(500, {"error": "internal error"})

    def setup(self) -> None:
        head, self.body = self.request
        self.rfile, self.wfile = io.BytesIO(head), io.BytesIO()

    def finish(self) -> None:  # the answer stays in wfile for the server to send
        pass

    def do_GET(self):
        if self.path != "/health":
            return self._refuse(404, f"no such path {self.path}")
        problem = self.server.batcher.problem
        self._reply(
            200 if problem is None else 503,
            {
                "status": "ok" if problem is None else "unhealthy",
                "rewards": self.server.batcher.service.names(),
                "max_body_bytes": self.server.settings.max_body_bytes,
            }
            | ({} if problem is None else {"reason": problem}),
        )

    def do_POST(self):
        try:
            if self.path != "/score":
                raise _Refused(404, f"no such path {self.path}")
            _check_token(self.headers, self.server.token)
            length = _declared_length(self.headers, self.server.settings.max_body_bytes)
            if len(self.body) < length:  # the client stopped sending
                raise _Refused(408, f"body not received ({len(self.body)} of {length} bytes)")
            if self.server.batcher.problem is not None:
                raise _Refused(503, f"cannot score now: {self.server.batcher.problem}")
            request = decode_request(self.body)
            self.server.batcher.service.check_columns(request.columns)
        except _Refused as refusal:
            return self._refuse(refusal.status, str(refusal))
        except BadRequest as error:
            return self._refuse(400, f"bad request: {error}")
        except UserError as error:  # well-formed, but a reward needs a prompt column the request does not carry
            return self._refuse(422, str(error))
        self._score(request)

    def _score(self, request: ScoringRequest) -> None:
        videos = request.videos
        future = self.server.batcher.submit(request)
        timeout = self.server.settings.request_timeout_s
        try:
            dimensions = future.result(timeout=timeout)
        except (FutureTimeout, CannotScore) as error:
            future.cancel()  # still queued: never scored; already running: its result is dropped
            reason = str(error) or f"scoring did not finish within {timeout:g} s"
            logger.error("scoring %d videos: %s", len(videos), reason)
            return self._reply(503, {"error": reason})
        except Exception as error:  # noqa: BLE001 (a failing reward: the server's problem, one line, retried)
            message = _one_line(error)
            logger.error("scoring %d videos failed: %s", len(videos), message)
            logger.debug("scoring failure", exc_info=error)
            return self._reply(500, {"error": message})
        self._send(200, encode_response(dimensions))

    def _refuse(self, status: int, reason: str) -> None:
        self._log_refusal(status, reason)
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
        if status == 503:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_error(self, format, *args):  # http.server's own refusals (bad request line, headers): one line
        logger.warning("refused request from %s: %s", self.client_address[0], format % args)

    def log_message(self, format, *args):  # every answered request; the refusals are logged above
        logger.debug(format, *args)


class RewardHTTPServer:
    """Receives requests on one asyncio loop and answers them with ``_Handler``; see the module docstring."""

    def __init__(self, address: tuple[str, int], batcher: Batcher, settings: ServerSettings):
        self.token = read_secret(settings.token_env, settings.token_file, what="reward server token")
        self.batcher, self.settings = batcher, settings
        self.socket = socket.create_server(address, backlog=128)
        self.server_address = self.socket.getsockname()
        self._pool = ThreadPoolExecutor(settings.workers, thread_name_prefix="reward-http")
        # Touched by the loop's thread only.
        self._connections = self._scoring = self._held_bytes = 0

    def serve_forever(self) -> None:
        asyncio.run(self._serve())

    def server_close(self) -> None:
        self.socket.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._connection, sock=self.socket, limit=_MAX_LINE + 2, backlog=128)
        async with server:
            await server.serve_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = (writer.get_extra_info("peername") or ("-",))[0]
        self._connections += 1
        try:
            if self._connections > self.settings.max_connections:
                answer = self._refusal(client, 503, f"all {self.settings.max_connections} connections are open")
            else:
                answer = await self._answer(reader, client)
            writer.write(answer)
            async with asyncio.timeout(self.settings.read_timeout_s):  # a client that does not read its answer
                await writer.drain()
        except (OSError, TimeoutError) as error:
            logger.warning("connection from %s failed: %s", client, _one_line(error))
        finally:
            self._connections -= 1
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, client: str) -> bytes:
        settings, held, chunks = self.settings, 0, []
        try:
            async with asyncio.timeout(settings.read_timeout_s):
                head = await _read_head(reader)
                length = self._body_length(head)
                while held < length and (chunk := await reader.read(min(length - held, 2**20))):
                    held += len(chunk)
                    self._held_bytes += len(chunk)
                    chunks.append(chunk)
                    if self._held_bytes > settings.workers * settings.max_body_bytes:
                        raise _Refused(503, "the request bodies held reach workers x max_body_mb")
            if not length:  # nothing to score: answered at once, here
                return _Handler.answer(head, b"", client, self)
            if self._scoring >= settings.workers:
                raise _Refused(503, f"all {settings.workers} workers are busy")
            self._scoring += 1
            try:
                body = b"".join(chunks)
                chunks.clear()
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._pool, _Handler.answer, head, body, client, self)
            finally:
                self._scoring -= 1
        except TimeoutError:
            return self._refusal(client, 408, f"request not received within {settings.read_timeout_s:g} s")
        except _Refused as refusal:
            return self._refusal(client, refusal.status, str(refusal))
        finally:
            self._held_bytes -= held

    def _body_length(self, head: bytes) -> int:
        """The body to read before answering: an authorized ``POST /score``'s valid Content-Length, else 0 (anything
        else is answered from its head, and the body of a request that is refused is never read)."""
        request_line, _, fields = head.partition(b"\n")
        if request_line.split()[:2] != [b"POST", b"/score"]:
            return 0
        try:
            headers = http.client.parse_headers(io.BytesIO(fields))
            _check_token(headers, self.token)
            return _declared_length(headers, self.settings.max_body_bytes)
        except (http.client.HTTPException, _Refused):  # the handler answers what is wrong
            return 0

    @staticmethod
    def _refusal(client: str, status: int, reason: str) -> bytes:
        logger.warning("refused request from %s: %d %s", client, status, reason)
        return _response(status, {"error": reason})


def serve(specs: list[RewardSpec], host: str, port: int, device: str, settings: ServerSettings | None = None) -> None:
    """Build and set up the rewards, then serve until interrupted. Port 0 picks a free port; the chosen address is
    printed as ``serving rewards on http://HOST:PORT`` once the server accepts connections."""
    settings = settings or ServerSettings()

    def build_service() -> RewardService:
        service = RewardService(specs)
        service.setup(device)
        return service

    batcher = Batcher(build_service, settings.max_batch, settings.request_timeout_s, settings.max_hung_calls)
    try:
        server = RewardHTTPServer((host, port), batcher, settings)
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
